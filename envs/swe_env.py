"""`swe-gen`: tier-1 bug-fix episodes (generated repositories, one injected bug each) as tasks for
the trainer's feeder. `sample` returns a multi-turn task spec (an EpisodeTask and its limits: the
worker plays the episode and scores it); `demonstration` is the scripted oracle's transcript.

Tasks come from a task set on disk (`ASYNCRL_SWE_TASKS`, default `tasks/swe-gen`). When it is
missing the env builds one (`ASYNCRL_SWE_GEN` generated repositories, default 48) and writes it
there, so the processes of a run (trainer, eval) read the same tasks; `asyncrl tasks build --out
tasks/swe-gen --gen 48` builds it ahead of time (the build runs every mutant's tests: minutes).
The split is the builder's (a function of the bug's identity, with at least `gen_repos.MIN_EVAL`
eval tasks): eval tasks are never trained on.

Limits are sized for the char-level toy policy: few turns, short observations, so an episode fits
its context (the worker caps `max_context_tokens` to its engine's slot as well).
"""

from __future__ import annotations

import dataclasses
import os
import threading

from bus import get_logger

from .base import SpecError, TaskSpec, Verdict, check_split, register
from .conversation import PlainFormat, episode_spec, transcript
from .episode import EpisodeLimits, EpisodeTask
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


class SweGenEnv:
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
        self.name, self.seed, self.limits = name, seed, limits
        self.functions, self.n_modules, self.eval_fraction = functions, n_modules, eval_fraction
        self.task_dir = task_dir or os.environ.get("ASYNCRL_SWE_TASKS", "tasks/swe-gen")
        self.n_gen = int(n_gen if n_gen is not None else os.environ.get("ASYNCRL_SWE_GEN", "48"))
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
        from .task_set import load_task_set, write_task_set

        if not os.path.exists(os.path.join(self.task_dir, "manifest.json")):
            from . import gen_repos
            from .task_validation import BuildReport

            log.info("building the task set", env=self.name, dir=self.task_dir, repos=self.n_gen)
            report = BuildReport()
            write_task_set(
                self.task_dir,
                gen_repos.build(
                    self.n_gen,
                    seed=self.seed,
                    eval_fraction=self.eval_fraction,
                    n_modules=self.n_modules,
                    report=report,
                    min_eval=gen_repos.MIN_EVAL,
                    functions=self.functions,
                ),
                report.to_dict(),
            )
        tasks = [t for t in load_task_set(self.task_dir) if t.family == "gen-repo"]
        by = {
            s: sorted((t for t in tasks if t.split == s), key=lambda t: t.task_id) for s in ("train", "eval")
        }
        if not by["train"] or not by["eval"]:
            raise ValueError(
                f"{self.task_dir}: {self.name} needs gen-repo tasks in both splits, "
                f"got {len(by['train'])} train and {len(by['eval'])} eval"
            )
        return by

    def sample(self, rng, split: str = "train") -> TaskSpec:
        pool = self.tasks(split)
        t = pool[rng.randrange(len(pool)) if hasattr(rng, "randrange") else int(rng.integers(len(pool)))]
        return TaskSpec(prompt=t.instruction, spec=episode_spec(t, self.limits))

    def split_specs(self, split: str = "eval") -> list[TaskSpec]:
        """Every task of the split (a finite set: the held-out eval plays each in turn)."""
        return [TaskSpec(prompt=t.instruction, spec=episode_spec(t, self.limits)) for t in self.tasks(split)]

    def verify(self, text: str, spec: dict) -> Verdict:
        raise SpecError("swe-gen tasks are episodes: the worker plays and scores them (Rollout.episode)")

    def demonstration_turns(self, spec: dict, fmt=None) -> tuple[str, list[tuple[str, bool]]]:
        """The oracle episode of the spec's task, played in the sandbox (cached per task):
        (prompt text, [(text, is_model)]) in the worker's layout, for a loss-masked warm start."""
        fmt = fmt or PlainFormat()
        task = EpisodeTask.from_dict(spec["episode"])
        key = f"{task.task_id}|{type(fmt).__name__}"
        if key not in self._demos:
            limits = EpisodeLimits(**spec["limits"]) if "limits" in spec else self.limits
            msgs, turns, result = run_oracle(task, dataclasses.replace(limits))
            if result.reward < 1.0:
                raise SpecError(f"task {task.task_id}: the oracle scored {result.reward} ({result.detail})")
            self._demos[key] = transcript(fmt, msgs, turns)
        return self._demos[key]

    def demonstration(self, spec: dict, style: str = "default") -> str:
        """The oracle's completion text (model turns and the observations between them)."""
        return "".join(text for text, _ in self.demonstration_turns(spec)[1])


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
