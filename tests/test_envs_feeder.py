"""Task feeder: tasks land in TASKS as groups with sampling params; bad requests are refused."""

from __future__ import annotations

import random

import pytest

from bus import topology as topo
from bus.events import SamplingParams, Task, decode
from envs import get_env
from envs.feeder import make_tasks, publish_tasks


async def test_publish_tasks_lands_groups_in_tasks(bus):
    sp = SamplingParams(temperature=0.7, max_tokens=48, n=4)
    ids = await publish_tasks(bus, "arith", 5, sp, random.Random(0), split="eval", min_version=3)
    assert len(set(ids)) == 5
    sub = await bus.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
    msgs = await sub.fetch(10, timeout=2)
    tasks = [decode(m.data, Task) for m in msgs]
    assert sorted(t.task_id for t in tasks) == sorted(ids)
    env = get_env("arith")
    for t, m in zip(tasks, msgs):
        assert m.subject == topo.task_subject("arith") and m.headers["Nats-Msg-Id"] == f"task-{t.task_id}"
        assert (
            t.sampling["n"] == 4
            and t.sampling["max_tokens"] == 48
            and t.split == "eval"
            and t.min_version == 3
        )
        assert env.verify(env.demonstration(t.spec), t.spec).success == 1.0
        await m.ack()


def test_bad_requests_are_refused():
    with pytest.raises(KeyError, match="unknown environment"):
        make_tasks("nope", 1, SamplingParams(), random.Random(0))
    with pytest.raises(ValueError, match="n must be"):
        make_tasks("arith", -1, SamplingParams(), random.Random(0))
    with pytest.raises(ValueError, match="unknown split"):
        make_tasks("arith", 1, SamplingParams(), random.Random(0), split="dev")
    with pytest.raises(ValueError, match="sampling needs"):
        make_tasks("arith", 1, SamplingParams(n=0), random.Random(0))
