"""The [up] table of a run config: what `asyncrl up` itself runs (children, limits, telemetry)."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated

from pydantic import Field, Strict, StrictBool, StrictFloat, StrictInt, StrictStr

from kernel.config import ConfigError, build, config_class


# strict types: [up] is only ever a TOML table (no env strings to parse), so `steps = "30"` is a mistake;
# `lambda` (a Python keyword) is the field lambda_
@config_class(config_extra={"validate_by_name": True, "validate_by_alias": True})
class UpConfig:
    """The [up] table of a run config (CLI flags override it), checked before anything starts."""

    steps: Annotated[StrictInt, Field(ge=1)] = 30
    minutes: Annotated[StrictFloat, Field(gt=0)] = 9.0
    workers: Annotated[StrictInt, Field(ge=1)] = 2
    scorers: Annotated[StrictInt, Field(ge=1)] = 1
    trainers: Annotated[
        StrictInt, Field(ge=1, description="> 1: standbys that take over the lease when the leader dies")
    ] = 1
    sync: StrictBool = False
    worker_nice: StrictInt = 10
    grace_s: Annotated[
        StrictFloat, Field(ge=0, description="every child's drain time (unless its own section sets grace_s)")
    ] = 10.0
    max_restarts: Annotated[
        StrictInt, Field(ge=0, description="per child; an unexpected exit past this stays dead")
    ] = 5
    restart_backoff_s: Annotated[
        StrictFloat, Field(gt=0, description="first restart delay, doubling per restart (max 30 s)")
    ] = 1.0
    lambda_: Annotated[StrictFloat | None, Field(ge=0, alias="lambda", description="the run's fixed λ")] = (
        None
    )
    final_eval: Annotated[
        StrictBool,
        Field(
            description="after the run: the trainer's held-out eval of the last checkpoint (a `python -m "
            "trainer --eval-final` child), so the final policy is measured without spending the run's "
            "time on it"
        ),
    ] = False
    weights_keep: Annotated[
        StrictInt,
        Field(
            ge=1,
            description="versions the WEIGHTS stream keeps per subject (deltas, keyframes): `asyncrl export` "
            "rebuilds a version of a stopped run from its store only while the deltas from a keyframe up "
            "to it are held",
        ),
    ] = 64
    metrics_port: Annotated[
        StrictInt,
        Field(
            ge=0,
            le=65535,
            description="> 0: the trainer serves /metrics here, scorers and workers on the next ports",
        ),
    ] = 0
    wandb_project: Annotated[
        StrictStr, Field(description="set: log the run to Weights & Biases (asyncrl/tracking.py)")
    ] = ""
    wandb_entity: StrictStr = ""
    wandb_name: StrictStr = ""
    wandb_mode: Annotated[
        StrictStr, Field(description='online | offline | disabled ("" = wandb\'s default / WANDB_MODE)')
    ] = ""
    wandb_tags: Annotated[list, Strict()] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> UpConfig:
        """The [up] table checked: ConfigError naming the key and the value."""
        if "lambda_" in d:
            raise ConfigError("[up] unknown key 'lambda_'; did you mean 'lambda'?")
        return build(cls, d, table="up")
