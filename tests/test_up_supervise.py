"""`asyncrl up` replaces dead children (issue 14, item 8): a SIGKILLed worker and scorer are
restarted with backoff, the run finishes its steps, and summary.json counts the restarts per
component. Also: [up] is validated before anything starts.

Helpers (`start_up`, `run_pids`, `child_pid`, `wait_for`, `trainer_version`) are reused by
tests/test_up_signals.py and meant for the chaos harness's `up_supervisor` scenario.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_up import CONFIG

ROOT = Path(__file__).resolve().parents[1]

SUPERVISE = CONFIG.replace("[up]\n", "[up]\ngrace_s = 3.0\nmax_restarts = 3\nrestart_backoff_s = 0.5\n") \
    .replace("eval_every = 3", "eval_every = 0")


def start_up(tmp: Path, config: str, steps: int, *, nats: str | None = None, minutes: float = 4,
             new_session: bool = True) -> tuple[subprocess.Popen, Path]:
    """`asyncrl up --quiet` in the background; stdout/stderr in tmp/up.out. Returns (proc, run_dir)."""
    cfg = tmp / "up.toml"
    cfg.write_text(config)
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "asyncrl.cli", "up", "--config", str(cfg), "--steps", str(steps),
           "--minutes", str(minutes), "--run-dir", str(run_dir), "--quiet"]
    if nats:
        cmd += ["--nats", nats]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with open(tmp / "up.out", "wb") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                             start_new_session=new_session)
    return p, run_dir


def run_pids(run_dir: Path) -> dict[int, str]:
    """Every live process whose command line names the run dir (up, its children, its nats-server)."""
    out = {}
    needle = str(run_dir).encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state != "Z":
            out[int(d.name)] = cmd.replace(b"\0", b" ").decode(errors="replace")
    return out


def child_pid(run_dir: Path, name: str) -> int | None:
    """The pid of child `name` (worker-0, scorer-0, trainer ...) of the run, by its config path."""
    want = f"{run_dir}/config/{name}.toml"
    for pid, cmd in run_pids(run_dir).items():
        if cmd.split()[-1:] == [want]:
            return pid
    return None


def trainer_version(run_dir: Path) -> int:
    p = run_dir / "metrics" / "trainer.jsonl"
    if not p.exists():
        return 0
    rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    return max([r.get("version", 0) for r in rows if "samples" in r] or [0])


async def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None, out: Path | None = None):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"asyncrl up exited ({proc.returncode}) while waiting for {what}:\n"
                                 + (out.read_text()[-4000:] if out else ""))
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n" + (out.read_text()[-4000:] if out else ""))


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def kill_run(run_dir: Path) -> None:
    """Test cleanup: SIGKILL whatever of the run is still alive."""
    for pid in run_pids(run_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def test_up_restarts_killed_worker_and_scorer(fresh_server, tmp_path):
    proc, run_dir = start_up(tmp_path, SUPERVISE, steps=6, nats=fresh_server.url)
    out = tmp_path / "up.out"
    try:
        await wait_for(lambda: trainer_version(run_dir) >= 1, 150, "version 1", proc, out)
        victims = {name: child_pid(run_dir, name) for name in ("worker-0", "scorer-0")}
        assert all(victims.values()), (victims, run_pids(run_dir))
        for pid in victims.values():
            os.kill(pid, signal.SIGKILL)
        # replaced: a new process runs under each name
        await wait_for(lambda: all(child_pid(run_dir, n) not in (None, victims[n]) for n in victims), 30,
                       "replacements", proc, out)
        code = await asyncio.to_thread(proc.wait, 240)
        assert code == 0, out.read_text()[-4000:]
        s = summary_of(run_dir)
        assert s["versions"] >= 6 and s["stopped"].startswith("reached"), s
        assert s["restarts"]["rollout_worker"] == 1 and s["restarts"]["scorer"] == 1, s["restarts"]
        assert s["restarts"]["trainer"] == 0
        assert s["children"]["worker-0"]["exit_codes"][0] == -signal.SIGKILL
        assert "restarted" in (run_dir / "logs" / "up.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_run(run_dir)


@pytest.mark.parametrize("bad, msg", [("max_restarts = -1", "max_restarts"), ("max_restarts = 1.5", "integer"),
                                      ("restart_backoff_s = 0", "restart_backoff_s"), ("grace_s = \"x\"", "number"),
                                      ("restarts = 3", "unknown key")])
def test_up_config_is_checked_before_start(tmp_path, bad, msg):
    cfg = tmp_path / "up.toml"
    cfg.write_text(f"[up]\n{bad}\n")
    p = subprocess.run([sys.executable, "-m", "asyncrl.cli", "up", "--config", str(cfg), "--run-dir",
                        str(tmp_path / "run"), "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2 and msg in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "run").exists()          # nothing started


@pytest.mark.chaos
async def test_up_survives_repeated_kills_and_a_trainer_kill(fresh_server, tmp_path):
    """The long form (bench.chaos `up_supervisor`): with a standby trainer, SIGKILL a random worker
    or scorer 5 times and one trainer; every child is replaced, the run finishes, nothing is
    trained twice, and the summary counts every restart."""
    import collections
    import random
    rng = random.Random(14)
    config = SUPERVISE.replace("[up]\n", "[up]\ntrainers = 2\nmax_restarts = 8\n").replace("max_restarts = 3\n", "") \
        .replace("[trainer]\n", "[trainer]\nlease_ttl_s = 4.0\n")
    proc, run_dir = start_up(tmp_path, config, steps=14, nats=fresh_server.url, minutes=8)
    out = tmp_path / "up.out"
    kills = collections.Counter()
    try:
        await wait_for(lambda: trainer_version(run_dir) >= 1, 150, "version 1", proc, out)
        names = ["worker-0", "worker-1", "scorer-0"]
        for i in range(6):
            name = "trainer" if i == 3 else rng.choice(names)
            pid = await wait_for(lambda: child_pid(run_dir, name), 60, f"{name} running", proc, out)
            os.kill(pid, signal.SIGKILL)
            kills[{"trainer": "trainer", "scorer-0": "scorer"}.get(name, "rollout_worker")] += 1
            v = trainer_version(run_dir)
            await wait_for(lambda: trainer_version(run_dir) > v, 150, "progress after a kill", proc, out)
        code = await asyncio.to_thread(proc.wait, 400)
        assert code == 0, out.read_text()[-4000:]
        s = summary_of(run_dir)
        assert s["versions"] >= 14 and s["stopped"].startswith("reached"), s
        assert {k: v for k, v in s["restarts"].items() if v} == dict(kills), (s["restarts"], kills)
        rows = [json.loads(x) for x in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines() if x]
        ids = [rid for r in rows if "samples" in r for rid in r["rollout_ids"]]
        assert ids and len(ids) == len(set(ids))
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_run(run_dir)
