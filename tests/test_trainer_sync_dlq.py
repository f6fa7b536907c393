"""Sync mode (one batch of tasks per version, a barrier between versions) goes on when a whole
task of the version's batch yields nothing: the trainer publishes a replacement after
sync_task_timeout_s instead of waiting forever for a group that cannot form."""

import asyncio
import random

from bench.chaoskit.streams import dlq_entries
from bus import topology as topo
from bus.events import Task, decode
from policy.config import ModelConfig
from policy.model import Transformer
from tests.helpers.trainer import MODEL, make_scored, trainer_config
from trainer.factory import build_learner, build_model, build_optimizer
from trainer.leader import Trainer


async def generate(bus, group_size: int, poison: list[str], stop: asyncio.Event) -> None:
    """Stands in for workers + scorers: the first task is parked in DLQ (a poison task: none of its
    rollouts reaches SCORED); every other task becomes a full group of scored rollouts."""
    model = Transformer(ModelConfig.from_dict(MODEL))
    rng = random.Random(3)
    sub = await bus.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
    while not stop.is_set():
        for msg in await sub.fetch(8, 0.2):
            task = decode(msg.data, Task)
            if not poison:
                poison.append(task.task_id)
                await bus.dlq(msg, "poison: the verifier raised on every delivery", topo.TASKS)
                continue
            for i in range(group_size):
                await bus.publish(
                    topo.scored_subject("arith"),
                    make_scored(model, task.task_id, i, group_size, task.min_version, rng),
                )
            await msg.ack()


async def test_sync_run_continues_past_a_task_parked_in_dlq(bus, fresh_server, tmp_path):
    cfg = trainer_config(
        fresh_server.url,
        tmp_path,
        run={"mode": "sync", "max_steps": 3, "sync_task_timeout_s": 2.0},
        tasks={"feed": True},
        batch={"groups": 2, "group_size": 2, "group_timeout_s": 60.0},
    )
    model, mcfg = build_model(cfg)
    tr = Trainer(cfg, bus, build_learner(model, build_optimizer(model, cfg), cfg), mcfg)
    stop, poison = asyncio.Event(), []
    gen = asyncio.create_task(generate(bus, 2, poison, stop))
    try:
        assert await asyncio.wait_for(tr.lead(asyncio.Event()), 60) == 0
    finally:
        stop.set()
        await gen
    assert tr.version == 3 and len(poison) == 1
    assert tr.sync_replaced == 1  # exactly the one task that produced nothing
    assert any("poison" in reason for _, reason in await dlq_entries(bus))
