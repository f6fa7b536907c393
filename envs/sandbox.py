"""Run untrusted Python in a subprocess that cannot hang, flood or take down its caller.

Layers (each one covers a way generated code goes wrong; docs/environments.md#containment):
  * own session / process group, killed as a whole at the wall timeout;
  * `unshare -rmnpif --kill-child --mount-proc` when available (envs/isolation.py checks it at
    start-up): a user namespace whose root is the run's fresh uid; an empty network namespace;
    a pid namespace whose init is a tiny shell (every process the code forks dies with it) and a
    fresh /proc of that namespace (no other process of the host is visible); a private IPC
    namespace (SysV shm capped and gone with the run); a private mount namespace with ONE
    size-capped tmpfs behind /tmp, /var/tmp, /dev/shm and /run/lock (scratch RAM is bounded
    and nothing is left on the host);
  * after that setup the code has no capability at all (bounding set, effective, permitted,
    inheritable and ambient sets cleared, no_new_privs) and cannot make a nested user
    namespace (max_user_namespaces = 0 inside), so it can neither unmount the masks nor mount
    a tmpfs of its own; the launcher dies with its caller (PR_SET_PDEATHSIG);
  * when the scorer runs as root (where RLIMIT_NPROC is not enforced) the code runs under a
    fresh random uid, so RLIMIT_NPROC caps a fork bomb at `nproc` processes; as any other user
    (rootless) the code keeps that user's uid, so every mount but its working directory and the
    private tmpfs is remounted read-only for it, and RLIMIT_NPROC = `nproc` counts only its user
    namespace's tasks (Linux >= 5.14; older: 1 for python, no fork or thread at all);
  * oom_score_adj 1000: if memory runs out anyway (host, container or unit limit), the kernel
    kills the sandbox first, never the worker or the trainer next to it;
  * rlimits set in-process before any untrusted byte runs: CPU seconds, address space,
    file size (caps stdout/stderr, which go to files), open files, no core dumps;
  * an audit hook that refuses every socket operation (the network guard where namespaces
    are not available; defence in depth where they are);
  * a temp working directory, an empty environment, `python -I -S` (no site, no user paths).
Every outcome comes back as a SandboxResult with a reason; nothing here raises on bad code.
"""

from __future__ import annotations

import fcntl
import functools
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

# the directories the sandbox puts its one private tmpfs over (PRELUDE below mounts them): nothing of
# the host under them is visible inside
MASKED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")

