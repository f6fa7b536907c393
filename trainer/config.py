"""TrainerConfig: every knob of the learner process, read from TOML then ASYNCRL_* env.

Knobs live in sections (`[trainer.optim]`, `[trainer.loss]`, ... : trainer/sections.py), each
handed whole to the code that owns it; only the bus and the trainer's id sit at the top. A key of
the old flat layout is simply unknown (the error names the nearest key). Env overrides nest with
"__": ASYNCRL_OPTIM__LR=3e-4, ASYNCRL_PUBLISH__SIGNING_KEY=/etc/asyncrl/keys/trainer-signing.key.
"""

from __future__ import annotations

import os
import socket
from dataclasses import field
from typing import Annotated, ClassVar

from pydantic import Field, model_validator

from bus import BusConfig
from kernel.config import config_class

from .sections import (  # noqa: F401  (PENALTIES, LAMBDA_SCHEDULES: re-exported)
    LAMBDA_SCHEDULES,
    PENALTIES,
    BatchSection,
    CheckpointSection,
    CostSection,
    ElasticSection,
    FaultsSection,
    LeaseSection,
    LossConfig,
    OptimSection,
    PolicySection,
    PublishSection,
    RunSection,
    TasksSection,
    WarmstartSection,
)


@config_class
class TrainerConfig:
    TABLE: ClassVar[str] = "trainer"  # in the errors of a direct construction

    bus: BusConfig = field(default_factory=BusConfig)
    trainer_id: Annotated[str, Field(description="default: <host>-<pid>; the lease holder's name")] = ""
    run: RunSection = field(default_factory=RunSection)
    policy: PolicySection = field(default_factory=PolicySection)
    optim: OptimSection = field(default_factory=OptimSection)
    loss: LossConfig = field(default_factory=LossConfig)
    cost: CostSection = field(default_factory=CostSection)
    batch: BatchSection = field(default_factory=BatchSection)
    tasks: TasksSection = field(default_factory=TasksSection)
    publish: PublishSection = field(default_factory=PublishSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    warmstart: WarmstartSection = field(default_factory=WarmstartSection)
    lease: LeaseSection = field(default_factory=LeaseSection)
    elastic: ElasticSection = field(default_factory=ElasticSection)
    faults: FaultsSection = field(default_factory=FaultsSection)

    def __post_init__(self) -> None:
        if not self.trainer_id:
            self.trainer_id = f"{socket.gethostname()}-{os.getpid()}"

    @model_validator(mode="after")
    def _sections_agree(self):
        """What no single section can see."""
        bad = []
        if self.tasks.chat_template and self.policy.tokenizer == "char":
            bad.append("[trainer.tasks] chat_template = true: the char tokenizer has no chat template")
        # sync publishes exactly batch.groups tasks per version: a skipped group would stall it
        if self.batch.skip_uniform and self.run.mode == "sync":
            bad.append("[trainer.batch] skip_uniform = true is async only ([trainer.run] mode = 'sync')")
        if bad:
            raise ValueError("; ".join(bad))
        return self

    def configure_envs(self) -> None:
        """Point the configurable environments of this process at this config's tables (the `swe`
        env at [trainer.tasks.swe]) before anything samples a task."""
        if "swe" in self.tasks.envs:
            from envs.swe_env import configure

            configure(self.tasks.swe)

    @property
    def use_delta_context(self) -> bool:
        """publish.delta_context resolved: "auto" codes by context exactly when the weights are
        pretrained (real weights: ~25 % smaller deltas for an encode that is a small fraction of the
        step; a fresh toy model's encode is a larger share of its tiny step and its deltas gain less)."""
        if self.publish.delta_context == "auto":
            return bool(self.policy.init_checkpoint)
        return bool(self.publish.delta_context)

    @property
    def checkpoint_in_background(self) -> bool:
        """checkpoint.background resolved: "auto" writes in the background exactly when the weights
        are pretrained (a real model's state is GBs: its write would dominate the version)."""
        if self.checkpoint.background == "auto":
            return bool(self.policy.init_checkpoint)
        return bool(self.checkpoint.background)
