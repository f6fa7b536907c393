"""The sandbox's isolation, checked at start-up, and the leftovers of a killed process cleaned.

`check()` runs one real command in each sandbox (`run_bash`, `run_python`) and asks, from inside,
for every layer the containment promises (docs/environments.md#containment):

    fresh-uid   the code runs as an unused uid (owns nothing but its workspace)
    netns       an empty network namespace (no interface but lo)
    pidns       its own pid namespace with its own /proc: no other process of the host visible
    mountns     its own mount namespace (what it mounts or unmounts is its own)
    tmp-masks   /tmp, /var/tmp, /dev/shm are a private tmpfs: a marker written there is not on the host
    tmp-cap     that tmpfs is size-capped (scratch RAM bounded; the code cannot mount another)
    ipcns       its own IPC namespace (SysV shm gone with the run)
    no-caps     no capability in the effective, permitted or bounding set
    no-mount    `umount /tmp` and `mount -t tmpfs` are refused
    no-userns   a nested user namespace (where it would be root again) is refused
    pdeathsig   the launcher dies with its caller (static: setpriv --pdeathsig is used)

Rootless (this process is not root): the code runs as our own uid, mapped to root of its user
namespace and stripped of every capability, so `fresh-uid` (which needs root) is replaced by

    ro-host     every mount but the code's own working directory and the private tmpfs is read-only
                to it (it can write nothing of ours, nor another episode's workspace)
    nproc-ns    RLIMIT_NPROC counts the namespace's own tasks (Linux >= 5.14): a fork bomb is capped

`expected()` is the set required of this process (LAYERS as root, ROOTLESS_LAYERS otherwise);
`require(allow_weak)` raises WeakSandbox naming each missing layer and what provides it unless
weak isolation is allowed. A process whose environments run no code (`needed(envs)`: arithmetic)
skips the check at start; `require_async()` runs it on the first code it meets.
`reap(root_dir)` removes the `ep-*` workspaces no live process holds (a workspace's creator holds
a lock on its directory: `claim()`), killing any process still working in them; `startup()` also
reaps the sandboxes' own run directories (`asyncrl-sbx-*`, `asyncrl-cmd-*`).
"""

from __future__ import annotations

import fcntl
import functools
import os
import re
import secrets
import shlex
import shutil
import signal
import tempfile
import time

from .base import runs_code
from .sandbox import (
    FRESH_UID_BASE,
    BashLimits,
    SandboxLimits,
    claim,  # noqa: F401  (re-exported: a workspace claims its directory)
    fresh_uid,
    isolation,
    nproc_per_userns,
    run_bash,
    run_python,
)

LAYERS = (
    "fresh-uid",
    "netns",
    "pidns",
    "mountns",
    "tmp-masks",
    "tmp-cap",
    "ipcns",
    "no-caps",
    "no-mount",
    "no-userns",
    "pdeathsig",
)
# as a user other than root: the code runs as that uid, the host read-only to it
ROOTLESS_LAYERS = tuple(k for k in LAYERS if k != "fresh-uid") + ("ro-host", "nproc-ns")
USERNS = (
    "needs user namespaces (unshare and setpriv from util-linux; sysctl user.max_user_namespaces > 0, "
    "and kernel.unprivileged_userns_clone = 1 on older Debian kernels, "
    "kernel.apparmor_restrict_unprivileged_userns = 0 on Ubuntu 24.04+; in a container: security_opt "
    "seccomp, apparmor and systempaths unconfined, as deploy/docker-compose.yml)"
)
# what provides each layer, named in the refusal
FIX = {
    "fresh-uid": "needs root with a system python any uid may run (/usr/bin/python3)",
    "pdeathsig": "needs setpriv (util-linux)",
    "nproc-ns": "needs Linux >= 5.14 and user namespaces, or root (then a fresh uid caps it)",
    **{k: USERNS for k in LAYERS + ROOTLESS_LAYERS if k not in ("fresh-uid", "pdeathsig", "nproc-ns")},
}
WEAK = (
    "or set allow_weak_sandbox = true (the scorer's [scorer.sandbox], the rollout worker's "
    "[worker.episodes]; never in production)"
)
HOW = (
    "run it as root where user namespaces are allowed (container: user 0 with security_opt "
    "seccomp, apparmor and systempaths unconfined, as deploy/docker-compose.yml; systemd: "
    "deploy/systemd/asyncrl-*@.service), " + WEAK
)

