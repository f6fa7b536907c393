"""Publish tasks from an environment into TASKS: each Task is one group (the worker makes
sampling.n completions of it). Used by the trainer, by `asyncrl up` and by benchmarks."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from bus import topology as topo
from bus.events import SamplingParams, Task, new_id

from .base import check_split, get_env


def chat_renderer(tok) -> Callable[[str], str]:
    """Prompt text -> the same text as the user turn of `tok`'s chat template, ready for the
    assistant's reply (for instruct models; the worker tokenises Task.prompt as it is)."""
    if not getattr(tok, "chat_template", None):
        raise ValueError(
            "chat_template = true needs a tokenizer with a chat template "
            f"(got {type(tok).__name__} without one)"
        )
    return lambda prompt: tok.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)


def prompt_ids(tok, prompts: list[str], chat_template: bool = False) -> list[list[int]]:
    """Prompts as the workers see them: through the chat template when the trainer's feeder
    renders them so (instruct models), then tokenised with bos (evals, calibrate-cost)."""
    if chat_template:
        render = chat_renderer(tok)
        prompts = [render(p) for p in prompts]
    return [tok.encode(p, bos=True) for p in prompts]


def make_tasks(
    env_name: str,
    n: int,
    sampling: SamplingParams,
    rng,
    split: str = "train",
    min_version: int = 0,
    render: Callable[[str], str] | None = None,
    lambda_: float | None = None,
) -> list[Task]:
    """`n` Task events drawn from `env_name` (no I/O); `render` rewrites each prompt (chat_renderer);
    `lambda_` is stamped on each (its group is scored with it; None: the scorers' live λ)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    check_split(split)
    env = get_env(env_name)
    sp = msgspec.structs.asdict(sampling)
    if sp["n"] < 1 or sp["max_tokens"] < 1:
        raise ValueError(f"sampling needs n >= 1 and max_tokens >= 1, got {sp}")
    tasks = []
    for _ in range(n):
        t = env.sample(rng, split)
        prompt = render(t.prompt) if render is not None else t.prompt
        tasks.append(
            Task(
                task_id=new_id(),
                env=env_name,
                prompt=prompt,
                spec=t.spec,
                sampling=dict(sp),
                split=split,
                min_version=min_version,
                lambda_=lambda_,
            )
        )
    for t in tasks:
        t.validate()  # a λ that is not finite and >= 0 is refused here, before anything is sent
    return tasks


async def publish_tasks(
    bus,
    env_name: str,
    n: int,
    sampling: SamplingParams,
    rng,
    split: str = "train",
    min_version: int = 0,
    render: Callable[[str], str] | None = None,
    lambda_: float | None = None,
) -> list[str]:
    """Draw `n` tasks and publish them to rl.tasks.<env> (acked by JetStream); returns the task ids
    (= group ids: every rollout of a task carries its task_id)."""
    tasks = make_tasks(env_name, n, sampling, rng, split, min_version, render, lambda_)
    await bus.publish_many([(topo.task_subject(env_name), t) for t in tasks])
    return [t.task_id for t in tasks]
