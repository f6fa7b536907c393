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
from dataclasses import dataclass, field

from kernel.config import check_section
from policy.reward import EPISODE_REWARDS

from .episode import PROMPT_STYLES, SPLITS, TEST_OUTPUTS, EpisodeLimits
from .sandbox import BashLimits

TABLE = "trainer.tasks.swe"


@dataclass
class SweLimits:
    """`[trainer.tasks.swe.limits]`: one episode's budget (envs/episode.py EpisodeLimits)."""

    max_turns: int = 15  # model turns (one command each)
    turn_tokens: int = 1024  # tokens of one turn (the worker generates at most this)
    context_tokens: int = 16384  # prompt + turns + observations (the worker caps it to its slot)
    format_errors: int = 3  # turns in a row without exactly one command end the episode
    episode_wall_s: float = 300.0  # the whole episode, model time included
    command_wall_s: float = 10.0  # one command's wall clock
    command_cpu_s: int = 10  # one command's CPU seconds
    command_output_bytes: int = 32 << 10  # of a command's output kept: this much of its head and of its tail
    score_wall_s: float = 120.0  # the scoring run of the hidden tests

    def __post_init__(self) -> None:
        check_section(
            f"{TABLE}.limits",
            self,
            {
                "max_turns": 1 <= self.max_turns <= 1000,
                "turn_tokens": 1 <= self.turn_tokens <= 1 << 20,
                "context_tokens": self.turn_tokens < self.context_tokens <= 1 << 24,
                "format_errors": 1 <= self.format_errors <= 1000,
                "episode_wall_s": 0 < self.episode_wall_s <= 86400,
                "command_wall_s": 0 < self.command_wall_s <= 3600,
                "command_cpu_s": 1 <= self.command_cpu_s <= 3600,
                "command_output_bytes": 256 <= self.command_output_bytes <= 64 << 20,
                "score_wall_s": 0 < self.score_wall_s <= 86400,
            },
            {
                "max_turns": "in [1, 1000]",
                "turn_tokens": "in [1, 1048576]",
                "context_tokens": "more than turn_tokens, at most 16777216",
                "format_errors": "in [1, 1000]",
                "episode_wall_s": "in (0, 86400]",
                "command_wall_s": "in (0, 3600]",
                "command_cpu_s": "in [1, 3600]",
                "command_output_bytes": "in [256, 67108864]",
                "score_wall_s": "in (0, 86400]",
            },
        )


@dataclass
class SweSection:
    """`[trainer.tasks.swe]`: the `swe` env's task set, limits, prompt and reward mode."""

    task_set: str = ""  # a task-set directory (manifest.json + tasks.jsonl); required with env "swe"
    reward: str = "fraction"  # fraction | resolved
    prompt: str = "full"  # full | toy (envs/episode.py SYSTEM_PROMPT / TOY_SYSTEM_PROMPT)
    test_output: str = "full"  # full | failures
    limits: SweLimits = field(default_factory=SweLimits)

    def __post_init__(self) -> None:
        if isinstance(self.limits, dict):
            self.limits = SweLimits(**self.limits)
        check_section(
            TABLE,
            self,
            {
                "reward": self.reward in EPISODE_REWARDS,
                "prompt": self.prompt in PROMPT_STYLES,
                "test_output": self.test_output in TEST_OUTPUTS,
            },
            {
                "reward": f"one of {', '.join(EPISODE_REWARDS)}",
                "prompt": f"one of {', '.join(PROMPT_STYLES)}",
                "test_output": f"one of {', '.join(TEST_OUTPUTS)}",
            },
        )

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