# Runs first inside the sandbox: containment (when in the namespaces: it is their root until it
# drops every capability here), limits and guards, then the script. Parameters come as argv.
PRELUDE = r"""
import resource, sys, os
RW_MOUNTS = (b"/tmp", b"/var/tmp", b"/dev/shm", b"/run/lock", b"/proc")
cpu, mem, fsize, nproc, nofile, net, contain, tmp_mb, ro, mark, script = sys.argv[1:12]
if contain == "1":
    import ctypes
    _libc = ctypes.CDLL(None, use_errno=True)
    def _ok(rc, what):
        if rc != 0:
            os.write(2, f"sandbox setup failed: {what}: {os.strerror(ctypes.get_errno())}\n".encode())
            os._exit(197)
    _cwd = os.getcwd().encode()          # under /tmp: bound back at its own path once masked
    _ok(_libc.mount(b"sandbox-tmp", b"/tmp", b"tmpfs", 6, f"size={tmp_mb}m,mode=1777".encode()), "mask /tmp")
    for _d in (b"/var/tmp", b"/dev/shm", b"/run/lock"):
        if os.path.isdir(_d):
            _ok(_libc.mount(b"/tmp", _d, None, 4096, None), f"mask {_d.decode()}")
    os.makedirs(_cwd, exist_ok=True)
    _ok(_libc.mount(b"/proc/self/cwd", _cwd, None, 4096, None), "bind the run's directory")
    os.chdir(_cwd)
    for _k, _v in (("user/max_user_namespaces", "0"), ("kernel/shmall", str(int(tmp_mb) << 8))):
        with open("/proc/sys/" + _k, "w") as _f:
            _f.write(_v)
    if ro == "1":  # rootless: the code has the caller's uid, so every mount but its run dir goes read-only
        import codecs
        _fl = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
        _top = {}
        for _l in open("/proc/self/mountinfo"):
            _p = _l.split()
            _top[codecs.escape_decode(_p[4].encode())[0]] = _p[5].split(",")
        for _m, _o in _top.items():
            if _m in RW_MOUNTS or _m.startswith(b"/proc/") or _m == _cwd or _m.startswith(_cwd + b"/"):
                continue
            _f = 4129 | sum(_fl.get(_x, 0) for _x in _o)                   # MS_REMOUNT|MS_BIND|MS_RDONLY
            # a mount it cannot reach (under a mask, or where our uid may not enter) it cannot write
            if _libc.mount(None, _m, None, _f, None) != 0 and os.path.exists(_m):
                _ok(-1, f"read-only {_m.decode(errors='replace')}")
        del codecs, _fl, _top, _l, _p, _m, _o
    for _c in range(int(open("/proc/sys/kernel/cap_last_cap").read()) + 1):
        _ok(_libc.prctl(24, _c, 0, 0, 0), "drop bounding set")          # PR_CAPBSET_DROP
    _ok(_libc.prctl(47, 4, 0, 0, 0), "clear ambient caps")               # PR_CAP_AMBIENT_CLEAR_ALL
    _ok(_libc.prctl(38, 1, 0, 0, 0), "no_new_privs")                     # PR_SET_NO_NEW_PRIVS
    _ok(_libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()), "capset")
    del ctypes, _libc, _ok, _d, _k, _v, _f, _c, _cwd
with open("/proc/self/oom_score_adj", "w") as f:   # an out-of-memory kill takes the sandbox first
    f.write("1000")
for lim, v in ((resource.RLIMIT_CPU, (int(cpu), int(cpu) + 1)), (resource.RLIMIT_AS, (int(mem),) * 2),
               (resource.RLIMIT_FSIZE, (int(fsize),) * 2), (resource.RLIMIT_NOFILE, (int(nofile),) * 2),
               (resource.RLIMIT_CORE, (0, 0))):
    resource.setrlimit(lim, v)
if int(nproc) > 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (int(nproc),) * 2)
if net == "0":
    def _no_network(event, args):
        if event.startswith("socket.") and event != "socket.gethostname":
            raise PermissionError("network access is disabled in the sandbox")
    sys.addaudithook(_no_network)
os.write(int(mark), b"ok")
os.close(int(mark))
del RW_MOUNTS, resource, cpu, mem, fsize, nproc, nofile, net, contain, tmp_mb, ro, mark
sys.argv = [script] + sys.argv[12:]
sys.path.insert(0, ".")
with open(script) as f:
    code = compile(f.read(), script, "exec")
del f
exec(code, {"__name__": "__main__", "__file__": script, "__builtins__": __builtins__})
"""

# the namespaces of both sandboxes; --mount-proc: a /proc of the new pid namespace only
UNSHARE_FLAGS = ["-rmnpif", "--kill-child", "--mount-proc"]
# the sandbox's launcher gets SIGKILL when the thread that started it dies (a worker SIGKILLed
# mid-command leaves no process behind: unshare's --kill-child takes the namespace down with it)
PDEATHSIG = ["--pdeathsig", "KILL", "--"]
# what the command runs under after setup: no capability in any set, none to gain by execve
DROP_CAPS = ["--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--no-new-privs", "--"]
# what a run in the namespaces has (SandboxResult.isolation; "netns" apart: it can be turned off)
NS_LAYERS = ["pidns", "proc", "mountns", "tmp-masks", "ipcns", "no-caps", "no-userns", "pdeathsig"]

SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")


@dataclass
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    nproc: int = 16  # processes + threads the code may have (fork-bomb cap)
    output_bytes: int = 1 << 20  # stdout + stderr, each
    open_files: int = 64
    tmp_mb: int = 16  # the one private tmpfs behind /tmp, /var/tmp, /dev/shm (RAM)
    network: bool = False  # True only for trusted experiments
    netns: bool = True  # an empty network namespace as well as the audit hook (costs a namespace per run)
    python: str | None = None  # interpreter; default: a system python the sandbox uid can run


