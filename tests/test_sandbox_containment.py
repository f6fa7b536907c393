"""Containment of both sandboxes (envs/sandbox.py: run_bash for episodes, run_python for the
single-turn verifier), checked from the host: what the code does to /tmp, /var/tmp, /dev/shm and
the mounts stays inside, it sees no other process, its scratch RAM is capped, a SIGKILLed worker
leaves nothing behind after its restart, and a process without full isolation refuses to start
(envs/isolation.py)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from envs import isolation
from envs.sandbox import BashLimits, SandboxLimits, fresh_uid, run_bash, run_python
from tests.helpers.unprivileged import AS_NOBODY, NO_USERNS

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not isolation.isolation()[2],
    reason="full containment needs root with user namespaces",
)


@pytest.fixture
def ws():
    """(root, workspace, uid) laid out like a LocalWorkspace: root traversable, workspace the uid's
    (not under pytest's tmp_path: its parents are closed to other uids)."""
    root = tempfile.mkdtemp(prefix="asyncrl-test-root-")
    os.chmod(root, 0o711)
    w = os.path.join(root, "ws")
    os.mkdir(w, 0o700)
    uid = fresh_uid()
    os.chown(w, uid, uid)
    yield root, w, uid
    shutil.rmtree(root, ignore_errors=True)


def bash(ws, command: str, **limits) -> str:
    root, w, uid = ws
    r = run_bash(command, root, w, BashLimits(wall_s=30.0, **limits), uid)
    assert not r.reason.startswith("sandbox error"), r.reason
    return r.stdout.decode("utf-8", "replace")


def python(code: str, **limits):
    r = run_python({"main.py": textwrap.dedent(code)}, "main.py", SandboxLimits(wall_s=30.0, **limits))
    assert not r.reason.startswith("sandbox error"), (r.reason, r.stderr)
    return r


def left_on_host(marker: str) -> list[str]:
    return [d for d in SCRATCH if os.path.lexists(os.path.join(d, marker))]


# -- run_bash --------------------------------------------------------------------------------------


def test_bash_unmount_mount_and_scratch_writes_leave_nothing_on_the_host(ws):
    m = f"asyncrl-escape-{secrets.token_hex(6)}"
    out = bash(
        ws,
        f"for d in {' '.join(SCRATCH)}; do echo x > $d/{m}; done; "
        f"ls /tmp/{m} /var/tmp/{m} /dev/shm/{m}; "
        f"umount /tmp; echo rc_umount=$?; umount -l /tmp; echo rc_lazy=$?; "
        f"echo y > /tmp/{m}-after; "
        f"mount -t tmpfs -o size=8g big /mnt; echo rc_mount=$?; "
        f"unshare -rm mount -t tmpfs -o size=8g big /mnt; echo rc_nested=$?; "
        f"grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status",
    )
    assert f"/tmp/{m}" in out and f"/dev/shm/{m}" in out  # the writes worked, inside
    for rc in ("rc_umount", "rc_lazy", "rc_mount", "rc_nested"):
        assert f"{rc}=0" not in out, out
    assert out.count("0000000000000000") == 3, out  # no capability left at all
    assert left_on_host(m) == [] and left_on_host(m + "-after") == []


def test_bash_sees_only_its_own_processes(ws):
    tag = f"asyncrl-host-secret-{secrets.token_hex(6)}"
    host = subprocess.Popen(["sh", "-c", "sleep 60; :", tag])  # argv a sandbox must not read
    try:
        out = bash(
            ws, "sleep 30 & ps -e -o pid=,comm=; echo '='=SEP; cat /proc/[0-9]*/cmdline | tr '\\0' ' '"
        )
    finally:
        host.kill()
        host.wait()
    procs, cmdlines = out.split("==SEP\n", 1)
    pids = [int(line.split()[0]) for line in procs.strip().splitlines()]
    assert len(pids) <= 5 and max(pids) < 100, procs  # bash (pid 1), its command, sleep, ps
    assert tag not in cmdlines and str(host.pid) not in procs.split()


def test_bash_scratch_fill_beyond_its_cap_is_refused(ws):
    out = bash(
        ws,
        "for i in 1 2 3 4 5 6; do head -c 4M /dev/zero > /dev/shm/f$i || echo refused_$i; done; "
        "df -k /dev/shm | tail -1",
        tmp_mb=8,
        file_mb=16,
    )
    assert "No space left on device" in out and "refused_" in out, out
    assert "refused_1" not in out  # the first 4 MB fit: a cap, not a ban


# -- run_python ------------------------------------------------------------------------------------


def test_python_unmount_mount_and_scratch_writes_leave_nothing_on_the_host():
    m = f"asyncrl-escape-{secrets.token_hex(6)}"
    r = python(
        f"""
        import ctypes, os, subprocess
        for d in {SCRATCH!r}:
            open(os.path.join(d, {m!r}), "w").write("x")
        libc = ctypes.CDLL(None, use_errno=True)
        print("umount", libc.umount2(b"/tmp", 2), ctypes.get_errno())                 # MNT_DETACH
        print("mount", libc.mount(b"big", b"/tmp", b"tmpfs", 0, b"size=8g"), ctypes.get_errno())
        open("/tmp/{m}-after", "w").write("y")
        print("caps", [l.split()[1] for l in open("/proc/self/status") if l.startswith(("CapEff", "CapBnd"))])
        print("sh", subprocess.run(["sh", "-c", "umount -l /tmp || mount -t tmpfs t /mnt || unshare -r true"],
                                   capture_output=True).returncode)
    """,
        nproc=8,
    )
    out = r.stdout.decode()
    assert "umount -1 1" in out and "mount -1 1" in out, out  # EPERM, both
    assert "caps ['0000000000000000', '0000000000000000']" in out and "sh 0" not in out, out
    assert left_on_host(m) == [] and left_on_host(m + "-after") == []


def test_python_sees_only_its_own_processes():
    tag = f"asyncrl-host-secret-{secrets.token_hex(6)}"
    host = subprocess.Popen(["sh", "-c", "sleep 60; :", tag])
    try:
        r = python("""
            import os
            pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
            argv = b" ".join(open(f"/proc/{p}/cmdline", "rb").read() for p in pids)
            print(pids, argv.count(b"asyncrl-host-secret"))
        """)
    finally:
        host.kill()
        host.wait()
    assert r.ok and r.stdout.decode().strip() == "[1, 2] 0", r.stdout  # its shell and itself


def test_python_shm_fill_beyond_its_cap_is_refused():
    r = python(
        """
        import ctypes, errno
        n = 0
        try:
            for i in range(16):                          # 512 KiB files (RLIMIT_FSIZE is 1 MB here)
                with open(f"/dev/shm/f{i}", "wb") as f:
                    f.write(b"\\1" * (512 << 10))
                n += 1
        except OSError as e:
            print("shm", n, errno.errorcode[e.errno])
        libc = ctypes.CDLL(None, use_errno=True)        # SysV shm: not mapped, so not in RLIMIT_AS
        print("shmget", libc.shmget(0, 64 << 20, 0o1600), errno.errorcode.get(ctypes.get_errno()))
    """,
        tmp_mb=2,
    )
    out = r.stdout.decode().split()
    assert out[0] == "shm" and 2 <= int(out[1]) <= 4 and out[2] == "ENOSPC", out  # a cap, not a ban
    assert out[3:] == ["shmget", "-1", "ENOSPC"], out


# -- a SIGKILLed worker ----------------------------------------------------------------------------

EPISODE = """
import sys, time
from envs.episode import Episode, EpisodeLimits, EpisodeTask
from envs.sandbox import BashLimits
task = EpisodeTask("t-kill", "test", "train", "x", files={"a.py": "x = 1\\n"}, hidden_tests={}, runner="mini",
                   test_paths=["."], fail_to_pass=[], pass_to_pass=[])
ep = Episode(task, EpisodeLimits(command=BashLimits(wall_s=600.0)))
ep.reset()
print("uid", ep.workspace.uid, "root", ep.workspace.root, flush=True)
ep.step("```bash\\nsleep 1000 & sleep 1000\\n```")
"""


def _processes_of(uid: int) -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/status") as f:
                real = next(line for line in f if line.startswith("Uid:")).split()[1]
            with open(f"/proc/{p}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, StopIteration, IndexError):
            continue
        if int(real) == uid and not zombie:
            out.append(int(p))
    return out


def test_sigkilled_workers_workspaces_and_processes_are_gone_after_its_restart(tmp_path, fresh_server):
    tmp = tempfile.mkdtemp(prefix="asyncrl-test-tmpdir-")  # the workspaces' root goes under it
    os.chmod(tmp, 0o711)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": tmp, "OMP_NUM_THREADS": "1"}
    # the worker's episode thread, mid-command (the same Episode and LocalBackend the worker runs)
    victim = subprocess.Popen(
        [sys.executable, "-c", EPISODE], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    first = victim.stdout.readline().split()
    uid, ep_root = int(first[1]), first[3]
    deadline = time.monotonic() + 30
    while len(_processes_of(uid)) < 3 and time.monotonic() < deadline:  # the command is running
        time.sleep(0.1)
    assert len(_processes_of(uid)) >= 3 and os.path.isdir(ep_root)
    time.sleep(2.5)  # older than reap()'s grace
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert os.path.isdir(ep_root)  # nobody cleaned up: it was killed
    conf = tmp_path / "w.toml"
    conf.write_text(
        f'worker_id = "restarted"\n[engine]\nslots = 1\n[bus]\nservers = ["{fresh_server.url}"]\n'
    )
    worker = subprocess.Popen(
        [sys.executable, "-m", "rollout_worker", "--config", str(conf)],
        cwd=ROOT,
        env={**env, "ASYNCRL_LOG_JSON": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in worker.stdout:  # up to its start-up check's log line
            lines.append(line)
            if "sandbox isolation" in line:
                break
        assert any("sandbox isolation" in x for x in lines), "".join(lines)
        assert not os.path.exists(ep_root), "".join(lines)
        assert _processes_of(uid) == []
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def test_reap_spares_a_live_processes_workspace(tmp_path):
    from envs.episode import EpisodeLimits, EpisodeTask
    from envs.workspace import LocalBackend

    task = EpisodeTask(
        "t",
        "test",
        "train",
        "x",
        files={"a.py": "x = 1\n"},
        hidden_tests={},
        runner="mini",
        test_paths=["."],
        fail_to_pass=[],
        pass_to_pass=[],
    )
    w = LocalBackend(str(tmp_path / "eps")).create(task, EpisodeLimits())
    stale = tmp_path / "eps" / "ep-stale"
    stale.mkdir()
    os.utime(w.root, (time.time() - 60,) * 2)
    os.utime(stale, (time.time() - 60,) * 2)
    try:
        assert isolation.reap(str(tmp_path / "eps")) == {"workspaces": 1, "processes": 0}
        assert os.path.isdir(w.repo) and not stale.exists()
    finally:
        w.close()


# -- start-up check --------------------------------------------------------------------------------


def test_full_isolation_here_and_exported():
    layers = isolation.startup(False)
    assert isolation.missing(layers) == [] and set(layers) == set(isolation.LAYERS)
    from prometheus_client import generate_latest

    text = generate_latest().decode()
    assert 'asyncrl_sandbox_layer{layer="no-caps"} 1.0' in text and 'layer="no-userns"} 1.0' in text


def public_file(tmp_path, text: str) -> str:
    """A file uid 65534 can read (pytest's tmp_path is closed to it); removed with tmp_path's test."""
    fd, path = tempfile.mkstemp(prefix="asyncrl-test-", suffix=".toml")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o644)
    (tmp_path / "public").write_text(path)
    return path


@pytest.fixture(autouse=True)
def _remove_public_file(tmp_path):
    yield
    p = tmp_path / "public"
    if p.exists():
        os.unlink(p.read_text())


def test_scorer_as_non_root_starts_with_the_rootless_sandbox(tmp_path):
    """Not root, user namespaces allowed: the rootless sandbox, every layer it promises in place."""
    conf = public_file(tmp_path, '[bus]\nservers = ["nats://127.0.0.1:1"]\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": "/", "ASYNCRL_LOG_JSON": "1"}
    p = subprocess.Popen(
        [sys.executable, "-c", AS_NOBODY, str(conf)],
        cwd="/",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = []
        for line in p.stdout:  # past the check: it goes on to connect (to nothing)
            seen.append(line)
            if '"sandbox isolation"' in line:
                break
        line = seen[-1]
        assert '"mode": "rootless"' in line and '"missing": []' in line, "".join(seen)
        for layer in isolation.ROOTLESS_LAYERS:
            assert f'"{layer}"' in line, (layer, line)
    finally:
        p.kill()
        p.wait()


def test_scorer_as_non_root_without_user_namespaces_refuses_naming_the_layers_and_the_fix(tmp_path):
    conf = public_file(tmp_path, '[bus]\nservers = ["nats://127.0.0.1:1"]\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": "/"}
    r = subprocess.run(
        [sys.executable, "-c", NO_USERNS, AS_NOBODY, str(conf)],
        cwd="/",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert err[-1].startswith(
        "scorer refuses to start: rootless sandbox incomplete (uid 65534): missing layer(s) netns, pidns"
    ), r.stderr
    assert "needs user namespaces" in err[-1] and "max_user_namespaces" in err[-1], err[-1]
    assert "fresh-uid" not in err[-1]  # (root only: not asked of a user who is not root)
    assert "allow_weak_sandbox = true" in err[-1] and "Traceback" not in r.stderr


def test_scorer_as_non_root_with_allow_weak_sandbox_starts_and_says_so(tmp_path):
    conf = public_file(
        tmp_path, '[sandbox]\nallow_weak_sandbox = true\n[bus]\nservers = ["nats://127.0.0.1:1"]\n'
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": "/", "ASYNCRL_LOG_JSON": "1"}
    p = subprocess.Popen(
        [sys.executable, "-c", NO_USERNS, AS_NOBODY, str(conf)],
        cwd="/",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the scorer is the wrapper's child: both go
    )
    try:
        seen = []
        for line in p.stdout:  # past the check: it goes on to connect (to nothing)
            seen.append(line)
            if "WEAK sandbox isolation" in line:
                break
        assert any("WEAK sandbox isolation" in x and "netns" in x for x in seen), "".join(seen)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_bash_disk_fill_is_stopped_during_the_command(ws):
    root, w, uid = ws
    t0 = time.monotonic()
    r = run_bash(
        "for i in $(seq 40); do head -c 4M /dev/zero > f$i; done; sleep 20",
        root,
        w,
        BashLimits(wall_s=60.0, disk_mb=32, file_mb=8),
        uid,
    )
    used = sum(os.lstat(os.path.join(w, n)).st_blocks * 512 for n in os.listdir(w))
    assert r.reason == "disk limit (32 MB) exceeded: the workspace grew past it", r.reason
    assert time.monotonic() - t0 < 15 and used < 96 << 20, used  # stopped mid-way, not after 160 MB


def test_an_out_of_memory_kill_takes_the_sandbox_first(ws):
    assert bash(ws, "cat /proc/self/oom_score_adj").strip() == "1000"
    assert python("print(open('/proc/self/oom_score_adj').read().strip())").stdout.strip() == b"1000"


SCORING = """
from envs.sandbox import SandboxLimits, run_python
print("go", flush=True)
run_python({"main.py": "import time; time.sleep(1000)"}, "main.py", SandboxLimits(wall_s=600.0, cpu_s=600))
"""


def test_sigkilled_scorers_sandbox_run_is_gone_after_its_restart(tmp_path):
    tmp = tempfile.mkdtemp(prefix="asyncrl-test-tmpdir-")
    os.chmod(tmp, 0o711)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": tmp, "OMP_NUM_THREADS": "1"}
    try:
        victim = subprocess.Popen(
            [sys.executable, "-c", SCORING], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
        )
        assert victim.stdout.readline().strip() == "go"
        deadline = time.monotonic() + 30
        runs: list[str] = []
        while not runs and time.monotonic() < deadline:
            runs = [os.path.join(tmp, n) for n in os.listdir(tmp) if n.startswith("asyncrl-sbx-")]
            time.sleep(0.1)
        assert runs
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        time.sleep(0.5)
        assert os.path.isdir(runs[0])
        os.utime(runs[0], (time.time() - 3600,) * 2)  # clearly stale, as after a real crash
        conf = public_file(tmp_path, '[bus]\nservers = ["nats://127.0.0.1:1"]\n')
        scorer = subprocess.Popen(
            [sys.executable, "-m", "scorer", "--config", conf],
            cwd=ROOT,
            env={**env, "ASYNCRL_LOG_JSON": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            lines = []
            for line in scorer.stdout:
                lines.append(line)
                if "sandbox isolation" in line:
                    break
            assert not os.path.exists(runs[0]), "".join(lines)
            assert not [p for p in os.listdir("/proc") if p.isdigit() and _cwd_in(p, runs[0])]
        finally:
            scorer.kill()
            scorer.wait()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cwd_in(pid: str, path: str) -> bool:
    try:
        return (os.readlink(f"/proc/{pid}/cwd") + "/").startswith(path + "/")
    except OSError:
        return False


def test_bash_cannot_read_the_task_set_it_is_scored_by(ws):
    """A built task set holds the hidden tests: the sandbox's uid must not read it, even where the
    folder above it is open (fails if write_task_set leaves the set world-readable)."""
    from envs.task_set import write_task_set

    root, _, _ = ws
    out = os.path.join(root, "tasks")
    write_task_set(out, [], {"note": "secret-expected-values"})
    out_text = bash(ws, f"cat {out}/manifest.json 2>&1; ls {out} 2>&1; true")
    assert "secret-expected-values" not in out_text
    assert "Permission denied" in out_text
