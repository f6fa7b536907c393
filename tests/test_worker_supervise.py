"""Worker background tasks are supervised: a feed that crashes is restarted
with backoff and the engine is back on the newest policy; a feed that keeps failing past
`max_restarts` stops the worker with exit code 1, so a supervisor (`asyncrl up`) replaces it.

The failure is injected by the worker's one test hook, `[worker.faults] weights_after` (the feed raises at
its Nth weight update), so no sleep or patch touches the production path.
Reusable by the chaos harness: `feed_crash_worker` and `wait_version`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from bus.weights.publisher import WeightPublisher
from rollout_worker.worker import Worker
from tests.helpers.weights import delta, same, until
from tests.helpers.worker import CFG, states_for, worker_cfg

ROOT = Path(__file__).resolve().parents[1]


async def feed_crash_worker(bus, url: str, fault_after: int, **cfg):
    """A worker (in this process) whose feed fails at weight update `fault_after`."""
    worker, stop = (
        Worker(
            worker_cfg(url, faults={"weights_after": fault_after}, run={"restart_backoff_s": 0.05}, **cfg),
            bus,
        ),
        asyncio.Event(),
    )
    run = asyncio.create_task(worker.run(stop, handle_signals=False))
    return worker, stop, run


async def test_crashed_feed_is_restarted_and_catches_up(bus, fresh_server):
    states = states_for(6, seed=11)
    pub = WeightPublisher(bus, epoch=1, trainer_id="t")
    await pub.publish_keyframe(states[0], 0, CFG)
    worker, stop, run = await feed_crash_worker(bus, fresh_server.url, fault_after=2)
    try:
        await until(lambda: worker.engine is not None and worker.engine.version == 0)
        for v in range(1, 6):  # the 2nd update crashes the feed mid-stream
            await pub.publish_delta(delta(states, v - 1, v))
        await until(lambda: worker.engine.version == 5, timeout=30)
        assert same(worker.engine.state, states[5])  # bit-exact on the newest policy
        assert worker.restarts == {"weights": 1}
        snap = worker.snapshot()
        assert snap["restarts"] == 1 and snap["weights"]["resyncs"] == 0
        # and it keeps following after the restart
        states.append(states_for(2, seed=12)[1])
        await pub.publish_delta(delta(states, 5, 6))
        await until(lambda: worker.engine.version == 6)
        assert same(worker.engine.state, states[6]) and not run.done()
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)


async def test_feed_failing_past_max_restarts_exits_nonzero(bus, fresh_server, tmp_path):
    states = states_for(2, seed=13)
    pub = WeightPublisher(bus, epoch=1, trainer_id="t")
    await pub.publish_keyframe(states[0], 0, CFG)
    conf = tmp_path / "w.toml"
    conf.write_text(
        f'worker_id = "wf"\n[engine]\nslots = 2\nmax_len = 128\n[run]\nheartbeat_s = 0.5\ngrace_s = 1.0\n'
        f'max_restarts = 0\n[faults]\nweights_after = 1\n[bus]\nservers = ["{fresh_server.url}"]\n'
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ASYNCRL_LOG_JSON": "1"}
    log = tmp_path / "wf.log"
    with open(log, "wb") as out:
        p = subprocess.Popen(
            [sys.executable, "-m", "rollout_worker", "--config", str(conf)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        for _ in range(3000):
            if b'"weights loaded"' in log.read_bytes():
                break
            assert p.poll() is None, log.read_text()[-3000:]
            await asyncio.sleep(0.02)
        await pub.publish_delta(delta(states, 0, 1))
        code = await asyncio.to_thread(p.wait, 60)
        assert code == 1, log.read_text()[-3000:]
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
        assert any(
            r.get("event") == "background task failed past max_restarts; stopping the worker"
            and r.get("task") == "weights"
            for r in lines
        ), log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
