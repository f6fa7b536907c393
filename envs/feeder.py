"""Publish tasks from an environment into TASKS: each Task is one group (the worker makes
sampling.n completions of it). Used by the trainer, by `asyncrl up` and by benchmarks."""
from __future__ import annotations

import dataclasses

from bus import topology as topo
from bus.events import SamplingParams, Task, new_id

from .base import check_split, get_env


def make_tasks(env_name: str, n: int, sampling: SamplingParams, rng, split: str = "train",
               min_version: int = 0) -> list[Task]:
    """`n` Task events drawn from `env_name` (no I/O)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    check_split(split)
    env = get_env(env_name)
    sp = dataclasses.asdict(sampling)
    if sp["n"] < 1 or sp["max_tokens"] < 1:
        raise ValueError(f"sampling needs n >= 1 and max_tokens >= 1, got {sp}")
    tasks = []
    for _ in range(n):
        t = env.sample(rng, split)
        tasks.append(Task(task_id=new_id(), env=env_name, prompt=t.prompt, spec=t.spec, sampling=dict(sp),
                          split=split, min_version=min_version))
    return tasks


async def publish_tasks(bus, env_name: str, n: int, sampling: SamplingParams, rng, split: str = "train",
                        min_version: int = 0) -> list[str]:
    """Draw `n` tasks and publish them to rl.tasks.<env> (acked by JetStream); returns the task ids
    (= group ids: every rollout of a task carries its task_id)."""
    tasks = make_tasks(env_name, n, sampling, rng, split, min_version)
    await bus.publish_many([(topo.task_subject(env_name), t) for t in tasks])
    return [t.task_id for t in tasks]
