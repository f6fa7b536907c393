"""Drive `asyncrl up` from outside, as an operator would: start it, find its processes by the run
dir in their command lines, read its progress, kill what is left. Shared by the tests of `up`
and the chaos harness's `up_supervisor` scenario."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a small run (arith-small, 2 workers, 1 scorer) that learns a little in a minute on 2 cores
SMALL_RUN = """
[up]
workers = 2
scorers = 1

[trainer.tasks]
envs = ["arith-small"]
backlog = 6
eval_every = 3
eval_prompts = 16
sampling = {temperature = 1.0, max_tokens = 40}

[trainer.optim]
lr = 1e-3

[trainer.batch]
groups = 2
group_size = 4
max_lag = 8

[worker.engine]
slots = 8

[worker.admission]
max_lag = 8

[worker.run]
threads = 1
heartbeat_s = 1.0

[scorer.run]
concurrency = 8
heartbeat_s = 1.0
"""


def start_up(
    tmp: Path,
    config: str,
    steps: int,
    *,
    nats: str | None = None,
    minutes: float = 4,
    new_session: bool = True,
) -> tuple[subprocess.Popen, Path]:
    """`asyncrl up --quiet` in the background; stdout/stderr in tmp/up.out. Returns (proc, run_dir)."""
    cfg = tmp / "up.toml"
    cfg.write_text(config)
    run_dir = tmp / "run"
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "up",
        "--config",
        str(cfg),
        "--steps",
        str(steps),
        "--minutes",
        str(minutes),
        "--run-dir",
        str(run_dir),
        "--quiet",
    ]
    if nats:
        cmd += ["--nats", nats]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with open(tmp / "up.out", "wb") as out:
        p = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=new_session
        )
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


async def wait_for(
    cond, timeout: float, what: str, proc: subprocess.Popen | None = None, out: Path | None = None
):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"asyncrl up exited ({proc.returncode}) while waiting for {what}:\n"
                + (out.read_text()[-4000:] if out else "")
            )
        await asyncio.sleep(0.2)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}\n" + (out.read_text()[-4000:] if out else "")
    )


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def stop_run(proc, run_dir: Path, wait_s: float = 60.0) -> None:
    """Test cleanup: SIGTERM `up` (it drains its children), then SIGKILL whatever is left."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(wait_s)
        except Exception:
            pass
    kill_run(run_dir)


def kill_run(run_dir: Path) -> None:
    """Test cleanup: SIGKILL whatever of the run is still alive."""
    for pid in run_pids(run_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