# Runs in run_bash; $1: our mount namespace, $2: a marker name, $3: the episode root (not the
# workspace). Mount attempts only in a mount namespace known to be its own (in ours, as root, an
# `umount /tmp` would be real).
BASH_PROBE = r"""
for n in net pid mnt ipc; do echo "ns_$n=$(readlink /proc/self/ns/$n)"; done
echo "uid=$(id -u) map=$(head -n1 /proc/self/uid_map | tr -s ' ' ' ')"
echo "caps=$(grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status | tr -s '\t ' ' ' | cut -d' ' -f2 | tr '\n' ,)"
echo "pids=$(ls /proc | grep -c '^[0-9]')"
echo "ifaces=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\n' ,)"
echo "shm_kb=$(df -k /dev/shm | tail -n1 | tr -s ' ' | cut -d' ' -f2)"
echo "nproc=$(ulimit -u)"
rw=$(awk '{m[$5] = $6} END {for (p in m) if (m[p] !~ /^ro(,|$)/) printf "%s,", p}' /proc/self/mountinfo) &&
  echo "rw=$rw"
echo x 2>/dev/null >"$3/$2" && echo wrote=root
for d in /tmp /var/tmp /dev/shm; do echo x > "$d/$2"; done
if [ "$1" != unknown ] && [ "$(readlink /proc/self/ns/mnt)" != "$1" ]; then
  umount -l /tmp 2>/dev/null && echo mounted=umount
  mkdir -p m && mount -t tmpfs probe m 2>/dev/null && echo mounted=tmpfs
  unshare -r true 2>/dev/null && echo nested=userns
fi
exit 0
"""

# Runs in run_python; argv[1]: a marker name
PYTHON_PROBE = r"""
import os, sys
print("ns_" + " ns_".join(f"{n}={os.readlink('/proc/self/ns/' + n)}" for n in ("net", "pid", "mnt", "ipc")))
st = dict(l.split(":", 1) for l in open("/proc/self/status") if l.startswith("Cap"))
print("caps=" + ",".join(st[k].strip() for k in ("CapEff", "CapPrm", "CapBnd")))
print("pids=%d" % sum(p.isdigit() for p in os.listdir("/proc")))
import resource
print("nproc=%d" % resource.getrlimit(resource.RLIMIT_NPROC)[0])
top = {}
for l in open("/proc/self/mountinfo"):
    top[l.split()[4]] = l.split()[5]
print("rw=" + ",".join(m for m, o in top.items() if o.split(",")[0] != "ro"), "cwd=" + os.getcwd())
for d in ("/tmp", "/var/tmp", "/dev/shm"):
    open(os.path.join(d, sys.argv[1]), "w").write("x")
"""


class WeakSandbox(RuntimeError):
    """The sandbox lacks layers of its isolation and weak isolation was not allowed."""


def _fields(text: str) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", text))