@dataclass
class SandboxResult:
    reason: (
        str  # "ok" | "wall timeout after 2.0s" | "cpu time limit" | "output limit ..." | "exit code 1" | ...
    )
    returncode: int
    stdout: bytes = b""
    stderr: bytes = b""
    wall_s: float = 0.0
    isolation: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


def claim(path: str) -> int:
    """Hold a lock on a directory this process made for as long as the returned fd is open (the
    kernel drops it when the process dies, however it dies): envs.isolation.reap() removes only
    directories nobody holds."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _tool(name: str) -> str | None:
    return shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")


@functools.cache
def isolation() -> tuple[str, bool, bool]:
    """(python, use a fresh uid, use namespaces) — probed once per process. Namespaces are used
    only when the whole stack works: setpriv, unshare with user/mount/net/pid/ipc namespaces and
    a fresh /proc (which a container may forbid); envs/isolation.py checks what they give."""
    root = os.geteuid() == 0
    python = (
        next((p for p in SYSTEM_PYTHONS if os.access(p, os.X_OK)), sys.executable) if root else sys.executable
    )
    unshare, setpriv = _tool("unshare"), _tool("setpriv")
    probe_uid = _fresh_uid() if root else None

    def works(cmd: list[str], uid: int | None) -> bool:
        try:
            kw = dict(user=uid, group=uid, extra_groups=[]) if uid is not None else {}
            r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=10, cwd="/", **kw)
            return r.returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False

    use_uid = root and works([python, "-I", "-S", "-c", "pass"], probe_uid)
    if root and not use_uid:
        python = sys.executable
    if not root:  # ours, unless it lives where we may not run it (started as root, then dropped)
        python = next(
            (p for p in (sys.executable, *SYSTEM_PYTHONS) if works([p, "-I", "-S", "-c", "pass"], None)),
            sys.executable,
        )
    ns_cmd = (
        [
            setpriv,
            *PDEATHSIG,
            unshare,
            *UNSHARE_FLAGS,
            "--",
            setpriv,
            *DROP_CAPS,
            python,
            "-I",
            "-S",
            "-c",
            "pass",
        ]
        if unshare and setpriv
        else []
    )
    use_ns = bool(ns_cmd) and works(ns_cmd, probe_uid if use_uid else None)
    return python, use_uid, use_ns


def _launcher(netns: bool) -> list[str]:
    """The namespaces' launcher: setpriv (death signal) exec'ing unshare; one process spawn."""
    flags = UNSHARE_FLAGS if netns else [UNSHARE_FLAGS[0].replace("n", "")] + UNSHARE_FLAGS[1:]
    return [_tool("setpriv") or "setpriv", *PDEATHSIG, _tool("unshare") or "unshare", *flags, "--"]


def _nproc_limit(limits: SandboxLimits, uid: int | None, use_ns: bool = False) -> int:
    """RLIMIT_NPROC for the code. It counts every task of the uid: under a fresh uid that is only
    the sandbox, so `nproc`; in a user namespace of its own (rootless) the kernel counts only the
    namespace's tasks (Linux >= 5.14), so `nproc` again; under a shared non-root uid otherwise, 1
    (the uid already has more: no fork or thread at all); root ignores it (0 = not set; root uses
    fresh uids when it can)."""
    if uid is not None or (use_ns and os.geteuid() != 0 and nproc_per_userns()):
        return limits.nproc
    return 1 if os.geteuid() != 0 else 0


def rootless_layers(ro: bool) -> list[str]:
    """What a rootless run has on top of the namespaces: a read-only host, and (where the kernel
    counts per user namespace) a fork-bomb cap of its own."""
    if not ro:
        return []
    return ["ro-host", "nproc-ns"] if os.geteuid() != 0 and nproc_per_userns() else ["ro-host"]


@functools.cache
def nproc_per_userns() -> bool:
    """Whether RLIMIT_NPROC counts a user namespace's own tasks only (ucounts: Linux 5.14)."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)


def _fresh_uid() -> int:
    # an unused uid per run: RLIMIT_NPROC counts per uid, so concurrent sandboxes never share a budget
    return FRESH_UID_BASE + random.SystemRandom().randrange(1 << 30)


FRESH_UID_BASE = 200_000


