"""Where an episode's commands run: the workspace backend interface and the local backend.

A backend makes a `Workspace` for a task; the episode only ever calls the four methods below, so
the same episode runs on this machine (LocalBackend: a directory + envs/sandbox.run_bash) or in a
container (envs/workspace_docker.py: DockerBackend, see docs/environments.md#container-backend).

Local layout (every directory outside `repo/` belongs to root, the commands run as a fresh uid
that owns only `repo/`; root_dir is what stays visible inside the sandbox's mount namespace):

    <root_dir>/                  0711  traversable, not listable
      site-3.X/                  0755  pytest for the sandbox python, when it has none
      envs/KEY-DIGEST/site/      0755  a repository's environment (envs/repo_env.py: mount), read-only
                                       to the sandbox uid; on its python path with site-3.X
      ep-XXXX/                   0711
        repo/                    0700  the workspace: the task's files, the command's cwd
        tools/                   0755  helpers on PATH (view, replace, run_tests, submit, runners)
        score/                   the scoring copy, made at score(): the task's snapshot plus the
                                 agent's source changes (envs/scoring_run.py)
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from typing import Protocol

from . import repo_env, scoring_run
from .isolation import claim
from .safe_path import clear_for_write
from .sandbox import MASKED_DIRS, SYSTEM_PYTHONS, BashLimits, SandboxResult, fresh_uid, isolation, run_bash
from .test_report import ScoreInfo, parse_report  # noqa: F401  (parse_report: re-exported)
from .workspace_tools import tool_files


class Workspace(Protocol):
    error: str  # non-empty when the workspace could not be made (-> sandbox_error)

    def run(self, command: str, limits: BashLimits) -> SandboxResult: ...
    def over_limit(self, max_mb: int, max_files: int) -> str: ...  # "" or why
    def run_hidden_tests(
        self, task, limits
    ) -> tuple[dict[str, str], str]: ...  # ({test id: PASS|FAIL|SKIP}, detail)
    def close(self) -> None: ...


class WorkspaceBackend(Protocol):
    def create(self, task, limits) -> Workspace: ...


def _runs(py: str, code: str, uid: int | None, env: dict | None = None) -> bool:
    kw = dict(user=uid, group=uid, extra_groups=[]) if uid is not None else {}
    try:
        return (
            subprocess.run(
                [py, "-c", code], capture_output=True, timeout=30, cwd="/", env=env, **kw
            ).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


def _under_masks(path: str) -> bool:
    """An environment under a masked directory (a venv in /tmp) runs for the sandbox uid outside
    the sandbox, but inside only its base interpreter is left."""
    real = os.path.realpath(path)
    return any(real == m or real.startswith(m + "/") for m in MASKED_DIRS)


def _hidden_in_sandbox() -> bool:
    """This environment, or the pytest it would score with (a .pth may add a site dir from
    elsewhere), lies under a masked directory."""
    import importlib.util

    found = [importlib.util.find_spec(m) for m in ("pytest", "pluggy")]
    return any(_under_masks(p) for p in [sys.prefix] + [s.origin for s in found if s and s.origin])


@functools.cache
def sandbox_runtime(root_dir: str) -> tuple[str, str]:
    """(python, site dir or "") for the sandbox: this interpreter when the sandbox uid can run it
    (it has pytest) and the sandbox does not hide its environment (MASKED_DIRS), else a system python
    plus a read-only copy of pytest and its (pure-Python) requirements from this environment in
    `root_dir/site-<python version>`: this environment may live where a fresh uid cannot read (a
    venv under /root)."""
    uid = fresh_uid()
    if not _hidden_in_sandbox() and _runs(sys.executable, "import pytest", uid):
        return sys.executable, ""
    py = next((p for p in SYSTEM_PYTHONS if _runs(p, "pass", uid)), isolation()[0])
    if _runs(py, "import pytest", uid):
        return py, ""
    site = pytest_site(root_dir)
    ok = _runs(py, "import pytest", uid, {"PYTHONPATH": site, "PATH": "/usr/bin:/bin"})
    return py, site if ok else ""


def pytest_site(root_dir: str) -> str:
    """`root_dir/site-<python version>`: a copy of pytest and its (pure-Python) requirements from
    this environment, made once (the sandbox's, or a container image's, when its python has none)."""
    site = os.path.join(root_dir, f"site-{sys.version_info[0]}.{sys.version_info[1]}")
    if not os.path.exists(os.path.join(site, ".complete")):
        _copy_dists(["pytest"], site)
    return site


def _copy_dists(names: list[str], dest: str) -> None:
    """Copy installed distributions and their requirements (files under site-packages only)."""
    import re
    import threading
    from importlib import metadata

    tmp = dest + f".tmp{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    seen, todo = set(), list(names)
    while todo:
        name = re.split(r"[ ;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if not name or name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        todo += [r for r in (dist.requires or []) if "extra ==" not in r]
        for f in dist.files or []:
            if (
                f.parts[0] == ".."
                or f.suffix in (".pyc",)
                or f.parts[0].endswith(".dist-info")
                and f.name == "RECORD"
            ):
                continue
            src = f.locate()
            if os.path.isfile(src):
                d = os.path.join(tmp, *f.parts)
                os.makedirs(os.path.dirname(d), exist_ok=True)
                shutil.copyfile(src, d)
    for d, _dirs, files in os.walk(tmp):
        os.chmod(d, 0o755)
        for x in files:
            os.chmod(os.path.join(d, x), 0o644)
    open(os.path.join(tmp, ".complete"), "w").close()
    try:
        os.rename(tmp, dest)  # atomic; fails if another process or thread got there first
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def default_root() -> str:
    """The episodes root, per user: $XDG_RUNTIME_DIR/asyncrl-episodes for a user that is not root
    (its sandboxed commands run as itself), else /tmp/asyncrl-<uid> (root's sandbox uids must
    traverse it: 0711). Checked by private_root before use."""
    uid, run = os.geteuid(), os.environ.get("XDG_RUNTIME_DIR", "")
    if uid != 0 and run and os.path.isdir(run) and os.stat(run).st_uid == uid:
        return os.path.join(run, "asyncrl-episodes")
    return os.path.join(tempfile.gettempdir(), f"asyncrl-{uid}")


def private_root(path: str) -> str:
    """`path` made (0711) or checked as an episodes root: a real directory this process's uid owns
    that no other user may list or write (mode 0700, or 0711: sandbox uids reach their own
    workspace only). Anything else is refused (ValueError): a root another user planted decides
    what the scoring runs import (a runner module there made an untouched repository score 1.0)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        os.mkdir(path, 0o711)
    except FileExistsError:
        pass
    st = os.lstat(path)
    fix = "remove it, or give the worker another root"
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"episodes root {path} is not a directory (a symlink or file is there): {fix}")
    if st.st_uid != os.geteuid():
        raise ValueError(
            f"episodes root {path} is owned by uid {st.st_uid}, not by this process's uid "
            f"{os.geteuid()}: another user may have planted it; {fix}"
        )
    if st.st_mode & 0o066:
        raise ValueError(
            f"episodes root {path} has mode {st.st_mode & 0o777:o}: other users may list or write it "
            "(chmod 711)"
        )
    return path