def _ours(kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return None


def _own(f: dict[str, str], kind: str) -> bool:
    """Whether the sandbox reported a `kind` namespace that is not ours (unknown: not)."""
    ours, theirs = _ours(kind), f.get(f"ns_{kind}", "")
    return ours is not None and theirs.startswith(f"{kind}:") and theirs != ours


def _caps_zero(caps: str) -> bool:
    vals = [v for v in caps.split(",") if v]
    return len(vals) == 3 and all(int(v, 16) == 0 for v in vals)


# writable in every sandbox: the private tmpfs, /proc (its own pid namespace's), and the code's cwd
RW_OK = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/proc")


def _ro_host(f: dict[str, str], cwd: str) -> bool:
    """Whether the only writable mounts the code sees are its own (rw= missing: not known, not)."""
    if "rw" not in f:
        return False
    rw = [m for m in f["rw"].split(",") if m]
    return all(m in RW_OK or m.startswith("/proc/") or m == cwd or m.startswith(cwd + "/") for m in rw)


def _nproc_capped(f: dict[str, str], want: int) -> bool:
    return nproc_per_userns() and f.get("nproc") == str(want)


def _left_on_host(marker: str) -> bool:
    found = False
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        p = os.path.join(d, marker)
        if os.path.lexists(p):
            found = True
            os.unlink(p)
    return found


def _probe_bash() -> dict[str, bool]:
    root = tempfile.mkdtemp(prefix="asyncrl-isolation-")
    marker = f"asyncrl-probe-{secrets.token_hex(6)}"
    try:
        os.chmod(root, 0o711)
        ws = os.path.join(root, "ws")
        os.mkdir(ws, 0o700)
        uid = fresh_uid()
        if uid is not None:
            os.chown(ws, uid, uid)
        cmd = (
            f"bash -c {shlex.quote(BASH_PROBE)} probe {shlex.quote(_ours('mnt') or 'unknown')} {marker} "
            f"{shlex.quote(root)}"
        )
        r = run_bash(cmd, root, ws, BashLimits(wall_s=20.0), uid)
        out = r.stdout.decode("utf-8", "replace")
        f = _fields(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # the uid the code has on the host: the user namespace's map ("0 X 1"), else its own uid
    m = re.search(r"map=\s*0\s+(\d+)\s+1\b", out)
    outer_uid = int(m.group(1)) if m else int(f.get("uid", "0") or 0)
    shm_kb = int(f.get("shm_kb", "0") or 0)
    return {
        "fresh-uid": r.ok and outer_uid >= FRESH_UID_BASE,
        "netns": r.ok and _own(f, "net") and f.get("ifaces", "").strip(",") in ("", "lo"),
        "pidns": r.ok and _own(f, "pid") and 0 < int(f.get("pids", "999") or 999) <= 10,
        "mountns": r.ok and _own(f, "mnt"),
        "tmp-masks": r.ok and not _left_on_host(marker),
        "tmp-cap": r.ok and 0 < shm_kb <= BashLimits().tmp_mb << 10,
        "ipcns": r.ok and _own(f, "ipc"),
        "no-caps": r.ok and _caps_zero(f.get("caps", "")),
        "no-mount": r.ok and _own(f, "mnt") and "mounted=" not in out,
        "no-userns": r.ok and _own(f, "mnt") and "nested=" not in out,
        "pdeathsig": r.ok and isolation()[2],
        "ro-host": r.ok and _ro_host(f, ws) and "wrote=" not in out,
        "nproc-ns": r.ok and outer_uid == os.geteuid() != 0 and _nproc_capped(f, BashLimits().nproc),
    }


def _probe_python() -> dict[str, bool]:
    marker = f"asyncrl-probe-{secrets.token_hex(6)}"
    r = run_python({"probe.py": PYTHON_PROBE}, "probe.py", SandboxLimits(wall_s=20.0), args=[marker])
    f = _fields(r.stdout.decode("utf-8", "replace"))
    left = _left_on_host(marker)
    return {
        "netns": r.ok and _own(f, "net"),
        "pidns": r.ok and _own(f, "pid") and 0 < int(f.get("pids", "999") or 999) <= 10,
        "mountns": r.ok and _own(f, "mnt"),
        "tmp-masks": r.ok and not left,
        "ipcns": r.ok and _own(f, "ipc"),
        "no-caps": r.ok and _caps_zero(f.get("caps", "")),
        "ro-host": r.ok and _ro_host(f, f.get("cwd", "")),
        "nproc-ns": r.ok and os.geteuid() != 0 and _nproc_capped(f, SandboxLimits().nproc),
    }


@functools.cache
def check() -> dict[str, bool]:
    """{layer: in place} for both sandboxes (a layer counts only when both have it), for the layers
    expected here: one real run of each, once per process."""
    layers = _probe_bash()
    for k, v in _probe_python().items():
        layers[k] = layers[k] and v
    return {k: layers[k] for k in expected()}


def expected() -> tuple[str, ...]:
    """The layers required here: every one as root, the rootless set as any other user."""
    return LAYERS if os.geteuid() == 0 else ROOTLESS_LAYERS


def missing(layers: dict[str, bool]) -> list[str]:
    return [k for k in expected() if not layers.get(k)]


def refusal(gone: list[str], uid: int | None = None) -> str:
    """Why a sandbox without the layers `gone` is refused, naming each with what provides it."""
    uid = os.geteuid() if uid is None else uid
    if uid == 0:
        return f"sandbox isolation incomplete (uid 0): missing layer(s) {', '.join(gone)}; {HOW}"
    by_fix: dict[str, list[str]] = {}
    for k in gone:
        by_fix.setdefault(FIX.get(k, USERNS), []).append(k)
    why = "; ".join(f"{', '.join(ks)}: {fix}" for fix, ks in by_fix.items())
    return (
        f"rootless sandbox incomplete (uid {uid}): missing layer(s) {', '.join(gone)}: {why}; "
        f"or run it as root; {WEAK}"
    )


def require(allow_weak: bool = False) -> dict[str, bool]:
    """The layers in place; raises WeakSandbox naming the missing ones unless `allow_weak`."""
    layers = check()
    gone = missing(layers)
    if gone and not allow_weak:
        raise WeakSandbox(refusal(gone))
    return layers


async def require_async(allow_weak: bool = False) -> dict[str, bool]:
    """require() for an event loop: the check runs off the loop the first time."""
    if check.cache_info().currsize:
        return require(allow_weak)
    import asyncio

    return await asyncio.to_thread(require, allow_weak)


def needed(envs) -> bool:
    """Whether a process serving `envs` needs the sandbox (none named: it may meet any)."""
    return not envs or any(runs_code(e) for e in envs)


# -- leftovers of a killed process ----------------------------------------------------------------


def _held(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return True  # not ours to judge (gone, or not a directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (closing drops the lock we may have taken)


def _kill_inside(dirs: list[str]) -> int:
    """SIGKILL every process whose working directory is under one of `dirs`."""
    prefixes = tuple(os.path.realpath(d) + os.sep for d in dirs)
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd") + os.sep
        except OSError:
            continue
        if int(pid) != os.getpid() and cwd.startswith(prefixes):
            try:
                os.kill(int(pid), signal.SIGKILL)
                n += 1
            except OSError:
                pass
    return n


# what the sandboxes leave in the temp dir while they run (run_python's run dir, run_bash's
# output), reaped only when clearly stale: a process of an older version holds no lock on them
SANDBOX_DIRS = ("asyncrl-sbx-", "asyncrl-cmd-")
SANDBOX_DIRS_GRACE_S = 900.0


def reap(root_dir: str, grace_s: float = 2.0, prefixes: tuple[str, ...] = ("ep-",)) -> dict[str, int]:
    """Remove the directories named `prefixes`* (default: the `ep-*` workspaces) under `root_dir`
    that no live process holds (older than `grace_s`: a directory is claimed right after it is
    made) and kill what still runs in them."""
    try:
        names = [n for n in os.listdir(root_dir) if n.startswith(prefixes)]
    except (FileNotFoundError, PermissionError):  # (another user's root: nothing of ours in it)
        return {"workspaces": 0, "processes": 0}
    now = time.time()
    stale = []
    for n in names:
        p = os.path.join(root_dir, n)
        try:
            young = now - os.lstat(p).st_mtime < grace_s
        except OSError:
            continue
        if not young and not os.path.islink(p) and not _held(p):
            stale.append(p)
    killed = _kill_inside(stale) if stale else 0
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return {"workspaces": len(stale), "processes": killed}


def startup(allow_weak: bool = False, workspaces: str | None = None, envs=()) -> dict[str, bool]:
    """A worker's or scorer's sandbox start-up: reap a killed predecessor's workspaces under
    `workspaces` (a LocalBackend root), check the isolation, log the layers it has and export
    them (asyncrl_sandbox_layer). Raises WeakSandbox unless complete or `allow_weak`. With `envs`
    none of which runs code, the check is left to the first code met (require_async): {}."""
    from kernel import get_logger, metrics  # (a library: logging and metrics only)

    log = get_logger("envs.isolation")
    for root, prefixes, grace in (
        (workspaces, ("ep-",), 2.0),
        (tempfile.gettempdir(), SANDBOX_DIRS, SANDBOX_DIRS_GRACE_S),
    ):
        reaped = reap(root, grace, prefixes) if root else {}
        if reaped.get("workspaces") or reaped.get("processes"):
            log.warning("reaped a killed process's leftovers", root=root, **reaped)
    if not needed(envs):
        log.info("sandbox check skipped: no environment here runs code", envs=list(envs))
        return {}
    layers = check()
    metrics.observe_sandbox(layers)
    gone = missing(layers)
    log.info(
        "sandbox isolation",
        mode="root" if os.geteuid() == 0 else "rootless",
        layers=[k for k in expected() if layers.get(k)],
        missing=gone,
    )
    if os.geteuid() != 0 and not gone:
        log.info("rootless sandbox: the code runs as our uid, the host read-only to it", uid=os.geteuid())
    if gone and allow_weak:
        log.warning("running with WEAK sandbox isolation (allow_weak_sandbox = true)", missing=gone)
    return require(allow_weak)


async def startup_async(allow_weak: bool = False, workspaces: str | None = None, envs=()) -> dict[str, bool]:
    """startup() for an event loop: off the loop the first time (the check runs commands), inline
    once the check is known (a process that starts a second service, e.g. in tests, keeps its
    timing)."""
    if check.cache_info().currsize or not needed(envs):
        return startup(allow_weak, workspaces, envs)
    import asyncio

    return await asyncio.to_thread(startup, allow_weak, workspaces, envs)
