"""What every environment is: a prompt generator, a verifier and a demonstrator, found by name."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

SPLITS = ("train", "eval")


class SpecError(ValueError):
    """A task spec the environment cannot verify against (the task's fault, not the completion's)."""


@dataclass(frozen=True)
class TaskSpec:
    prompt: str
    spec: dict = field(
        default_factory=dict
    )  # everything verify() needs (answer, tests); travels in Task.spec


@dataclass(frozen=True)
class Verdict:
    success: float  # 0..1
    reason: str  # why: "correct", "wrong answer 12 != 13", "timeout after 5.0s", ...
    tool_calls: int = 0
    infra: str = ""  # non-empty: the sandbox failed, not the completion (no verdict; weight 0)


class Env(Protocol):
    name: str

    def sample(self, rng, split: str = "train") -> TaskSpec: ...
    def verify(self, text: str, spec: dict) -> Verdict: ...
    def demonstration(self, spec: dict, style: str = "default") -> str: ...

    # optional: `split_specs(split) -> list[TaskSpec]` for a finite split (the held-out eval then
    # plays every task in turn instead of drawing at random: trainer/evaluate.eval_specs)


ENVS: dict[str, Callable[[], Env]] = {}  # name -> factory
# name -> whether its verifier or its episodes run the policy's output as code (then the worker
# and scorer serving it need the sandbox: envs/isolation.py); declared at registration
RUNS_CODE: dict[str, bool] = {}
_INSTANCES: dict[str, Env] = {}


def register(name: str, runs_code: bool = True):
    def deco(factory):
        ENVS[name] = factory
        RUNS_CODE[name] = runs_code
        return factory

    return deco


def runs_code(name: str) -> bool:
    """Whether environment `name` runs the policy's code (unknown: assumed to)."""
    return RUNS_CODE.get(name, True)


def get_env(name: str) -> Env:
    """The environment registered under `name` (one shared instance per process)."""
    if name not in ENVS:
        raise KeyError(f"unknown environment {name!r}; known: {sorted(ENVS)}")
    if name not in _INSTANCES:
        _INSTANCES[name] = ENVS[name]()
    return _INSTANCES[name]


def drop_instance(name: str) -> None:
    """Forget the shared instance of `name`: the next get_env builds it anew (its config changed)."""
    _INSTANCES.pop(name, None)


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


def split_of(key: str, eval_fraction: float) -> str:
    """Deterministic train/eval assignment of a problem by its identity: the splits never overlap."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return "eval" if (h % 10_000) < eval_fraction * 10_000 else "train"
