"""The episodes root (envs/workspace.py: default_root, private_root) is per user and refused unless
this process's uid owns it and no other user may list or write it: a root another user planted
(holding a module the scoring run would import) is a clear error before any workspace is made, and
the worker refuses to start on it. Run as other uids (the box's tests run as root; users are not)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from envs.episode import EpisodeLimits
from envs.workspace import LocalBackend, default_root, private_root
from tests.helpers.agentic import bug_task

PLANTER, VICTIM = 4242, 4243


def as_uid(uid: int, code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`code` run as `uid` (imports as root: the interpreter lives where other uids cannot read,
    then drops to the uid for good)."""
    pre = (
        "import os, sys\n"
        "from envs.workspace import default_root, private_root\n"
        "from rollout_worker.__main__ import main\n"
        f"os.setgroups([]); os.setgid({uid}); os.setuid({uid})\n"
    )
    return subprocess.run(
        [sys.executable, "-B", "-c", pre + code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": os.getcwd(), **(env or {})},
    )


@pytest.fixture
def planted():
    """/tmp/asyncrl-<VICTIM>, made by another uid before the victim's first run, with a runner."""
    root = os.path.join(tempfile.gettempdir(), f"asyncrl-{VICTIM}")
    shutil.rmtree(root, ignore_errors=True)
    os.mkdir(root, 0o777)
    with open(os.path.join(root, "conftest.py"), "w") as f:
        f.write("import os; os._exit(0)  # every test 'passes'\n")
    os.chown(root, PLANTER, PLANTER)
    os.chmod(root, 0o777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_the_default_root_is_per_user_and_private():
    mine = default_root()
    assert mine == os.path.join(tempfile.gettempdir(), f"asyncrl-{os.geteuid()}")
    assert private_root(mine) == mine
    st = os.lstat(mine)
    assert st.st_uid == os.geteuid() and st.st_mode & 0o066 == 0
    other = os.path.join(tempfile.gettempdir(), f"asyncrl-{PLANTER}")
    shutil.rmtree(other, ignore_errors=True)
    try:
        out = as_uid(PLANTER, "print(private_root(default_root()))")
        assert out.returncode == 0 and out.stdout.strip() == other, out.stderr
        assert os.stat(other).st_uid == PLANTER and os.stat(other).st_mode & 0o777 == 0o711
        # a user with a runtime dir of its own gets the root there
        run = tempfile.mkdtemp()
        os.chown(run, PLANTER, PLANTER)
        out = as_uid(PLANTER, "print(default_root())", {"XDG_RUNTIME_DIR": run})
        assert out.stdout.strip() == os.path.join(run, "asyncrl-episodes"), out.stderr
        shutil.rmtree(run)
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_a_planted_root_is_refused_before_any_workspace(planted):
    out = as_uid(VICTIM, "private_root(default_root())")
    assert out.returncode != 0 and f"owned by uid {PLANTER}" in out.stderr and "planted" in out.stderr
    # the worker refuses to start on it (before its broker or any task)
    out = as_uid(VICTIM, "sys.exit(main([]))")
    assert out.returncode == 2 and "refuses to start" in out.stderr and "owned by uid" in out.stderr, (
        out.stderr
    )
    # and a backend pointed at it (as root here) makes no workspace there
    with pytest.raises(ValueError, match=f"owned by uid {PLANTER}"):
        LocalBackend(planted).create(bug_task(), EpisodeLimits())
    assert sorted(os.listdir(planted)) == ["conftest.py"]


def test_a_root_others_may_write_or_a_symlink_is_refused(tmp_path):
    wide = tmp_path / "wide"
    wide.mkdir(mode=0o777)
    wide.chmod(0o777)
    with pytest.raises(ValueError, match="mode 777"):
        private_root(str(wide))
    link = tmp_path / "link"
    link.symlink_to(wide)
    with pytest.raises(ValueError, match="not a directory"):
        private_root(str(link))
