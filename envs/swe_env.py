"""`swe`: multi-turn repository tasks from any task set on disk (built by `asyncrl tasks build` or
imported from SWE-bench-format JSONL by `asyncrl tasks import`) as tasks for the trainer's feeder.
`sample` returns a multi-turn task spec (an EpisodeTask, its limits and its reward mode: the worker
plays the episode and scores it); `split_specs` the whole held-out split; `demonstration` the
scripted oracle's transcript (tasks with a recorded mutation).

The run config names the task set, the limits, the prompt and the reward mode
(`[trainer.tasks.swe]`: envs/swe_config.py); the trainer calls `configure` with it before it samples.
Every task family of the set is played, on the set's own train/eval split: eval tasks are never
trained on.

`swe-gen` and `swe-demo` are presets of it: a generated task set of their own (built on first use
when missing, so the processes of a run read the same tasks) under the toy limits (TOY_LIMITS: few
turns, short observations, the toy prompt, sized for the char-level toy policy).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable

from kernel import get_logger

from . import base
from .base import SpecError, TaskSpec, Verdict, check_split, register
from .conversation import PlainFormat, episode_spec, transcript
from .episode import SPLITS, EpisodeLimits, EpisodeTask
from .oracle import run_oracle
from .sandbox import BashLimits

log = get_logger(__name__)

TOY_LIMITS = EpisodeLimits(
    max_turns=6,
    episode_wall_s=120.0,
    max_turn_tokens=400,
    max_format_errors=2,
    command=BashLimits(wall_s=10.0),
    obs_head_lines=10,
    obs_tail_lines=4,
    obs_line_chars=120,
    score_wall_s=60.0,
    prompt_style="toy",
    test_output="failures",
)


# `swe-demo`'s function bank: 8 short functions (61-163 chars) with several mutation sites each, so
# the toy policy can learn every original function by heart in a few hundred warm-start steps and
# the eval split still holds bugs (other sites / mutations of the same functions) never trained on.
DEMO_FUNCTIONS = ("clamp", "count_words", "gcd", "is_prime", "median_low", "overlaps", "rotate", "total")


class SweEnv:
    """Episodes of one task set under one set of limits (see the module docstring).

    `reward`: the reward mode the spec carries ("fraction" | "resolved"; None: the scorer's
    `[scorer.reward] episode_reward` decides). `families`: only these task families (None: all).
    `build(task_dir)`: writes the set when the directory holds none (presets), else a missing set
    is an error."""

    def __init__(
        self,
        name: str = "swe",
        task_dir: str = "",
        limits: EpisodeLimits | None = None,
        reward: str | None = None,
        families: tuple[str, ...] | None = None,
        build: Callable[[str], None] | None = None,
    ):
        self.name, self.task_dir, self.limits = name, task_dir, limits or EpisodeLimits()
        self.reward, self.families, self.build = reward, families, build
        self._tasks: dict[str, list[EpisodeTask]] | None = None
        self._demos: dict[str, tuple[str, list[tuple[str, bool]]]] = {}
        self._lock = threading.Lock()  # the trainer samples from its loop and from eval threads

    def tasks(self, split: str) -> list[EpisodeTask]:
        check_split(split)
        with self._lock:
            if self._tasks is None:
                self._tasks = self._load()
        return self._tasks[split]

    def _load(self) -> dict[str, list[EpisodeTask]]:
        from .task_set import load_task_set

        if not self.task_dir:
            raise ValueError(
                f"env {self.name!r} has no task set: set [trainer.tasks.swe] task_set "
                f"(the trainer configures the env from it: envs.swe_env.configure)"
            )
        if self.build is not None and not os.path.exists(os.path.join(self.task_dir, "manifest.json")):
            self.build(self.task_dir)
        tasks = [
            t for t in load_task_set(self.task_dir) if self.families is None or t.family in self.families
        ]
        by = {s: sorted((t for t in tasks if t.split == s), key=lambda t: t.task_id) for s in SPLITS}
        if not by["train"] or not by["eval"]:
            which = f"{'/'.join(self.families)} tasks" if self.families else "tasks"
            raise ValueError(
                f"{self.task_dir}: {self.name} needs {which} in both splits, "
                f"got {len(by['train'])} train and {len(by['eval'])} eval"
            )
        return by

    def spec(self, task: EpisodeTask) -> TaskSpec:
        spec = episode_spec(task, self.limits)
        if self.reward is not None:
            spec["reward"] = self.reward
        return TaskSpec(prompt=task.instruction, spec=spec)

    def sample(self, rng, split: str = "train") -> TaskSpec:
        pool = self.tasks(split)
        return self.spec(
            pool[rng.randrange(len(pool)) if hasattr(rng, "randrange") else int(rng.integers(len(pool)))]
        )

    def split_specs(self, split: str = "eval") -> list[TaskSpec]:
        """Every task of the split (a finite set: the held-out eval plays each in turn)."""
        return [self.spec(t) for t in self.tasks(split)]

    def verify(self, text: str, spec: dict) -> Verdict:
        raise SpecError(f"{self.name} tasks are episodes: the worker plays and scores them (Rollout.episode)")

    def demonstration_turns(self, spec: dict, fmt=None) -> tuple[str, list[tuple[str, bool]]]:
        """The oracle episode of the spec's task, played in the sandbox (cached per task):
        (prompt text, [(text, is_model)]) in the worker's layout, for a loss-masked warm start."""
        fmt = fmt or PlainFormat()
        task = EpisodeTask.from_dict(spec["episode"])
        key = f"{task.task_id}|{type(fmt).__name__}"
        if key not in self._demos:
            limits = EpisodeLimits(**spec["limits"]) if "limits" in spec else self.limits
            try:
                msgs, turns, result = run_oracle(task, dataclasses.replace(limits))
            except (KeyError, ValueError) as e:  # no recorded mutation (an imported instance)
                raise SpecError(f"task {task.task_id}: no oracle episode ({type(e).__name__}: {e})") from None
            if result.reward < 1.0:
                raise SpecError(f"task {task.task_id}: the oracle scored {result.reward} ({result.detail})")
            self._demos[key] = transcript(fmt, msgs, turns)
        return self._demos[key]

    def demonstration(self, spec: dict, style: str = "default") -> str:
        """The oracle's completion text (model turns and the observations between them)."""
        return "".join(text for text, _ in self.demonstration_turns(spec)[1])