def _signal_reason(sig: int, limits: SandboxLimits) -> str:
    if sig == signal.SIGXCPU:
        return f"cpu time limit ({limits.cpu_s}s) exceeded"
    if sig == signal.SIGKILL:
        return f"killed (cpu hard limit {limits.cpu_s + 1}s or out of memory)"
    if sig == signal.SIGXFSZ:
        return f"output limit ({limits.output_bytes} bytes) exceeded"
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = str(sig)
    return f"crashed with signal {name}"


def run_python(
    files: dict[str, str],
    script: str,
    limits: SandboxLimits | None = None,
    stdin: bytes = b"",
    args: list[str] | None = None,
) -> SandboxResult:
    """Write `files` into a fresh temp dir and run `python script` there under the limits."""
    limits = limits or SandboxLimits()
    python, use_uid, use_ns = isolation()
    if limits.python:
        python = limits.python
    uid = _fresh_uid() if use_uid else None
    ro = use_ns and uid is None  # rootless: the code has our uid, the host is read-only to it
    layers = ["pgroup", "rlimits", "audit-net" if not limits.network else "net-allowed"]
    tmp = tempfile.mkdtemp(prefix="asyncrl-sbx-")
    held = claim(tmp)  # a restart's isolation.reap() spares it while we live
    t0 = time.perf_counter()
    try:
        for name, text in files.items():
            path = os.path.join(tmp, name)
            if os.path.dirname(name):
                os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        out_path, err_path, in_path = (os.path.join(tmp, n) for n in (".stdout", ".stderr", ".stdin"))
        mark_r, mark_w = os.pipe()  # the prelude writes "ok" here once contained and limited
        cmd = [
            python,
            "-I",
            "-S",
            "-c",
            PRELUDE,
            str(limits.cpu_s),
            str(limits.memory_mb << 20),
            str(limits.output_bytes),
            str(_nproc_limit(limits, uid, use_ns)),
            str(limits.open_files),
            "1" if limits.network else "0",
            "1" if use_ns else "0",
            str(limits.tmp_mb),
            "1" if ro else "0",
            str(mark_w),
            script,
            *(args or []),
        ]
        if use_ns:
            # pid 1 of the namespace is a shell, so the python below it keeps normal signal
            # semantics; when the shell exits every process left in the namespace is killed
            netns = limits.netns and not limits.network
            cmd = [*_launcher(netns), "/bin/sh", "-c", '"$@"; exit $?', "sh", *cmd]
            layers += NS_LAYERS
            layers += ["netns"] if netns else []
            layers += rootless_layers(ro)
        kw = {}
        if uid is not None:
            os.chown(tmp, uid, uid)
            for dirpath, dirnames, filenames in os.walk(tmp):
                for n in dirnames + filenames:
                    os.chown(os.path.join(dirpath, n), uid, uid)
            kw = dict(user=uid, group=uid, extra_groups=[])
            layers.append("fresh-uid")
        with open(in_path, "wb") as f:  # a file, not a pipe: feeding it can never block us
            f.write(stdin)
        try:
            with open(in_path, "rb") as inp, open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    cmd,
                    cwd=tmp,
                    stdin=inp,
                    stdout=out,
                    stderr=err,
                    pass_fds=(mark_w,),
                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp},
                    start_new_session=True,
                    close_fds=True,
                    **kw,
                )
                os.close(mark_w)
                mark_w = -1
                try:
                    timed_out = not _wait_exit(proc, limits.wall_s)
                finally:
                    _kill_group(proc.pid)  # stragglers in the group, on every path
                    proc.wait()
            setup_ok = _read_mark(mark_r)
        finally:
            os.close(mark_r)
            if mark_w >= 0:
                os.close(mark_w)
        rc = proc.returncode
        stdout, stderr = (
            _read_capped(out_path, limits.output_bytes),
            _read_capped(err_path, limits.output_bytes),
        )
        over = max(os.path.getsize(out_path), os.path.getsize(err_path)) >= limits.output_bytes
        if not setup_ok and not timed_out:
            # only the prelude, before any untrusted byte, can end here: never the code's own exit
            why = (stderr.decode("utf-8", "replace").strip().splitlines() or ["setup failed"])[-1]
            reason = f"sandbox error: {why}"
        elif timed_out:
            reason = f"wall timeout after {limits.wall_s}s"
        elif over:
            reason = f"output limit ({limits.output_bytes} bytes) exceeded"
        elif rc < 0:
            reason = _signal_reason(-rc, limits)
        elif use_ns and rc > 128:  # the shell reports a signal death as 128+n
            reason = _signal_reason(rc - 128, limits)
        elif rc != 0:
            reason = f"exit code {rc}"
        else:
            reason = "ok"
        return SandboxResult(reason, rc, stdout, stderr, time.perf_counter() - t0, layers)
    except OSError as e:  # could not even start: report, never raise
        return SandboxResult(f"sandbox error: {e}", -1, wall_s=time.perf_counter() - t0, isolation=layers)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(held)


