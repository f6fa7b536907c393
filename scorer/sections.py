"""The sections of ScorerConfig (`[scorer.<section>]` tables): one config class per piece of code
that owns those knobs, each field's bounds and description on it (kernel.config names the table
and key in every error). Light (no bus connection, no sandbox): `asyncrl config check` and
`asyncrl up` build them before any process starts."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from pydantic import Field, model_validator

from kernel.config import CsvList, config_class
from policy.reward import COST_UNITS, EPISODE_REWARDS


@config_class
class RewardSection:
    """How a verdict becomes a reward: success − λ·cost − overlong shaping (Scorer._publish,
    policy/reward.py)."""

    cost_unit: Annotated[Literal[COST_UNITS], Field(description="what λ·cost counts")] = "tokens"
    default_lambda: Annotated[
        float, Field(ge=0, allow_inf_nan=False, description="λ until KV rl-control/lambda has a value")
    ] = 0.0
    overlong_buffer: Annotated[
        int, Field(ge=0, description=">0: soft penalty over the last N tokens before max_tokens (0: none)")
    ] = 0
    overlong_scale: Annotated[
        float, Field(ge=0, allow_inf_nan=False, description="the overlong penalty at max_tokens")
    ] = 1.0
    episode_reward: Annotated[
        Literal[EPISODE_REWARDS],
        Field(
            description="an episode's training score: 'fraction' of its tests passing (denser), or "
            "'resolved' (1 when all pass, else 0: an untouched repository's ~0.8 of passing tests "
            "says nothing of the policy's fix)"
        ),
    ] = "fraction"


@config_class
class RunSection:
    """This process and its loop (scorer/__main__.py, Scorer.run: its consumer loop, verifier pool,
    heartbeat)."""

    concurrency: Annotated[int, Field(ge=1, description="rollouts in flight")] = 8
    verify_threads: Annotated[
        int, Field(ge=1, description="threads for the blocking (sandboxed) verifiers")
    ] = 4
    threads: Annotated[
        int,
        Field(
            ge=0,
            description="intra-op threads of numeric libraries (OMP_NUM_THREADS) in this process and "
            "the verifiers it starts: `asyncrl up` sets it from its plan (asyncrl/thread_plan.py); "
            "0 = inherit",
        ),
    ] = 0
    heartbeat_s: float = 5.0
    grace_s: Annotated[
        float, Field(description="drain: time to finish held rollouts before they are nak'ed")
    ] = 10.0
    provision: Annotated[
        bool, Field(description="declare the topology on start (off under restricted credentials)")
    ] = True
    metrics_port: Annotated[
        int, Field(ge=0, le=65535, description="Prometheus /metrics (kernel.metrics); 0 = off")
    ] = 0
    metrics_host: Annotated[
        str,
        Field(
            description="the address /metrics listens on: loopback unless an operator opens it (a "
            "container's own network: 0.0.0.0, deploy/docker-compose.yml); it has no auth"
        ),
    ] = "127.0.0.1"
    instance: Annotated[
        int,
        Field(
            ge=0,
            description="this process's number among its kind on one host (a systemd unit's %i): "
            "/metrics is served on metrics_port + instance, so several on one host do not collide",
        ),
    ] = 0
    log_level: str = "info"

    @model_validator(mode="after")
    def _port(self):
        if self.metrics_port + self.instance >= 65536:
            raise ValueError(
                f"metrics_port + instance must be a port (< 65536), got metrics_port={self.metrics_port}, "
                f"instance={self.instance}"
            )
        return self


@config_class
class SandboxSection:
    """The code sandbox the verifiers run in (envs/isolation.py, checked by Scorer.run at start)."""

    allow_weak_sandbox: Annotated[
        bool,
        Field(
            description="start even where the code sandbox lacks isolation layers (envs/isolation.py; "
            "never in production)"
        ),
    ] = False
    envs: Annotated[
        CsvList[str],
        Field(
            description="the environments this scorer verifies ([]: any; `asyncrl up` sets [trainer.tasks] "
            "envs): when none runs code (arithmetic) the sandbox check waits for the first rollout that does"
        ),
    ] = dataclasses.field(default_factory=list)
