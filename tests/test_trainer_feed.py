"""Task feeding (async backlog, sync one-batch-per-version) and the supervised warm start."""

import asyncio
import random

from bus import topology as topo
from bus.events import Task, decode
from tests.helpers.trainer import make_scored, trainer_config
from trainer.factory import build_learner, build_model, build_optimizer
from trainer.leader import Trainer
from trainer.warmstart import warm_start


async def tasks_in_stream(bus) -> list[Task]:
    info = await bus.js.stream_info(topo.TASKS)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            out.append(decode((await bus.js.get_msg(topo.TASKS, seq)).data, Task))
        except Exception:
            pass  # consumed (work queue) meanwhile
    return out


async def wait_tasks(bus, n, timeout=60.0) -> list[Task]:
    for _ in range(int(timeout / 0.1)):
        ts = await tasks_in_stream(bus)
        if len(ts) >= n:
            return ts
        await asyncio.sleep(0.1)
    raise AssertionError(f"fewer than {n} tasks after {timeout}s")


async def answer(bus, model, tasks, version, rng):
    """Stand-in for workers + scorers: consume the tasks, publish their scored groups."""
    sub = await bus.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
    msgs = await sub.fetch(len(tasks), 2.0)
    for m in msgs:
        t = decode(m.data, Task)
        for i in range(t.sampling["n"]):
            await bus.publish(
                topo.scored_subject("arith"), make_scored(model, t.task_id, i, t.sampling["n"], version, rng)
            )
        await m.ack()
    await sub.unsubscribe()


async def test_sync_mode_one_task_batch_per_version(bus, fresh_server, tmp_path):
    cfg = trainer_config(
        fresh_server.url,
        tmp_path,
        run={"mode": "sync", "max_steps": 2},
        tasks={"feed": True},
        batch={"groups": 2, "group_size": 2},
    )
    model, mcfg = build_model(cfg)
    tr = Trainer(cfg, bus, build_learner(model, build_optimizer(model, cfg), cfg), mcfg)
    run = asyncio.create_task(tr.lead(asyncio.Event()))
    rng = random.Random(0)
    first = await wait_tasks(bus, 2)
    await asyncio.sleep(0.5)
    assert len(await tasks_in_stream(bus)) == 2  # exactly one batch, then it waits
    assert {t.min_version for t in first} == {0} and {t.sampling["n"] for t in first} == {2}
    await answer(bus, model, first, 0, rng)
    second = await wait_tasks(bus, 2)
    assert {t.min_version for t in second} == {1}  # the next batch asks for version 1
    await answer(bus, model, second, 1, rng)
    assert await asyncio.wait_for(run, 60) == 0 and tr.version == 2


async def test_async_mode_keeps_a_backlog(bus, fresh_server, tmp_path):
    cfg = trainer_config(
        fresh_server.url, tmp_path, tasks={"feed": True, "backlog": 3, "envs": ["arith", "python-tests"]}
    )
    model, mcfg = build_model(cfg)
    tr = Trainer(cfg, bus, build_learner(model, build_optimizer(model, cfg), cfg), mcfg)
    stop = asyncio.Event()
    run = asyncio.create_task(tr.lead(stop))
    ts = await wait_tasks(bus, 3)
    await asyncio.sleep(2.5)  # several feeding periods: no overfill
    ts = await tasks_in_stream(bus)
    assert len(ts) == 3 and {t.env for t in ts} == {"arith", "python-tests"}
    stop.set()
    assert await asyncio.wait_for(run, 30) == 0


def test_warm_start_lowers_demonstration_nll(tmp_path):
    cfg = trainer_config("nats://unused", tmp_path, warmstart={"steps": 25, "lr": 3e-3, "batch": 8})
    model, _ = build_model(cfg)
    losses = warm_start(model, cfg)
    assert len(losses) == 25 and sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3
