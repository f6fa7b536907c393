"""Sandbox and python-tests verifier: every way generated code can misbehave returns in bounded
time with a reason; known-good solutions pass, known-bad ones do not."""

from __future__ import annotations

import os
import random
import socket
import time

import pytest

from envs import SpecError, get_env
from envs.python_tests import PROBLEMS, PythonTestsEnv
from envs.sandbox import SandboxLimits, isolation, run_python

FAST = SandboxLimits(wall_s=3.0, cpu_s=1, memory_mb=256, output_bytes=64 << 10)


def run(code: str, limits: SandboxLimits = FAST):
    t0 = time.monotonic()
    res = run_python({"main.py": code}, "main.py", limits)
    assert (
        time.monotonic() - t0 < limits.wall_s + 30
    )  # bounded, whatever the code does (generous: shared CPUs)
    return res


def test_ok_and_exit_codes():
    r = run("print('hi')")
    assert r.ok and r.stdout == b"hi\n"
    assert run("raise SystemExit(3)").reason == "exit code 3"
    assert "exit code 1" in run("1/0").reason


def test_wall_timeout():
    r = run("import time\ntime.sleep(60)", SandboxLimits(wall_s=1.0, cpu_s=5))
    assert r.reason == "wall timeout after 1.0s"


def test_cpu_limit():
    r = run("while True: pass", SandboxLimits(wall_s=60.0, cpu_s=1))  # the cpu limit fires first
    assert "cpu time limit" in r.reason


def test_memory_limit():
    r = run("x = bytearray(2 << 30)")
    assert "MemoryError" in r.stderr.decode() and r.reason == "exit code 1"


def test_huge_stdout_is_capped():
    r = run("import sys\nwhile True: sys.stdout.write('x' * 65536)")
    assert r.reason.startswith("output limit") and len(r.stdout) <= FAST.output_bytes


def test_crash_by_signal():
    assert "SIGABRT" in run("import os; os.abort()").reason
    assert "SIGSEGV" in run("import ctypes; ctypes.string_at(0)").reason


def test_network_attempt_fails():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    try:
        r = run(
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "print('connected')"
        )
        assert b"connected" not in r.stdout and r.reason == "exit code 1"
        with pytest.raises(socket.timeout):
            srv.accept()  # nothing ever reached the listener
    finally:
        srv.close()


def _procs_with(marker: bytes) -> int:
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                n += marker in f.read()
        except OSError:
            pass
    return n


def test_fork_bomb_is_contained_and_cleaned_up():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_python({"bomb_marker.py": code}, "bomb_marker.py", SandboxLimits(wall_s=2.0, cpu_s=1, nproc=16))
    assert r.reason.startswith(("wall timeout", "cpu time limit", "killed"))
    time.sleep(0.2)
    assert _procs_with(b"bomb_marker.py") == 0, "fork bomb survived the sandbox"
    python, fresh_uid, namespaces = isolation()
    print(
        "isolation layers:", r.isolation, "python", python, "fresh uid", fresh_uid, "namespaces", namespaces
    )


def test_daemonised_child_dies_with_the_sandbox():
    code = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
        "else:\n    print('parent done')\n"
    )
    r = run_python({"daemon_marker.py": code}, "daemon_marker.py", FAST)
    assert r.ok
    time.sleep(0.2)
    if isolation()[2]:  # pid namespace available: nothing may outlive it
        assert _procs_with(b"daemon_marker.py") == 0


# -- python-tests environment -----------------------------------------------------------------


@pytest.fixture(scope="module")
def env():
    return get_env("python-tests")


def test_reference_solutions_pass(env):
    r = random.Random(0)
    for name in PROBLEMS:
        t = env.make_task(name, r)
        assert len(t.spec["tests"]) == 8 and name.split("_")[0] in t.prompt
        v = env.verify(env.demonstration(t.spec), t.spec)
        assert v.success == 1.0 and v.reason == "passed 8/8", (name, v)


def test_known_bad_and_malicious_completions(env):
    t = env.make_task("sum_even", random.Random(3))
    fence = "Here you go:\n```python\n" + PROBLEMS["sum_even"][2] + "```\nDone."
    assert env.verify(fence, t.spec).success == 1.0
    wrong = env.verify("def sum_even(xs):\n    return sum(xs)\n", t.spec)
    assert wrong.success < 1.0 and "first failure: sum_even(" in wrong.reason
    cases = {
        "": "empty completion",
        "def sum_even(xs) return 0": "SyntaxError",
        "def other(xs): return 0": "no attribute 'sum_even'",
        "import os; os._exit(0)": "exited without a test report",
        'print(\'{"passed": 8, "total": 8}\')\nimport os; os._exit(0)': "exited without a test report",
        "import time\ntime.sleep(60)": "wall timeout",
        # a forged report with the real nonce still needs the right values: the sandbox never sees them
        "import sys, json\nf = sys._getframe()\nwhile 'nonce' not in f.f_globals:\n    f = f.f_back\n"
        "nonce = f.f_globals['nonce']\n"
        "print('\\n' + nonce + ' ' + json.dumps({'results': [['ok', 0]] * 8}), flush=True)\n"
        "import os; os._exit(0)": "passed ",
    }
    fast = PythonTestsEnv(limits=SandboxLimits(wall_s=1.5, cpu_s=1, memory_mb=256))
    for code, why in cases.items():
        v = fast.verify(code, t.spec)
        assert v.success < 1.0 and why in v.reason, (code, v)
    v = fast.verify("def sum_even(xs):\n    while True: pass\n", t.spec)
    assert v.success == 0.0 and ("cpu time limit" in v.reason or "wall timeout" in v.reason)


def test_bad_spec_raises(env):
    for spec in [{}, {"entry": "f"}, {"entry": "1x", "tests": [[[1], 1]]}, {"entry": "f", "tests": [[1, 1]]}]:
        with pytest.raises(SpecError):
            env.verify("def f(x): return x", spec)


def test_an_environment_the_sandbox_masks_is_not_its_runtime(tmp_path, monkeypatch):
    """A venv under /tmp (or a .pth adding a site dir there) runs for the sandbox uid outside the
    sandbox, but the sandbox's private /tmp hides it: its runtime is then a system python with a copy
    of pytest (every scoring run needs it)."""
    from envs import workspace

    monkeypatch.setattr(workspace.sys, "prefix", "/tmp/some-venv")
    root = tmp_path / "root"
    root.mkdir()
    python, site = workspace.sandbox_runtime.__wrapped__(str(root))
    assert python != workspace.sys.executable
    if site:  # that python has no pytest of its own: the copy holds pytest and what it imports
        assert os.path.isfile(os.path.join(site, "pytest", "__init__.py"))
        assert os.path.isfile(os.path.join(site, "pluggy", "__init__.py"))
    # the normal user's case: the sandbox uid can run this interpreter (outside the sandbox), so only
    # the mask can rule it out
    monkeypatch.setattr(workspace, "_runs", lambda *a, **k: True)
    assert workspace.sandbox_runtime.__wrapped__(str(root))[0] != workspace.sys.executable
    assert workspace._under_masks("/tmp") and workspace._under_masks("/dev/shm/x")
    assert not workspace._under_masks("/tmpfoo") and not workspace._under_masks("/usr/lib")