def _read_mark(fd: int) -> bool:
    """Whether the sandbox's setup wrote its "ok" (every writer is gone: the read cannot block)."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 2) == b"ok"
    except BlockingIOError:
        return False


def _wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
    """True if the process exited within `timeout`. A pidfd wakes us the instant it exits
    (Popen.wait(timeout) polls with sleeps of up to 50 ms, which would dominate a short run)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(path: str, cap: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(cap)


# -- bash in a persistent workspace (multi-turn episodes) ----------------------------------------

# Runs as pid 1 of the namespaces (or as the group leader without them), as root of the user
# namespace. Mount masks first: ONE private size-capped tmpfs behind every world-writable
# directory (all the scratch RAM a command has), so the only place a command can leave anything
# behind is its workspace; then the episode root is bound back at its own path, with the mounts
# under it (it may live under a masked /tmp; mount(8) must not canonicalise /proc/self/cwd, or it
# would resolve to the masked path); no nested user namespace, SysV shm capped; then the first
# victim of any out-of-memory kill (oom_score_adj 1000: the sandbox dies, not the trainer); rlimits;
# then the command (under setpriv: without any capability), as a child, so pid 1 keeps normal signal
# handling and everything left in the namespace dies when it exits.
BASH_SETUP = r"""
root=$1 ws=$2 ns=$3 tmp_mb=$4 cpu=$5 mem_kb=$6 fsize_kb=$7 nofile=$8 nproc=$9 mark=${10} ro=${11}
shift 11
fail() { echo "sandbox setup failed: $*" >&2; exit 197; }
cd "$root" || fail "no episode root $root"
if [ "$ns" = 1 ]; then
  mount -t tmpfs -o "size=${tmp_mb}m,mode=1777,nosuid,nodev" sandbox-tmp /tmp || fail "mask /tmp"
  for d in /var/tmp /dev/shm /run/lock; do
    if [ -d "$d" ]; then mount --bind /tmp "$d" || fail "mask $d"; fi
  done
  mkdir -p "$root" && mount --no-canonicalize --rbind /proc/self/cwd "$root" || fail "bind $root"
  echo 0 >/proc/sys/user/max_user_namespaces || fail "nested user namespaces"
  echo $((tmp_mb << 8)) >/proc/sys/kernel/shmall || fail "shm cap"
  if [ "$ro" = 1 ]; then  # rootless: the command has our uid: every mount but its workspace read-only
    mount --bind "$ws" "$ws" || fail "bind $ws"
    while read -r _ _ _ _ mp opts _; do
      mp=$(printf '%b' "$mp")
      case "$mp" in /tmp|/var/tmp|/dev/shm|/run/lock|/proc|/proc/*|"$ws"|"$ws"/*) continue ;; esac
      o=${opts#r[ow]}
      # a mount it cannot reach (under a mask, or a directory our uid may not enter) it cannot write
      mount -o "remount,bind,ro$o" "$mp" 2>/dev/null || [ ! -e "$mp" ] || fail "read-only $mp"
    done </proc/self/mountinfo
  fi
fi
cd "$ws" || fail "no workspace $ws"
echo 1000 >/proc/self/oom_score_adj || fail "oom_score_adj"
ulimit -c 0 && ulimit -t "$cpu" && ulimit -v "$mem_kb" && ulimit -f "$fsize_kb" && ulimit -n "$nofile" || fail "ulimit"
if [ "$nproc" -gt 0 ]; then ulimit -u "$nproc" || fail "ulimit -u"; fi
echo ok >&"$mark"
exec {mark}>&-
"$@"
exit $?
"""  # noqa: E501  (the lines of a script run in the sandbox, kept as written)

SETUP_FAILED = 197


@dataclass
class BashLimits:
    wall_s: float = 10.0  # per command
    cpu_s: int = 10
    memory_mb: int = 1024  # address space per process
    file_mb: int = 16  # largest file a command may write; also caps its captured output
    nproc: int = 64  # processes + threads of the episode's uid (fork-bomb cap)
    open_files: int = 256
    tmp_mb: int = 64  # the one private tmpfs behind /tmp, /var/tmp, /dev/shm (RAM)
    disk_mb: int = 512  # the workspace may not grow past this DURING a command (0: off)
    keep_bytes: int = 32 << 10  # of the output kept for the caller: this much of its head and of its tail


def fresh_uid() -> int | None:
    """A uid never used before for a workspace (None where we are not root: commands then run as us)."""
    return _fresh_uid() if isolation()[1] else None


def run_bash(
    command: str,
    root: str,
    workspace: str,
    limits: BashLimits | None = None,
    uid: int | None = None,
    env: dict[str, str] | None = None,
) -> SandboxResult:
    """Run `bash -c command` in `workspace` (a directory under `root`, owned by `uid`) and return
    its merged stdout+stderr (head and tail when long). Never raises on anything the command does.

    Isolation, when root with user namespaces: fresh uid (owns nothing but the workspace), empty
    network namespace, pid namespace with its own /proc (nothing outlives the command, nothing
    else is visible), one private size-capped tmpfs behind /tmp, /var/tmp, /dev/shm, private
    IPC, no capability and no nested user namespace for the command, rlimits, process group
    killed at the wall limit. Without namespaces all of that but the uid, the rlimits and the
    group is missing: envs/isolation.py refuses to start a process there unless allowed."""
    limits = limits or BashLimits()
    _, _, use_ns = isolation()
    layers = ["pgroup", "rlimits"]
    t0 = time.perf_counter()
    out_dir = tempfile.mkdtemp(prefix="asyncrl-cmd-")  # root-only: the command never sees it
    held = claim(out_dir)
    try:
        out_path, mark_path = os.path.join(out_dir, "out"), os.path.join(out_dir, "mark")
        # RLIMIT_NPROC counts every task of the uid: only meaningful under a fresh uid (a shared
        # uid already has more; root ignores it)
        ro = use_ns and uid is None  # rootless: the command has our uid, the host is read-only to it
        nproc = limits.nproc if uid is not None or (ro and nproc_per_userns()) else 0
        kw = {}
        if uid is not None:
            kw = dict(user=uid, group=uid, extra_groups=[])
            layers.append("fresh-uid")
        if use_ns:
            layers += ["netns", *NS_LAYERS]
            layers += rootless_layers(ro)
        base_env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "HOME": "/tmp",
            "TMPDIR": "/tmp",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "TERM": "dumb",
        }
        base_env.update(env or {})
        with open(os.devnull, "rb") as inp, open(out_path, "wb") as out, open(mark_path, "wb") as mark:
            # the setup writes "ok" on its own fd once the isolation is in place, so a setup
            # failure is never mistaken for the command's own exit status
            tail = ["/bin/bash", "-c", command]
            if use_ns:
                tail = [_tool("setpriv") or "setpriv", *DROP_CAPS, *tail]
            cmd = [
                "/bin/bash",
                "-c",
                BASH_SETUP,
                "setup",
                root,
                workspace,
                "1" if use_ns else "0",
                str(limits.tmp_mb),
                str(limits.cpu_s),
                str(limits.memory_mb << 10),
                str(limits.file_mb << 10),
                str(limits.open_files),
                str(nproc),
                str(mark.fileno()),
                "1" if ro else "0",
                *tail,
            ]
            if use_ns:
                cmd = [*_launcher(True), *cmd]
            proc = subprocess.Popen(
                cmd,
                cwd="/",
                stdin=inp,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(mark.fileno(),),
                env=base_env,
                start_new_session=True,
                **kw,
            )
            try:
                exited, over_disk = _wait_disk_capped(proc, limits.wall_s, workspace, limits.disk_mb << 20)
                timed_out = not exited and not over_disk
            finally:
                _kill_group(proc.pid)
                proc.wait()
        rc = proc.returncode
        size = os.path.getsize(out_path)
        output = head_tail(out_path, size, limits.keep_bytes)
        setup_ok = os.path.getsize(mark_path) > 0
        if not setup_ok and not timed_out:
            reason = (
                "sandbox error: "
                + (output.decode("utf-8", "replace").strip().splitlines() or ["setup failed"])[-1]
            )
        elif timed_out:
            reason = f"wall timeout after {limits.wall_s}s"
        elif over_disk:
            reason = f"disk limit ({limits.disk_mb} MB) exceeded: the workspace grew past it"
        elif size >= limits.file_mb << 20:
            reason = f"output limit ({limits.file_mb} MB) exceeded"
        elif rc < 0:
            reason = _bash_signal_reason(-rc, limits)
        elif rc > 128 and rc - 128 in (signal.SIGKILL, signal.SIGXCPU, signal.SIGXFSZ):
            reason = _bash_signal_reason(rc - 128, limits)
        elif rc != 0:
            reason = f"exit code {rc}"
        else:
            reason = "ok"
        return SandboxResult(reason, rc, output, b"", time.perf_counter() - t0, layers)
    except OSError as e:
        return SandboxResult(f"sandbox error: {e}", -1, wall_s=time.perf_counter() - t0, isolation=layers)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        os.close(held)


