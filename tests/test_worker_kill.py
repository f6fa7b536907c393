"""Worker processes killed mid-generation lose nothing: SIGKILL -> the task is redelivered to
another worker; SIGTERM -> drain (held tasks released at once). Exactly one rollout per
(task, sample) reaches ROLLOUTS either way."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from bus import BusConfig, TopologyConfig, connect
from bus import topology as topo
from bus.events import Rollout
from bus.weights.publisher import WeightPublisher
from tests.helpers.worker import CFG, publish_tasks, read_stream, states_for

ROOT = Path(__file__).resolve().parents[1]
TOPO = TopologyConfig(ack_wait_s=2.0)


def spawn_worker(tmp: Path, url: str, name: str, grace_s: float = 1.0) -> subprocess.Popen:
    conf = tmp / f"{name}.toml"
    conf.write_text(
        f'worker_id = "{name}"\n[engine]\nslots = 4\nmax_len = 128\n[admission]\nqueue = 2\n'
        f'[run]\nheartbeat_s = 1.0\ngrace_s = {grace_s}\n[bus]\nservers = ["{url}"]\nname = "{name}"\n'
        f"[bus.topology]\nack_wait_s = {TOPO.ack_wait_s}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ASYNCRL_LOG_JSON": "1"}
    log = open(tmp / f"{name}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "rollout_worker", "--config", str(conf)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )


async def rollout_counts(bus) -> Counter:
    return Counter(r.rollout_id for r in await read_stream(bus, topo.ROLLOUTS, Rollout))


async def test_killed_and_drained_workers_lose_nothing(fresh_server, tmp_path):
    bus = await connect(BusConfig(servers=[fresh_server.url], name="test", topology=TOPO))
    await bus.provision()
    await WeightPublisher(bus, epoch=1, trainer_id="t").publish_keyframe(states_for(1, seed=3)[0], 0, CFG)
    first = await publish_tasks(bus, 6, "k", max_tokens=64)
    procs = []
    try:
        a = spawn_worker(tmp_path, fresh_server.url, "wa")
        procs.append(a)
        counts = Counter()

        async def refresh():
            counts.clear()
            counts.update(await rollout_counts(bus))

        for _ in range(6000):  # until A is mid-work: some rollouts out, not all
            await refresh()
            if counts:
                break
            assert a.poll() is None, (tmp_path / "wa.log").read_text()[-3000:]
            await asyncio.sleep(0.02)
        held = (await bus.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)).num_ack_pending
        a.send_signal(signal.SIGKILL)
        a.wait()
        assert len(counts) < 12 and held > 0
        b = spawn_worker(tmp_path, fresh_server.url, "wb", grace_s=0.01)  # no time to finish: must release
        procs.append(b)
        want = {f"{t}-{i}" for t in first for i in range(2)}
        for _ in range(12000):
            await refresh()
            if set(counts) >= want:
                break
            assert b.poll() is None, (tmp_path / "wb.log").read_text()[-3000:]
            await asyncio.sleep(0.02)
        assert set(counts) == want and max(counts.values()) == 1  # exactly one per (task, sample)

        # SIGTERM: B stops fetching and releases (naks) what it still holds; C finishes the work
        second = await publish_tasks(bus, 6, "t", max_tokens=64)
        for _ in range(6000):
            info = await bus.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)
            if info.num_ack_pending > 0:
                break
            await asyncio.sleep(0.02)
        b.send_signal(signal.SIGTERM)
        assert b.wait(timeout=60) == 0
        c = spawn_worker(tmp_path, fresh_server.url, "wc")
        procs.append(c)
        want |= {f"{t}-{i}" for t in second for i in range(2)}
        for _ in range(12000):
            await refresh()
            if set(counts) >= want:
                break
            assert c.poll() is None, (tmp_path / "wc.log").read_text()[-3000:]
            await asyncio.sleep(0.02)
        assert set(counts) == want and max(counts.values()) == 1
        stopped = [
            json.loads(line)
            for line in (tmp_path / "wb.log").read_text().splitlines()
            if '"consumer loop stopped"' in line
        ]
        assert stopped and stopped[-1]["drained_naks"] > 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        await bus.close()