_CONFIG = None  # the SweSection `configure` was last given (None: `swe` has no task set)


def configure(section) -> SweEnv:
    """Point the `swe` env of this process at `section`'s task set, limits, prompt and reward mode
    (an envs.swe_config.SweSection; None: no task set again); the shared instance get_env("swe")
    returns is replaced."""
    global _CONFIG
    _CONFIG = section
    base.drop_instance("swe")
    return base.get_env("swe")


@register("swe")
def swe() -> SweEnv:
    if _CONFIG is None:
        return SweEnv("swe")
    return SweEnv("swe", _CONFIG.task_set, _CONFIG.episode_limits(), _CONFIG.reward)


def generated_set(
    n_gen: int, seed: int, eval_fraction: float, n_modules: int, functions: tuple[str, ...] | None, name: str
) -> Callable[[str], None]:
    """A preset's builder: `n_gen` generated repositories (one validated bug each) written as a
    task set, with at least gen_repos.MIN_EVAL eval tasks."""

    def build(task_dir: str) -> None:
        from . import gen_repos
        from .task_set import write_task_set
        from .task_validation import BuildReport

        log.info("building the task set", env=name, dir=task_dir, repos=n_gen)
        report = BuildReport()
        tasks = gen_repos.build(
            n_gen,
            seed=seed,
            eval_fraction=eval_fraction,
            n_modules=n_modules,
            report=report,
            min_eval=gen_repos.MIN_EVAL,
            functions=functions,
        )
        write_task_set(task_dir, tasks, report.to_dict())

    return build


class SweGenEnv(SweEnv):
    """The `swe-gen` preset: generated repositories (gen-repo tasks) in `task_dir` (default
    `ASYNCRL_SWE_TASKS`, else tasks/swe-gen; built with `ASYNCRL_SWE_GEN` repositories, default 48,
    when missing: `asyncrl tasks build --out tasks/swe-gen --gen 48` builds it ahead of time) under
    the toy limits; the scorer's episode_reward decides the reward."""

    def __init__(
        self,
        name: str = "swe-gen",
        task_dir: str | None = None,
        n_gen: int | None = None,
        seed: int = 0,
        limits: EpisodeLimits = TOY_LIMITS,
        functions: tuple[str, ...] | None = None,
        n_modules: int = 2,
        eval_fraction: float = 0.2,
    ):
        super().__init__(
            name,
            task_dir or os.environ.get("ASYNCRL_SWE_TASKS", "tasks/swe-gen"),
            limits,
            families=("gen-repo",),
        )
        self.seed, self.functions, self.n_modules, self.eval_fraction = (
            seed,
            functions,
            n_modules,
            eval_fraction,
        )
        self.n_gen = int(n_gen if n_gen is not None else os.environ.get("ASYNCRL_SWE_GEN", "48"))
        # read n_gen when building (a caller may size the set after construction)
        self.build = lambda d: generated_set(
            self.n_gen, self.seed, self.eval_fraction, self.n_modules, self.functions, self.name
        )(d)


register("swe-gen")(SweGenEnv)


@register("swe-demo")
def swe_demo() -> SweGenEnv:
    """The second demo's tasks: one-module repositories drawn from DEMO_FUNCTIONS (a task set of its
    own: `ASYNCRL_SWE_DEMO_TASKS`, default tasks/swe-demo; `asyncrl tasks build --out tasks/swe-demo
    --gen 160 --functions DEMO --modules 1 --eval-fraction 0.25` builds the same one ahead of time)."""
    return SweGenEnv(
        "swe-demo",
        task_dir=os.environ.get("ASYNCRL_SWE_DEMO_TASKS", "tasks/swe-demo"),
        n_gen=160,
        functions=DEMO_FUNCTIONS,
        n_modules=1,
        eval_fraction=0.25,
    )
