"""Long tail: a group whose last episode is stuck is closed at its deadline with the members that
finished (baseline from those); the missing ones are recorded as timed out, and when the stuck one
arrives at last it is recorded late and never trained on (it would be a group of one): it rides
along with the next batch as consumed-not-trained, acked after that batch's checkpoint."""

import asyncio
import random

from bus import topology as topo
from policy.config import ModelConfig
from policy.model import Transformer
from tests.helpers.trainer import MODEL, make_scored, trainer_config
from trainer.batcher import Batcher, ConsumedIds


async def test_stuck_member_times_out_and_its_late_rollout_is_not_trained(bus, fresh_server, tmp_path):
    cfg = trainer_config(
        fresh_server.url, tmp_path, batch={"groups": 1, "group_size": 3, "group_timeout_s": 1.0}
    )
    model = Transformer(ModelConfig.from_dict(MODEL))
    rng = random.Random(5)
    for i, reward in ((0, 1.0), (1, 0.0)):  # two of three episodes finish; the third is stuck
        await bus.publish(topo.scored_subject("arith"), make_scored(model, "ep", i, 3, 0, rng, reward=reward))
    b = Batcher(bus, cfg, ConsumedIds(), 128)
    await b.start()
    batch = await b.next_batch(0, max_wait_s=10)
    assert sorted(batch.rollout_ids) == ["ep-0", "ep-1"] and [s.weight for s in batch.samples] == [1.0, 1.0]
    assert b.counters["timed_out"] == 1
    await b.ack(batch)
    b.consumed.add(batch.rollout_ids)
    await bus.publish(topo.scored_subject("arith"), make_scored(model, "ep", 2, 3, 0, rng, reward=1.0))
    assert await b.next_batch(1, max_wait_s=2.5) is None  # not a group of one after another deadline
    assert b.counters["late"] == 1 and b.pending == 0 and "ep-2" not in b.consumed  # held, not acked yet
    for i in range(3):  # the next complete group
        await bus.publish(
            topo.scored_subject("arith"), make_scored(model, "nx", i, 3, 0, rng, reward=float(i % 2))
        )
    batch = await b.next_batch(1, max_wait_s=10)
    assert sorted(s.rollout.rollout_id for s in batch.samples) == ["nx-0", "nx-1", "nx-2"]
    assert [s.rollout.rollout_id for s in batch.late] == ["ep-2"] and "ep-2" in batch.rollout_ids
    await b.ack(batch)
    await bus.nc.flush()
    for _ in range(50):  # acks are fire-and-forget: let the server count them
        if (await bus.js.consumer_info(topo.SCORED, topo.TRAINER_CONSUMER)).num_ack_pending == 0:
            break
        await asyncio.sleep(0.1)
    assert (
        await bus.js.consumer_info(topo.SCORED, topo.TRAINER_CONSUMER)
    ).num_ack_pending == 0  # late one too
