"""Step-downs nak what the leader held, and each nak costs a delivery: repeated leader changes
can use up a scored rollout's max_deliver, after which the server never delivers it again.
A leader parks such stranded messages in DLQ with a reason (visible, nothing left in limbo):
those given up on while it leads (MAX_DELIVERIES advisory) and those given up on before it
led, while nobody listened (a scan before its first fetch)."""

import asyncio
import time

from bench.chaoskit.streams import dlq_entries
from bus import BusConfig, TopologyConfig, connect
from bus import topology as topo
from tests.helpers.trainer import publish_group, trainer_config
from trainer.batcher import Batcher, ConsumedIds
from trainer.factory import build_learner, build_model, build_optimizer
from trainer.leader import Trainer

MAX_DELIVER = 2


async def strand(url: str, tmp_path) -> tuple[object, list[str]]:
    """Two leaders in turn take a group and step down (Batcher.close naks it): with max_deliver=2
    both rollouts have used up their deliveries."""
    bus = await connect(
        BusConfig(servers=[url], name="stranded", topology=TopologyConfig(max_deliver=MAX_DELIVER))
    )
    await bus.provision()
    ids = await publish_group(bus, "strand")
    cfg = trainer_config(
        url, tmp_path, batch={"groups": 2, "group_size": 2}
    )  # the group waits for a second one
    for _ in range(MAX_DELIVER):
        b = Batcher(bus, cfg, ConsumedIds(), 128)
        await b.start()
        assert await b.next_batch(0, max_wait_s=1.0) is None and b.pending == 2
        await b.close()  # stepping down: hand them back
    return bus, ids


async def lead_until_parked(bus, url: str, tmp_path, want: int, timeout: float = 40.0) -> list:
    cfg = trainer_config(url, tmp_path, batch={"groups": 2, "group_size": 2})
    model, mcfg = build_model(cfg)
    tr = Trainer(cfg, bus, build_learner(model, build_optimizer(model, cfg), cfg), mcfg)
    stop = asyncio.Event()
    leading = asyncio.create_task(tr.lead(stop))
    t0 = time.monotonic()
    try:
        while len(entries := await dlq_entries(bus)) < want and time.monotonic() - t0 < timeout:
            assert not leading.done(), leading.result()
            await asyncio.sleep(0.25)
    finally:
        stop.set()
        assert await asyncio.wait_for(leading, 30) == 0
    return entries


async def test_rollouts_stranded_by_step_downs_are_parked_by_the_next_leader(fresh_server, tmp_path):
    bus, ids = await strand(fresh_server.url, tmp_path)
    try:
        entries = await lead_until_parked(bus, fresh_server.url, tmp_path, want=2)
        assert len(entries) == 2, entries
        assert all(
            subject == topo.dlq_subject(topo.SCORED) and "max_deliver" in reason
            for subject, reason in entries
        )
        assert (await bus.js.stream_info(topo.SCORED)).state.messages == 0  # nothing left in limbo
    finally:
        await bus.close()


async def test_rollouts_stranded_while_nobody_listened_are_found_by_the_scan(fresh_server, tmp_path):
    bus, ids = await strand(fresh_server.url, tmp_path)
    try:
        sub = await bus.pull(topo.SCORED, topo.TRAINER_CONSUMER)
        assert await sub.fetch(2, 1.0) == []  # the server gives up on them: advisory to nobody
        info = await bus.js.consumer_info(topo.SCORED, topo.TRAINER_CONSUMER)
        assert info.num_ack_pending == 0 and (await bus.js.stream_info(topo.SCORED)).state.messages == 2
        await sub.unsubscribe()
        entries = await lead_until_parked(bus, fresh_server.url, tmp_path, want=2)
        assert len(entries) == 2 and all("stranded" in reason for _, reason in entries), entries
        assert (await bus.js.stream_info(topo.SCORED)).state.messages == 0
    finally:
        await bus.close()