class LocalBackend:
    """Workspaces as directories on this machine; picklable (a path and a python)."""

    def __init__(self, root_dir: str | None = None, python: str | None = None):
        self.root_dir, self.python = root_dir or default_root(), python

    def create(self, task, limits) -> LocalWorkspace:
        private_root(self.root_dir)
        os.chmod(self.root_dir, 0o711)
        python, site = (self.python, "") if self.python else sandbox_runtime(self.root_dir)
        return LocalWorkspace(task, self.root_dir, python, site)


class LocalWorkspace:
    def __init__(self, task, root_dir: str, python: str, site: str = ""):
        self.error, self.python, self.site, self.root_dir = "", python, site, root_dir
        self.env_site = ""  # the repository's environment as mounted (envs/repo_env.py), if any
        self.score_info = ScoreInfo()  # what the last scoring run found (Episode.score reads it)
        self.uid = fresh_uid()
        private_root(root_dir)
        os.chmod(root_dir, 0o711)
        self.root = tempfile.mkdtemp(prefix="ep-", dir=root_dir)
        self._claim = claim(self.root)  # held while we live: a restart's reap() spares it
        os.chmod(self.root, 0o711)
        self.repo, self.tools = os.path.join(self.root, "repo"), os.path.join(self.root, "tools")
        try:
            image = (task.meta or {}).get("image")
            if image and not task.base_dir:
                raise ValueError(
                    f"the repository of task {task.task_id} is only in its image {image} (no snapshot "
                    'here): run it with the docker workspace backend ([worker.episodes] workspace = "docker")'
                )
            if task.base_dir:
                _copy_tree(task.base_dir, self.repo)
            os.makedirs(self.repo, exist_ok=True)
            _write_files(self.repo, task.files)
            _chown_tree(self.repo, self.uid)
            os.chmod(self.repo, 0o700)  # other episodes see the same root_dir: keep them out
            os.makedirs(self.tools)
            for name, (text, mode) in tool_files(python, task.runner, task.test_paths, self.tools).items():
                p = os.path.join(self.tools, name)
                with open(p, "w") as f:
                    f.write(text)
                os.chmod(p, mode)
            os.chmod(self.tools, 0o755)
            if task.env_dir:
                self.env_site = repo_env.mount(root_dir, task.env_dir)
        except (OSError, ValueError, repo_env.EnvError) as e:
            self.error = f"workspace setup failed: {e}"

    def _env(self) -> dict[str, str]:
        env = {"PATH": f"{self.tools}:/usr/local/bin:/usr/bin:/bin"}
        # the same path for the agent's commands and the scoring run (CODE_PATH places it there)
        path = [p for p in (self.site, self.env_site) if p]
        if path:
            env["PYTHONPATH"] = os.pathsep.join(path)
        return env

    def run(self, command: str, limits: BashLimits) -> SandboxResult:
        return run_bash(command, self.root_dir, self.repo, limits, self.uid, self._env())

    def over_limit(self, max_mb: int, max_files: int) -> str:
        total = n = 0
        for d, dirs, files in os.walk(self.repo):
            for name in dirs + files:
                n += 1
                try:
                    total += os.lstat(os.path.join(d, name)).st_size
                except OSError:
                    pass
                if n > max_files:
                    return f"workspace has more than {max_files} files"
                if total > max_mb << 20:
                    return f"workspace is over {max_mb} MB"
        return ""

    def run_hidden_tests(self, task, limits) -> tuple[dict[str, str], str]:
        """Run the task's tests on a copy of the workspace with the hidden tests restored, under a
        uid of its own (so nothing the episode left running or writable can touch it)."""
        score = os.path.join(self.root, "score")
        uid = fresh_uid()
        lim = BashLimits(
            **{
                **limits.command.__dict__,
                "wall_s": limits.score_wall_s,
                "cpu_s": int(limits.score_wall_s) + 1,
                "keep_bytes": max(limits.command.keep_bytes, 4 << 20),
            }
        )  # every report line

        def prepare(d: str) -> None:
            _chown_tree(d, uid)
            os.chmod(d, 0o700)

        try:
            status, detail, self.score_info = scoring_run.score(
                task,
                self.repo,
                score,
                self.tools,
                lambda cmd: run_bash(cmd, self.root_dir, score, lim, uid, self._env()),
                prepare,
            )
        finally:
            shutil.rmtree(score, ignore_errors=True)
        return status, detail

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        if self._claim >= 0:
            os.close(self._claim)
            self._claim = -1


def _write_files(dest: str, files: dict[str, str]) -> None:
    """Write files under dest as root, never through a symlink: a workspace the agent shaped may
    have replaced a directory by a link to anywhere on the host."""
    for rel, text in files.items():
        path = clear_for_write(dest, rel, "task file path", "the workspace")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def _copy_tree(src: str, dst: str) -> None:
    """Directories, regular files and symlinks (as links); anything else (fifos, sockets,
    devices a command made) is skipped: opening a fifo to copy it would block forever."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        st = os.lstat(s)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(s), d)
        elif stat.S_ISDIR(st.st_mode):
            _copy_tree(s, d)
        elif stat.S_ISREG(st.st_mode):
            shutil.copyfile(s, d)
            os.chmod(d, stat.S_IMODE(st.st_mode) | 0o600)


def _chown_tree(path: str, uid: int | None) -> None:
    if uid is None:
        return
    os.lchown(path, uid, uid)
    for d, dirs, files in os.walk(path):
        for n in dirs + files:
            os.lchown(os.path.join(d, n), uid, uid)
