"""The `swe` env's run config: which task set, the episode limits, the prompt and the reward mode.

    [trainer.tasks.swe]
    task_set = "tasks/my-set"        # built by `asyncrl tasks build` or `asyncrl tasks import`
    reward   = "fraction"            # fraction: share of the task's tests passing | resolved: 1 or 0
    prompt   = "full"                # full: the bash-block prompt (SYSTEM_PROMPT) | toy: TOY_SYSTEM_PROMPT
    test_output = "full"             # full | failures (run_tests shows only the failing tests)
    [trainer.tasks.swe.limits]
    max_turns = 15
    turn_tokens = 1024  ...

Checked when the config is built (before anything starts): each limit in its range, the task set a
directory holding a set with tasks in both splits. The limits and the reward mode travel in every
task's spec (envs/conversation.episode_spec), so the worker, its harness and the scorer play and
score each episode as the trainer's config says.
"""

from __future__ import annotations

import os
from dataclasses import field
from typing import Annotated, Literal

from pydantic import Field, model_validator

from kernel.config import config_class
from policy.reward import EPISODE_REWARDS

from .episode import PROMPT_STYLES, SPLITS, TEST_OUTPUTS, EpisodeLimits
from .sandbox import BashLimits

TABLE = "trainer.tasks.swe"


@config_class
class SweLimits:
    """`[trainer.tasks.swe.limits]`: one episode's budget (envs/episode.py EpisodeLimits)."""

    max_turns: Annotated[int, Field(ge=1, le=1000, description="model turns (one command each)")] = 15
    turn_tokens: Annotated[
        int, Field(ge=1, le=1 << 20, description="tokens of one turn (the worker generates at most this)")
    ] = 1024
    context_tokens: Annotated[
        int,
        Field(
            le=1 << 24,
            description="prompt + turns + observations (the worker caps it to its slot); more than "
            "turn_tokens",
        ),
    ] = 16384
    format_errors: Annotated[
        int, Field(ge=1, le=1000, description="turns in a row without exactly one command end the episode")
    ] = 3
    episode_wall_s: Annotated[
        float, Field(gt=0, le=86400, description="the whole episode, model time included")
    ] = 300.0
    command_wall_s: Annotated[float, Field(gt=0, le=3600, description="one command's wall clock")] = 10.0
    command_cpu_s: Annotated[int, Field(ge=1, le=3600, description="one command's CPU seconds")] = 10
    command_output_bytes: Annotated[
        int,
        Field(
            ge=256,
            le=64 << 20,
            description="of a command's output kept: this much of its head and of its tail",
        ),
    ] = 32 << 10
    score_wall_s: Annotated[
        float, Field(gt=0, le=86400, description="the scoring run of the hidden tests")
    ] = 120.0

    @model_validator(mode="after")
    def _context_holds_a_turn(self):
        if self.context_tokens <= self.turn_tokens:
            raise ValueError(
                f"context_tokens must be more than turn_tokens, got context_tokens={self.context_tokens}, "
                f"turn_tokens={self.turn_tokens}"
            )
        return self


@config_class
class SweSection:
    """`[trainer.tasks.swe]`: the `swe` env's task set, limits, prompt and reward mode."""

    task_set: Annotated[
        str,
        Field(description='a task-set directory (manifest.json + tasks.jsonl); required with env "swe"'),
    ] = ""
    reward: Literal[EPISODE_REWARDS] = "fraction"
    prompt: Annotated[
        Literal[PROMPT_STYLES], Field(description="envs/episode.py SYSTEM_PROMPT / TOY_SYSTEM_PROMPT")
    ] = "full"
    test_output: Literal[TEST_OUTPUTS] = "full"
    limits: SweLimits = field(default_factory=SweLimits)

    def episode_limits(self) -> EpisodeLimits:
        L = self.limits
        return EpisodeLimits(
            max_turns=L.max_turns,
            episode_wall_s=L.episode_wall_s,
            max_context_tokens=L.context_tokens,
            max_turn_tokens=L.turn_tokens,
            max_format_errors=L.format_errors,
            command=BashLimits(
                wall_s=L.command_wall_s, cpu_s=L.command_cpu_s, keep_bytes=L.command_output_bytes
            ),
            score_wall_s=L.score_wall_s,
            prompt_style=self.prompt,
            test_output=self.test_output,
        )

    def check_task_set(self) -> dict[str, int]:
        """{split: tasks} of the task set; ValueError naming the key and the path when it is not one
        the env can train on (missing, not a task set, broken, a split without tasks)."""
        return check_task_set(self.task_set, f"[{TABLE}] task_set")


def check_task_set(path: str, key: str) -> dict[str, int]:
    from .task_set import load_task_set

    if not path:
        raise ValueError(f"{key} is empty: the env `swe` needs a task-set directory")
    if not os.path.isdir(path):
        raise ValueError(
            f"{key} = {path!r}: no such directory (build one with `asyncrl tasks build --out {path}` "
            f"or `asyncrl tasks import FILE.jsonl --out {path}`)"
        )
    try:
        tasks = load_task_set(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{key} = {path!r}: {e}") from None
    counts = {s: sum(t.split == s for t in tasks) for s in SPLITS}
    empty = [s for s in SPLITS if not counts[s]]
    if empty:
        raise ValueError(
            f"{key} = {path!r}: the {' and '.join(empty)} split has no tasks "
            f"({counts['train']} train, {counts['eval']} eval): the env trains on train and holds out "
            f"eval (`asyncrl tasks import --split eval` or a `split` field per instance assigns them)"
        )
    return counts
