"""The sections of ScorerConfig (`[scorer.<section>]` tables): one dataclass per piece of code
that owns those knobs, each checking its own values and naming its table and key in the error.
Light (no bus connection, no sandbox): `asyncrl config check` and `asyncrl up` build them before
any process starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kernel.config import check_section
from policy.reward import COST_UNITS, EPISODE_REWARDS

HINTS = {
    "cost_unit": f"one of {', '.join(COST_UNITS)}",
    "episode_reward": f"one of {', '.join(EPISODE_REWARDS)}",
    "default_lambda": "a finite number >= 0 (λ until KV rl-control/lambda has a value)",
    "overlong_buffer": ">= 0 tokens (0: no overlong shaping)",
    "overlong_scale": "a finite number >= 0 (the penalty at max_tokens)",
    "concurrency": ">= 1 rollouts in flight",
    "verify_threads": ">= 1 threads for the blocking (sandboxed) verifiers",
    "threads": ">= 0 (0: inherit OMP_NUM_THREADS)",
}


def check(section: str, obj, checks: dict[str, bool]) -> None:
    """ValueError naming every bad key of `[scorer.<section>]` with its value and what it must be."""
    check_section(f"scorer.{section}", obj, checks, HINTS)


@dataclass
class RewardSection:
    """How a verdict becomes a reward: success − λ·cost − overlong shaping (Scorer._publish,
    policy/reward.py)."""

    cost_unit: str = "tokens"  # tokens | wall_s | tool_calls
    default_lambda: float = 0.0  # until KV rl-control/lambda has a value
    overlong_buffer: int = 0  # >0: soft penalty over the last N tokens before max_tokens
    overlong_scale: float = 1.0  # penalty at the max length
    # an episode's training score: "fraction" of its tests passing (denser), or "resolved" (1 when all
    # pass, else 0: an untouched repository's ~0.8 of passing tests says nothing of the policy's fix)
    episode_reward: str = "fraction"

    def __post_init__(self) -> None:
        check(
            "reward",
            self,
            {
                "cost_unit": self.cost_unit in COST_UNITS,
                "default_lambda": math.isfinite(self.default_lambda) and self.default_lambda >= 0,
                "overlong_buffer": self.overlong_buffer >= 0,
                "overlong_scale": math.isfinite(self.overlong_scale) and self.overlong_scale >= 0,
                "episode_reward": self.episode_reward in EPISODE_REWARDS,
            },
        )


@dataclass
class RunSection:
    """This process and its loop (scorer/__main__.py, Scorer.run: its consumer loop, verifier pool,
    heartbeat)."""

    concurrency: int = 8  # rollouts in flight
    verify_threads: int = 4  # blocking verifiers (sandboxed code) run here
    # intra-op threads of numeric libraries (OMP_NUM_THREADS) in this process and the verifiers it
    # starts: `asyncrl up` sets it in their environment from its plan (asyncrl/thread_plan.py); 0 = inherit
    threads: int = 0
    heartbeat_s: float = 5.0
    grace_s: float = 10.0  # drain: time to finish held rollouts before they are nak'ed
    provision: bool = True  # declare the topology on start (off under restricted credentials)
    metrics_port: int = 0  # Prometheus /metrics (kernel.metrics); 0 = off
    # the address /metrics listens on: loopback unless an operator opens it (a container's own
    # network: 0.0.0.0, deploy/docker-compose.yml); it has no auth
    metrics_host: str = "127.0.0.1"
    # this process's number among its kind on one host (a systemd unit's %i): /metrics is served on
    # metrics_port + instance, so several on one host do not collide
    instance: int = 0
    log_level: str = "info"

    def __post_init__(self) -> None:
        check(
            "run",
            self,
            {
                "concurrency": self.concurrency >= 1,
                "verify_threads": self.verify_threads >= 1,
                "threads": self.threads >= 0,
                "instance": self.instance >= 0,
                "metrics_port": 0 <= self.metrics_port and self.metrics_port + self.instance < 65536,
            },
        )


@dataclass
class SandboxSection:
    """The code sandbox the verifiers run in (envs/isolation.py, checked by Scorer.run at start)."""

    # start even where the code sandbox lacks isolation layers (envs/isolation.py; never in production)
    allow_weak_sandbox: bool = False
    # the environments this scorer verifies ([]: any; `asyncrl up` sets [trainer.tasks] envs): when none
    # runs code (arithmetic) the sandbox check waits for the first rollout that does
    envs: list[str] = field(default_factory=list)
