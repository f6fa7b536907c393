"""A step (+ encode + checkpoint + publication) slower than ack_wait loses nothing.

The batch being trained and published is kept alive like the groups still waiting; a
redelivery of a message the trainer holds only swaps the handle it will ack after the
checkpoint (acking the redelivered copy as a duplicate would lose the rollout if the trainer
died before its checkpoint). Last: two real trainer processes, the leader's step made slower
than ack_wait (debug_step_delay_s), SIGKILLed after ack_wait and before its checkpoint: the
standby trains every rollout, each exactly once."""

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

from bus import BusConfig, TopologyConfig, connect
from bus import topology as topo
from tests.helpers.trainer import publish_group, trainer_config
from tests.helpers.trainer_process import start as start_trainer
from trainer.batcher import Batcher, ConsumedIds

ACK_WAIT = 2.0


async def short_ack_bus(url: str, ack_wait_s: float = ACK_WAIT):
    """A bus whose provisioning sets the consumers' ack_wait to `ack_wait_s` (server side)."""
    b = await connect(
        BusConfig(servers=[url], name="slow-step", topology=TopologyConfig(ack_wait_s=ack_wait_s))
    )
    await b.provision()
    return b


async def pending(bus) -> tuple[int, int, int]:
    info = await bus.js.consumer_info(topo.SCORED, topo.TRAINER_CONSUMER)
    return info.num_pending, info.num_ack_pending, info.num_redelivered


async def settled(bus, want: tuple, timeout: float = 3.0) -> tuple:
    """Acks are fire-and-forget: wait until the consumer shows (pending, ack_pending) == want."""
    t0 = time.monotonic()
    while (now := await pending(bus))[:2] != want and time.monotonic() - t0 < timeout:
        await asyncio.sleep(0.05)
    return now[:2]


async def test_batch_in_flight_is_kept_alive_past_ack_wait(fresh_server, tmp_path):
    bus = await short_ack_bus(fresh_server.url)
    try:
        await publish_group(bus, "slow")
        cfg = trainer_config(fresh_server.url, tmp_path, batch={"groups": 1, "group_size": 2})
        cfg.bus.topology.ack_wait_s = ACK_WAIT
        b = Batcher(bus, cfg, ConsumedIds(), 128)
        await b.start()
        batch = await b.next_batch(0)
        assert len(batch.samples) == 2
        # the "step": 3 x ack_wait; the loop keeps fetching meanwhile (as it does for the next batch)
        assert await b.next_batch(1, max_wait_s=3 * ACK_WAIT) is None
        assert await pending(bus) == (0, 2, 0)  # never redelivered, nothing acked early
        assert b.counters["duplicates"] == 0 and b.counters["heartbeats"] >= 2
        await b.ack(batch)
        assert await settled(bus, (0, 0)) == (0, 0)
        assert (await bus.js.stream_info(topo.SCORED)).state.messages == 0
        await b.close()
    finally:
        await bus.close()


async def test_redelivery_of_a_held_batch_swaps_the_handle_and_is_not_acked(fresh_server, tmp_path):
    bus = await short_ack_bus(fresh_server.url, ack_wait_s=30.0)
    try:
        await publish_group(bus, "redo")
        cfg = trainer_config(fresh_server.url, tmp_path, batch={"groups": 1, "group_size": 2})
        b = Batcher(bus, cfg, ConsumedIds(), 128)
        await b.start()
        batch = await b.next_batch(0)
        first = batch.samples[0]
        await first.msg.nak()  # e.g. heartbeats lost in a broker blip
        assert await b.next_batch(1, max_wait_s=1.5) is None  # takes the redelivery
        assert b.counters["redelivered_held"] == 1 and b.counters["duplicates"] == 0
        assert first.msg.metadata.num_delivered == 2  # the newest delivery's handle is the one held
        await asyncio.sleep(0.5)
        _, ack_pending, _ = await pending(bus)
        assert ack_pending == 2  # the redelivered copy was not acked
        await b.ack(batch)  # after the checkpoint: acked with the new handle
        assert await settled(bus, (0, 0)) == (0, 0)
        assert (await bus.js.stream_info(topo.SCORED)).state.messages == 0
        await b.close()
    finally:
        await bus.close()


def start(tmp: Path, url: str, tid: str, **extra) -> subprocess.Popen:
    return start_trainer(tmp, url, tid, ack_wait_s=ACK_WAIT, **extra)


async def wait_log(path: Path, text: str, timeout: float, proc: subprocess.Popen) -> None:
    t0 = time.monotonic()
    while not (path.exists() and text in path.read_text(errors="replace")):
        assert proc.poll() is None, path.read_text()[-3000:]
        assert time.monotonic() - t0 < timeout, f"no {text!r} in {path.name} after {timeout}s"
        await asyncio.sleep(0.2)


def used_ids(tmp: Path) -> list[str]:
    out = []
    for p in tmp.glob("run-*/metrics/trainer.jsonl"):
        out += [
            rid
            for line in p.read_text().splitlines()
            if line.strip()
            for rid in json.loads(line)["rollout_ids"]
        ]
    return out


async def test_leader_slower_than_ack_wait_killed_before_checkpoint_loses_nothing(fresh_server, tmp_path):
    bus = await short_ack_bus(fresh_server.url)
    delay = 6 * ACK_WAIT
    procs = {"A": start(tmp_path, fresh_server.url, "A", faults={"step_delay_s": delay})}
    try:
        await wait_log(tmp_path / "A.log", '"leading"', 120, procs["A"])
        procs["B"] = start(tmp_path, fresh_server.url, "B")
        await wait_log(tmp_path / "B.log", "waiting for the leader lease", 120, procs["B"])
        ids = await publish_group(bus, "slowkill")
        t0 = time.monotonic()
        while (await pending(bus))[:2] != (0, 2):  # A holds the batch (it trains on it at once)
            assert time.monotonic() - t0 < 30, await pending(bus)
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.5 * ACK_WAIT)  # past ack_wait, well before A's checkpoint
        held = await pending(bus)
        procs["A"].send_signal(signal.SIGKILL)
        procs["A"].wait()
        assert not (
            tmp_path / "run-A" / "metrics" / "trainer.jsonl"
        ).exists()  # killed before its step went out
        t0 = time.monotonic()
        while sorted(used_ids(tmp_path)) != sorted(ids):
            assert procs["B"].poll() is None, (tmp_path / "B.log").read_text()[-3000:]
            assert time.monotonic() - t0 < 45, (
                f"standby never trained {ids}: used {used_ids(tmp_path)}, "
                f"consumer (pending, ack_pending, redelivered) before the "
                f"kill {held}, now {await pending(bus)}"
            )
            await asyncio.sleep(0.2)
        assert held[1] == 2  # A still held both when killed (none acked early)
        await asyncio.sleep(1.0)
        assert sorted(used_ids(tmp_path)) == sorted(ids)  # each exactly once
        assert (await bus.js.stream_info(topo.SCORED)).state.messages == 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        await bus.close()
