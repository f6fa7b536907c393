"""`asyncrl up` replaces dead children: a SIGKILLed worker and scorer are
restarted with backoff, the run goes on, and summary.json counts the restarts per
component. Also: [up] is validated before anything starts.

The helpers that drive `up` from outside live in bench/up_driver.py (the chaos harness's
`up_supervisor` scenario uses them too).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest

from bench.up_driver import (
    ROOT,
    child_pid,
    kill_run,
    run_pids,
    start_up,
    summary_of,
    trainer_version,
    wait_for,
)
from tests.helpers.up import SUPERVISE


async def test_up_restarts_killed_worker_and_scorer(fresh_server, tmp_path):
    """No step limit: a run that reached its steps while the test still looked for the
    replacements exited 0 under it (in CI); it is stopped by SIGTERM once both are back."""
    proc, run_dir = start_up(tmp_path, SUPERVISE, steps=100_000, nats=fresh_server.url, minutes=8)
    out = tmp_path / "up.out"
    try:
        await wait_for(lambda: trainer_version(run_dir) >= 1, 150, "version 1", proc, out)
        victims = {name: child_pid(run_dir, name) for name in ("worker-0", "scorer-0")}
        assert all(victims.values()), (victims, run_pids(run_dir))
        for pid in victims.values():
            os.kill(pid, signal.SIGKILL)
        # replaced: a new process runs under each name, and the run goes on
        await wait_for(
            lambda: all(child_pid(run_dir, n) not in (None, victims[n]) for n in victims),
            60,
            "replacements",
            proc,
            out,
        )
        v = trainer_version(run_dir)
        await wait_for(
            lambda: trainer_version(run_dir) >= v + 2, 150, "progress after the restarts", proc, out
        )
        proc.send_signal(signal.SIGTERM)  # an orderly stop: drains, summary, exit 0
        code = await asyncio.to_thread(proc.wait, 120)
        assert code == 0, out.read_text()[-4000:]
        s = summary_of(run_dir)
        assert s["versions"] >= v + 2 and s["stopped"].startswith("interrupted by SIGTERM"), s
        assert s["restarts"]["rollout_worker"] == 1 and s["restarts"]["scorer"] == 1, s["restarts"]
        assert s["restarts"]["trainer"] == 0
        assert s["children"]["worker-0"]["exit_codes"][0] == -signal.SIGKILL
        assert "restarted" in (run_dir / "logs" / "up.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_run(run_dir)


@pytest.mark.parametrize(
    "bad, msg",
    [
        ("max_restarts = -1", "max_restarts"),
        ("max_restarts = 1.5", "integer"),
        ("restart_backoff_s = 0", "restart_backoff_s"),
        ('grace_s = "x"', "number"),
        ("restarts = 3", "unknown key"),
    ],
)
def test_up_config_is_checked_before_start(tmp_path, bad, msg):
    cfg = tmp_path / "up.toml"
    cfg.write_text(f"[up]\n{bad}\n")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "up",
            "--config",
            str(cfg),
            "--run-dir",
            str(tmp_path / "run"),
            "--quiet",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 2 and msg in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # nothing started


def test_child_configs_round_trip_and_leave_none_out(tmp_path):
    """What `up` writes for each child (config/<name>.toml) reads back the same, None left out
    (TOML has no null: the child's default applies)."""
    import tomllib

    from asyncrl.supervisor import write_toml

    conf = {
        "seed": 3,
        "lr": 1e-3,
        "name": 'a "quoted"\nname',
        "on": True,
        "skip": None,
        "bus": {"servers": ["nats://h:4222"], "token": None, "tls": {"ca": "/c.pem"}},
        "tasks": {"envs": ["arith", "python-funcs"], "weights": [0.5, 0.5]},
    }
    write_toml(tmp_path / "c.toml", conf)
    back = tomllib.loads((tmp_path / "c.toml").read_text())
    del conf["skip"], conf["bus"]["token"]
    assert back == conf


@pytest.mark.chaos
async def test_up_survives_repeated_kills_and_a_trainer_kill(fresh_server, tmp_path):
    """The long form (bench.chaos `up_supervisor`): with a standby trainer, SIGKILL a random worker
    or scorer 5 times and one trainer; every child is replaced, the run finishes, nothing is
    trained twice, and the summary counts every restart. The run is stopped by SIGTERM once every
    killed child is back (a step count could end it mid-kill on a loaded machine)."""
    import collections
    import random

    rng = random.Random(14)
    config = (
        SUPERVISE.replace("[up]\n", "[up]\ntrainers = 2\nmax_restarts = 8\n")
        .replace("max_restarts = 3\n", "")
        .replace("[trainer.tasks]\n", "[trainer.lease]\nttl_s = 4.0\n\n[trainer.tasks]\n")
    )
    proc, run_dir = start_up(tmp_path, config, steps=100_000, nats=fresh_server.url, minutes=12)
    out = tmp_path / "up.out"
    kills = collections.Counter()
    try:
        await wait_for(lambda: trainer_version(run_dir) >= 1, 150, "version 1", proc, out)
        names = ["worker-0", "worker-1", "scorer-0"]
        killed = set()  # (a pid file can still name the child just killed: wait for its replacement)
        for i in range(6):
            name = "trainer" if i == 3 else rng.choice(names)
            pid = await wait_for(
                # B023: the lambda is called in this iteration only
                lambda: p if (p := child_pid(run_dir, name)) not in killed else None,  # noqa: B023
                60,
                f"{name} running",
                proc,
                out,
            )
            killed.add(pid)
            os.kill(pid, signal.SIGKILL)
            kills[{"trainer": "trainer", "scorer-0": "scorer"}.get(name, "rollout_worker")] += 1
            v = trainer_version(run_dir)
            await wait_for(
                lambda: trainer_version(run_dir) > v,  # noqa: B023  (called in this iteration only)
                150,
                "progress after a kill",
                proc,
                out,
            )
        for name in ["trainer", *names]:  # every killed child replaced (not in its restart backoff)
            await wait_for(
                # B023: the lambda is called in this iteration only
                lambda: (p := child_pid(run_dir, name)) is not None and p not in killed,  # noqa: B023
                60,
                f"{name} replaced",
                proc,
                out,
            )
        v = trainer_version(run_dir)
        await wait_for(
            lambda: trainer_version(run_dir) >= v + 2, 150, "progress after the last kill", proc, out
        )
        proc.send_signal(signal.SIGTERM)  # an orderly stop: drains, summary, exit 0
        code = await asyncio.to_thread(proc.wait, 120)
        assert code == 0, out.read_text()[-4000:]
        s = summary_of(run_dir)
        assert s["versions"] >= v + 2 and s["stopped"].startswith("interrupted by SIGTERM"), s
        assert {k: v for k, v in s["restarts"].items() if v} == dict(kills), (s["restarts"], kills)
        rows = [json.loads(x) for x in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines() if x]
        ids = [rid for r in rows if "samples" in r for rid in r["rollout_ids"]]
        assert ids and len(ids) == len(set(ids))
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_run(run_dir)