DISK_POLL_S = 0.02  # how often a command's disk use is checked (one statvfs)


def _wait_disk_capped(proc: subprocess.Popen, timeout: float, path: str, cap: int) -> tuple[bool, bool]:
    """(exited, over the disk cap): wait like _wait_exit, and end the command as soon as the tree
    at `path` holds more than `cap` bytes. Cheap: the filesystem's free space is read every
    DISK_POLL_S (one statvfs) and the tree is measured only once the filesystem as a whole has lost
    more than the tree's headroom since the last measure (the tree cannot pass the cap without
    that). The interval bounds the overshoot: a disk writing ~1 GB/s adds ~100 MB in 0.1 s, three
    times a 32 MB cap, and ~20 MB in 0.02 s."""
    if cap <= 0:
        return _wait_exit(proc, timeout), False
    deadline = time.monotonic() + timeout
    try:
        fd = os.pidfd_open(proc.pid)
        free0, size = _free_bytes(path), 0
    except (AttributeError, OSError):
        return _wait_exit(proc, timeout), False
    try:
        while (left := deadline - time.monotonic()) > 0:
            if select.select([fd], [], [], min(left, DISK_POLL_S))[0]:
                return True, False
            free = _free_bytes(path)
            if free0 - free > cap - size:
                size, free0 = _tree_bytes(path, cap), free
                if size > cap:
                    return False, True
        return False, False
    finally:
        os.close(fd)


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _tree_bytes(path: str, cap: int) -> int:
    """Bytes allocated under `path` (stops counting past `cap`); never follows a link."""
    total, stack = 0, [path]
    while stack and total <= cap:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
        except OSError:
            continue
    return total


def _bash_signal_reason(sig: int, limits: BashLimits) -> str:
    if sig == signal.SIGXCPU:
        return f"cpu time limit ({limits.cpu_s}s) exceeded"
    if sig == signal.SIGXFSZ:
        return f"file size limit ({limits.file_mb} MB) exceeded"
    if sig == signal.SIGKILL:
        return "killed (cpu hard limit or out of memory)"
    try:
        return f"crashed with signal {signal.Signals(sig).name}"
    except ValueError:
        return f"crashed with signal {sig}"


def head_tail(path: str, size: int, keep: int) -> bytes:
    """The whole file when short, else its first and last `keep` bytes around an omission note."""
    with open(path, "rb") as f:
        if size <= 2 * keep:
            return f.read()
        head = f.read(keep)
        f.seek(size - keep)
        return head + f"\n[... {size - 2 * keep} bytes omitted ...]\n".encode() + f.read()
