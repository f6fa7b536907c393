"""A user who is not root, for the tests of what such a user gets (the tests themselves run as root).

`unprivileged()` creates the user when missing (useradd), gives it a directory of its own under its
home (outside /tmp, /var/tmp and /dev/shm, which the sandbox masks), and a python it can run that
sees this environment's packages: this venv's own interpreter when the user may run it, else a
system python of the same version with a venv of its own pointing at this one's site-packages (an
interpreter under /root, 0700, is out of its reach). It returns a reason instead when something a
non-root run needs is missing here (root, user namespaces, a readable checkout), for a skip.
AS_NOBODY and NO_USERNS run the scorer's start-up as uid 65534, with user namespaces or without.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

NAME = "asyncrl-user"
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class User:
    name: str
    uid: int
    gid: int
    base: Path  # owned by the user, 0700: its runs, episode workspaces and caches
    python: str
    env: dict = field(default_factory=dict)

    def kw(self, env: dict | None = None) -> dict:
        """subprocess keywords that run a command as this user."""
        return dict(
            user=self.uid,
            group=self.gid,
            extra_groups=[],
            env={**self.env, **(env or {})},
            cwd=str(self.base),
        )

    def run(self, argv: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **self.kw(env)
        )

    def close(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def _user() -> pwd.struct_passwd | str:
    try:
        return pwd.getpwnam(NAME)
    except KeyError:
        pass
    r = subprocess.run(
        ["useradd", "--system", "--user-group", "--create-home", "--shell", "/usr/sbin/nologin", NAME],
        capture_output=True,
        text=True,
    )
    try:  # (another test process may have made it meanwhile)
        return pwd.getpwnam(NAME)
    except KeyError:
        return f"could not create the user {NAME}: useradd: {r.stderr.strip() or r.returncode}"


def _env(name: str, base: Path, python: str, numba_cache: Path) -> dict:
    return {
        # compiled kernels kept between runs (HOME is a fresh directory each time)
        "NUMBA_CACHE_DIR": str(numba_cache),
        # the venv's bin dir too: nats-server comes with it
        "PATH": f"{Path(python).parent}:{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(base),
        "USER": name,
        "LOGNAME": name,
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }


def _python(u: User) -> str | None:
    """A python the user can run that imports this checkout and its packages, made if need be."""
    probe = ["-c", "import torch, nats, envs, asyncrl"]

    def runs(py: str) -> bool:
        try:
            return u.run([py, *probe], 300).returncode == 0
        except PermissionError:  # (an interpreter under a directory closed to the user)
            return False

    if runs(sys.executable):
        return sys.executable
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    system = next(
        (p for p in (f"/usr/bin/python{ver}", f"/usr/local/bin/python{ver}") if os.access(p, os.X_OK)), None
    )
    if system is None:
        return None
    venv = u.base / "python"
    if u.run([system, "-m", "venv", "--without-pip", str(venv)], 120).returncode != 0:
        return None
    site = venv / "lib" / f"python{ver}" / "site-packages"
    purelib = sysconfig.get_paths()["purelib"]  # this venv's: its .pth files are processed too
    (site / "asyncrl-env.pth").write_text(f"import site; site.addsitedir({purelib!r})\n")
    py = str(venv / "bin" / "python")
    return py if runs(py) else None


def unprivileged() -> User | str:
    """The user, ready, or why not (a skip reason)."""
    if os.geteuid() != 0:
        return "needs root, to create and become a user who is not root"
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        return "needs unshare and setpriv: apt-get install -y util-linux"
    pw = _user()
    if isinstance(pw, str):
        return pw
    home = Path(pw.pw_dir)
    if not home.is_dir() or str(home).startswith(("/tmp", "/var/tmp", "/dev/shm", "/nonexistent")):
        return f"{NAME}'s home {home} is not a directory outside the sandbox's masked paths"
    base = Path(tempfile.mkdtemp(prefix="asyncrl-test-", dir=home))
    os.chown(base, pw.pw_uid, pw.pw_gid)
    os.chmod(base, 0o700)
    cache = home / ".cache" / "asyncrl-tests-numba"
    for d in (cache.parent, cache):
        d.mkdir(exist_ok=True)
        os.chown(d, pw.pw_uid, pw.pw_gid)
    u = User(pw.pw_name, pw.pw_uid, pw.pw_gid, base, sys.executable)
    u.env = _env(u.name, base, sys.executable, cache)
    try:
        if u.run(["unshare", "-r", "true"], 60).returncode != 0:
            u.close()
            return "user namespaces are not available to a user who is not root here"
        if u.run(["ls", str(ROOT / "envs" / "sandbox.py")], 60).returncode != 0:
            u.close()
            return f"the checkout {ROOT} is not readable by {NAME}"
        py = _python(u)
    except subprocess.TimeoutExpired:
        u.close()
        return f"{NAME} could not start python in time"
    if py is None:
        u.close()
        ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
        return f"no python that {NAME} may run imports this environment ({sys.executable}; python{ver})"
    u.python, u.env = py, _env(u.name, base, py, cache)
    return u


# Runs the real start-up path (scorer's __main__) as an unprivileged user: imports as root (the
# interpreter lives where nobody cannot read), then drops to uid/gid 65534 for good.
AS_NOBODY = """
import ctypes, os, sys
import scorer.__main__ as m
os.setgroups([]); os.setgid(65534); os.setuid(65534)
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)          # dumpable again (its /proc/self/ns, as any process)
sys.exit(m.main(["--config", sys.argv[1]]))
"""


# Runs the code in argv[1] (AS_NOBODY) in a user namespace (root and 65534 mapped to themselves)
# where no user namespace may be made below: a host that forbids them to users who are not root.
NO_USERNS = """
import ctypes, os, sys
r, w = os.pipe()
r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:   # CLONE_NEWUSER
        os._exit(90)
    os.write(w, b"1")
    os.read(r2, 1)                                   # the parent has written the maps
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    exec(sys.argv.pop(1))
    sys.exit(0)
os.close(w)
if os.read(r, 1) != b"1":
    sys.exit(91)
for name in ("uid_map", "gid_map"):
    with open(f"/proc/{pid}/{name}", "w") as f:
        f.write("0 0 1\\n65534 65534 1\\n")
os.write(w2, b"1")
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
