"""TrainerConfig: every knob of the learner process, read from TOML then ASYNCRL_* env.

Knobs live in sections (`[trainer.optim]`, `[trainer.loss]`, ... : trainer/sections.py), each
handed whole to the code that owns it; only the bus and the trainer's id sit at the top. A key of
the old flat layout is refused with its new place (MOVED; bus.config). Env overrides nest with
"__": ASYNCRL_OPTIM__LR=3e-4, ASYNCRL_PUBLISH__SIGNING_KEY=/etc/asyncrl/keys/trainer-signing.key.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import ClassVar

from bus import BusConfig
from kernel.config import build_sections, moved_map, same_keys

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

# the flat layout's keys by their new section: {section: {old key: new key}}
_MOVES = {
    "run": {
        **same_keys(
            "mode",
            "max_steps",
            "seed",
            "threads",
            "grace_s",
            "metrics_port",
            "dedupe_window",
            "sync_task_timeout_s",
            "sweep_stranded",
        ),
        "run_dir": "dir",
    },
    "policy": same_keys(
        "model", "tokenizer", "init_checkpoint", "device", "mixed_precision", "activation_checkpointing"
    ),
    "optim": {
        **same_keys("lr", "betas", "weight_decay", "grad_clip"),
        "lr_warmup_steps": "warmup_steps",
        "lr_schedule": "schedule",
        "lr_decay_steps": "decay_steps",
        "lr_min_ratio": "min_ratio",
    },
    "loss": same_keys(
        "adv_norm",
        "is_mode",
        "is_clip",
        "entropy_coef",
        "kl_coef",
        "ppo_clip",
        "micro_batch",
        "micro_batch_tokens",
        "logit_chunk_mb",
        "replay",
        "share_prompts",
        "packed_row_tokens",
        "published_point",
        "master_dither",
    ),
    "cost": {
        **same_keys("penalty", "penalty_cap", "budget_tokens", "budget_lr"),
        "lambda_schedule": "schedule",
        "lambda_target": "target",
        "lambda_ramp_versions": "ramp_versions",
    },
    "batch": {
        **same_keys(
            "group_size",
            "group_timeout_s",
            "max_lag",
            "stale",
            "stale_weight",
            "max_k3",
            "fetch_timeout_s",
            "skip_uniform_by",
        ),
        "batch_groups": "groups",
        "skip_uniform_groups": "skip_uniform",
    },
    "tasks": {
        **same_keys("envs", "chat_template", "feed", "eval_every", "eval_prompts"),
        "task_sampling": "sampling",
        "feed_backlog": "backlog",
        "feed_max_outstanding": "max_outstanding",
    },
    "publish": {**same_keys("keyframe_interval", "delta_context", "signing_key"), "publish": "layout"},
    "checkpoint": {
        "checkpoint_dir": "dir",
        "keep_checkpoints": "keep",
        "async_checkpoint": "async_save",
        "checkpoint_every": "every",
    },
    "warmstart": {
        **{
            f"warmstart_{k}": k
            for k in (
                "steps",
                "lr",
                "style",
                "batch",
                "threads",
                "until",
                "check_every",
                "check_from",
                "check_n",
            )
        },
        "warmstart_from": "reuse",
    },
    "lease": {"lease_ttl_s": "ttl_s", "lease_renew_s": "renew_s"},
    "elastic": {
        f"elastic_{k}": k
        for k in (
            "nnodes",
            "nproc_per_node",
            "rdzv_endpoint",
            "rdzv_id",
            "max_restarts",
            "rdzv_host",
            "rdzv_conf",
        )
    },
    "faults": {
        **same_keys("stop_before_publish", "probe_when_deposed"),
        "debug_step_delay_s": "step_delay_s",
    },
}


@dataclass
class TrainerConfig:
    bus: BusConfig = field(default_factory=BusConfig)
    trainer_id: str = ""  # default: <host>-<pid>; the lease holder's name
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

    # old flat key -> "section.key" (bus.config refuses the old one with its new place)
    MOVED: ClassVar[dict[str, str]] = moved_map(_MOVES)

    def __post_init__(self) -> None:
        build_sections(self, "trainer")
        if not self.trainer_id:
            self.trainer_id = f"{socket.gethostname()}-{os.getpid()}"
        # what no single section can see
        checks = {
            # char has no template
            "tasks.chat_template": not self.tasks.chat_template or self.policy.tokenizer != "char",
            # sync publishes exactly batch.groups tasks per version: a skipped group would stall it
            "batch.skip_uniform": not (self.batch.skip_uniform and self.run.mode == "sync"),
        }
        hints_ = {
            "batch.skip_uniform": "skip_uniform is async only ([trainer.run] mode = 'sync')",
            "tasks.chat_template": "the char tokenizer has no chat template",
        }
        bad = [k.split(".") for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                "TrainerConfig: invalid value for "
                + ", ".join(
                    f"[trainer.{sect}] {key}={getattr(getattr(self, sect), key)!r} "
                    f"({hints_[f'{sect}.{key}']})"
                    for sect, key in bad
                )
            )

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
