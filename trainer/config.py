"""TrainerConfig: every knob of the learner process, read from TOML then ASYNCRL_* env."""
from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from bus import BusConfig

PENALTIES = ("linear", "success_only", "group_normalised")
LAMBDA_SCHEDULES = ("fixed", "ramp", "budget")

HINTS = {"ppo_clip": "removed (must be 0): with one optimizer step per batch a clip is no trust region "
                    "(against this step's own policy the ratio is 1; against the behaviour policy it only "
                    "masks stale tokens): use is_mode = 'masked' for that (docs/trainer.md)",
         "penalty_cap": "in (0, 0.5): a penalty spread of 2 x cap under 1 never outweighs success",
         "lambda_ramp_versions": "lambda_schedule = 'ramp' needs lambda_ramp_versions >= 1 "
                                 "(and lambda_target)",
         "budget_tokens": "lambda_schedule = 'budget' needs budget_tokens > 0 (tokens per answer aimed at)",
         "delta_context": 'true, false or "auto" (on when init_checkpoint is set)',
         "budget_lr": "lambda_schedule = 'budget' needs budget_lr > 0 "
                      "(λ's step per version at 2x the budget)"}


@dataclass
class TrainerConfig:
    bus: BusConfig = field(default_factory=BusConfig)
    trainer_id: str = ""                 # default: <host>-<pid>
    envs: list[str] = field(default_factory=lambda: ["arith"])
    # model: {"preset": tiny|small|base50m|base100m, **ModelConfig overrides}; vocab_size defaults
    # to the tokenizer's (workers decode with the same tokenizer)
    model: dict = field(default_factory=dict)
    tokenizer: str = "char"              # char (policy CharTokenizer) | path to a tokenizer.json
    init_checkpoint: str = ""            # optional HF checkpoint dir (policy.load_hf_checkpoint)
    seed: int = 0
    device: str = "auto"                 # auto (cuda if available) | cpu | cuda
    # optimizer (fp32 master weights, AdamW)
    lr: float = 1e-4
    lr_warmup_steps: int = 0             # linear warmup from lr/warmup to lr
    lr_schedule: str = "constant"        # constant | cosine (after warmup)
    lr_decay_steps: int = 0              # cosine: steps to the floor (0 = max_steps - warmup; 0 there = no decay)
    lr_min_ratio: float = 0.0            # cosine floor, fraction of lr
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    grad_clip: float = 1.0               # 0 = off
    # batching
    batch_groups: int = 4                # groups (tasks) per optimizer step
    group_size: int = 4                  # completions per task
    group_timeout_s: float = 120.0       # a group still incomplete after this is used as it is
    max_lag: int = 4                     # samples with a token older than this many versions are stale
    stale: str = "drop"                  # drop | downweight
    stale_weight: float = 0.5            # downweight: weight = stale_weight ** (lag - max_lag)
    # hold the sampler/learner mismatch (k3_mean) under this by lowering the lag allowed, one version
    # per step, between 1 and max_lag (trainer/lag_control.py); 0 = off (the lag cap is max_lag)
    max_k3: float = 0.0
    dedupe_window: int = 200_000         # consumed rollout ids remembered (in the checkpoint)
    fetch_timeout_s: float = 1.0
    # skip groups whose rewards are all equal (DAPO's dynamic sampling): their advantages are 0, so
    # they add no gradient, only dilute the token mean and cost a step and a version; skipped
    # groups are acked at once and recorded with the next version (async mode only)
    skip_uniform_groups: bool = False
    # what "uniform" compares: reward (exact rewards equal: A = 0 under any adv_norm) | success
    # (equal success, rewards differing by cost alone: the lambda * cost signal of such groups is
    # given up for fewer steps; with adv_norm = "std" that signal would be full-scale, see docs)
    skip_uniform_by: str = "reward"
    # loss
    # mean: r - mean_g (Dr. GRPO: lambda * cost keeps its scale) | std: (r - mean_g) / (std_g + eps)
    # (std cancels lambda in a group of uniform success: docs/trainer.md#advantage-and-loss)
    adv_norm: str = "mean"
    # how the cost penalty enters the advantage (trainer/penalty.py, docs/trainer.md#cost-penalty):
    # linear (the scorer's success - λ·cost) | success_only (only successful members pay λ·cost) |
    # group_normalised (cost z-scored in its group, clamped to ±1, scaled by min(λ·mean cost, penalty_cap))
    penalty: str = "linear"
    penalty_cap: float = 0.25            # group_normalised: |penalty| <= this (< 0.5: success stays first)
    # who sets λ (KV rl-control/lambda, stamped on each group at feed time; trainer/lambda_control.py):
    # fixed (never written here) | ramp (lambda_target · min(1, version / lambda_ramp_versions)) |
    # budget (dual ascent per version: λ <- max(0, λ + budget_lr · (tokens per answer / budget_tokens - 1)))
    lambda_schedule: str = "fixed"
    lambda_target: float = 0.0
    lambda_ramp_versions: int = 0
    budget_tokens: float = 0.0
    budget_lr: float = 0.0
    is_mode: str = "truncated"           # truncated | masked | none
    is_clip: float = 2.0                 # C: truncated IS clamps at C; masked IS keeps ratios in [1/C, C]
    micro_batch: int = 32                # sequences per forward pass (at most)
    micro_batch_tokens: int = 16384      # padded tokens per forward pass (at most; a longer sequence runs alone)
    logit_chunk_mb: float = 64.0         # fp32 [tokens, vocab] logits projected at a time (chunked logprobs)
    # removed: with one optimizer step per batch no clip can be a trust region (docs/trainer.md); must be 0
    ppo_clip: float = 0.0
    entropy_coef: float = 0.0
    kl_coef: float = 0.0                 # KL penalty (k3 per token) to the frozen initial weights; 0 = off
    # distributed (torchrun: FSDP2 over all ranks)
    activation_checkpointing: bool = False   # recompute block activations in backward
    mixed_precision: str = "auto"        # auto (bf16 params on CUDA, fp32 on CPU) | bf16 | fp32
    replay: bool = True                  # recompute logprobs with the workers' sampling masks + fp8 sites
    # forward/backward at the bf16 rounding of the master (what workers sample from), the update
    # applied to the fp32 master (trainer/published_point.py); false: on the master itself
    published_point: bool = True
    # publication
    keyframe_interval: int = 20          # a full keyframe every K versions
    # gathered: rank 0 gathers the bf16 state and publishes one delta per version; sharded: every
    # rank encodes the delta of the rows it owns, rank 0 stores the parts and signs one manifest
    # (bus/weight_manifest.py; docs/trainer.md). Keyframes are gathered either way.
    publish: str = "gathered"
    # code delta positions in the context of the base weights (format 4 CLASSED: smaller on real weights,
    # slower to encode and apply; docs/benchmarks.md#delta). "auto": on when the trainer starts from a
    # pretrained checkpoint (init_checkpoint), off for a freshly initialised model (see use_delta_context)
    delta_context: bool | str = "auto"
    signing_key: str = ""                # ed25519 private key: hex, or a file with hex or PEM; "" = unsigned
    # fault injection (bench.chaos, tests; off in production)
    stop_before_publish: int = 0         # SIGSTOP itself after the lease CAS, just before writing version N
    probe_when_deposed: bool = False     # once deposed, try one more publication skipping its own checks
    # checkpoints / outputs
    checkpoint_dir: str = "runs/trainer/ckpt"
    keep_checkpoints: int = 3
    # sharded (torchrun) runs: write the DCP shards in the background (torch.distributed.checkpoint.
    # async_save); the checkpoint file naming them is written only once they are complete
    async_checkpoint: bool = False
    # checkpoint every K versions instead of every version: the versions between are published at
    # once, but their batches are acked only after the next checkpoint (which records their ids) is
    # durable, so a crash re-trains at most K - 1 versions and loses or double-trains nothing; the
    # new leader publishes its resumed version under its new epoch (followers take it). The last
    # version before a clean stop is always checkpointed. 1 = every version (the default)
    checkpoint_every: int = 1
    run_dir: str = ""                    # metrics appended to <run_dir>/metrics/trainer.jsonl
    metrics_port: int = 0                # Prometheus /metrics (bus.metrics); 0 = off
    # elastic launch (`python -m trainer --elastic`, trainer/elastic.py): torchrun's elastic agent,
    # one agent per node; agents beyond the MAX of nnodes wait as spares and join when a node fails
    elastic_nnodes: str = "2:2"          # MIN:MAX agents (nodes), or N
    elastic_nproc_per_node: int = 1      # ranks per agent (one per GPU)
    elastic_rdzv_endpoint: str = "127.0.0.1:29400"   # host:port of the c10d rendezvous store (first agent there hosts it)
    elastic_rdzv_id: str = "asyncrl-trainer"         # the same on every agent of one group
    elastic_max_restarts: int = 3        # worker-group restarts (re-rendezvous) before an agent gives up
    elastic_rdzv_host: bool = False      # this node hosts the rendezvous store (exactly one node: it cannot be swapped)
    elastic_rdzv_conf: str = ""          # more torchrun --rdzv_conf, e.g. "join_timeout=120,keep_alive_interval=1"
    # leader lease
    lease_ttl_s: float = 15.0
    lease_renew_s: float = 0.0           # 0 = ttl / 3
    # loop
    mode: str = "async"                  # async | sync (publish one batch per version and wait for it)
    feed_backlog: int = 8                # async: groups kept queued (undelivered) in TASKS
    feed_max_outstanding: int = 0        # async: cap on generated groups not yet trained (0 = 3 x batch_groups)
    feed: bool = True                    # publish tasks (off when an external feeder runs)
    task_sampling: dict = field(default_factory=lambda: {"temperature": 1.0, "max_tokens": 32})
    chat_template: bool = False          # send each task's prompt as the user turn of the tokenizer's chat template
    max_steps: int = 0                   # 0 = forever
    grace_s: float = 30.0                # SIGTERM: the process is gone within grace_s + bus.lifetime.EXIT_MARGIN_S
    # sync: a task of the version's batch that yields no group at all (every rollout parked in DLQ,
    # or the task expired) would stall the barrier; after this long without a full batch the
    # missing tasks are published again (0 = group_timeout_s)
    sync_task_timeout_s: float = 0.0
    # stranded SCORED messages (max_deliver used up without a verdict, e.g. by repeated step-downs:
    # the server stops redelivering them) are parked in DLQ with a reason by the leader
    sweep_stranded: bool = True
    eval_every: int = 0                  # held-out eval of the published policy every N versions (0 = off)
    eval_prompts: int = 128
    warmstart_steps: int = 0             # supervised steps on env demonstrations before RL
    warmstart_lr: float = 1e-3
    warmstart_style: str = "default"     # demonstration style passed to the env (arith: default = direct|steps|padded, mixed = direct|steps, or one)
    warmstart_batch: int = 16
    # torch intra-op threads of this process (0: torch's default / OMP_NUM_THREADS); `asyncrl up`
    # sets it from its thread plan (asyncrl/thread_plan.py: the cores the workers leave)
    threads: int = 0
    warmstart_threads: int = 0           # torch intra-op threads while warm-starting (0: `threads`;
                                         # workers and scorers idle until v0, so it may take more)
    # stop the warm start on a measured success instead of a step count (0 = off: warmstart_steps
    # steps). On: every warmstart_check_every steps from warmstart_check_from, play
    # warmstart_check_n TRAIN-split tasks at task_sampling (the eval split stays unseen: choosing
    # the stop point on it would leak the held-out metric) and stop once success >= warmstart_until;
    # warmstart_steps is then the cap. Aim: RL starts where a group's outcomes are mixed.
    warmstart_until: float = 0.0
    warmstart_check_every: int = 10
    warmstart_check_from: int = 0        # first step (1-based count of steps done) that may be checked
    warmstart_check_n: int = 16
    # the warmstart.pt of an earlier run (same model config): loaded instead of running a warm start
    # (RL experiments from one fixed starting policy; the warm start steps above are then not run)
    warmstart_from: str = ""
    # TESTS ONLY (chaos harness, tests/test_trainer_slow_step.py): hold each trained batch this long
    # between its step and its checkpoint, i.e. a step + publication slower than ack_wait. 0 = off.
    debug_step_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.trainer_id:
            self.trainer_id = f"{socket.gethostname()}-{os.getpid()}"
        checks = {
            "stale": self.stale in ("drop", "downweight"),
            "is_mode": self.is_mode in ("truncated", "masked", "none"),
            "adv_norm": self.adv_norm in ("std", "mean"),
            "skip_uniform_by": self.skip_uniform_by in ("reward", "success"),
            "penalty": self.penalty in PENALTIES,
            "penalty_cap": 0 < self.penalty_cap < 0.5,
            "lambda_schedule": self.lambda_schedule in LAMBDA_SCHEDULES,
            "lambda_target": math.isfinite(self.lambda_target) and self.lambda_target >= 0,
            "lambda_ramp_versions": self.lambda_ramp_versions >= (1 if self.lambda_schedule == "ramp" else 0),
            "budget_tokens": math.isfinite(self.budget_tokens) and self.budget_tokens >= 0
                             and (self.budget_tokens > 0 or self.lambda_schedule != "budget"),
            "budget_lr": math.isfinite(self.budget_lr) and self.budget_lr >= 0
                         and (self.budget_lr > 0 or self.lambda_schedule != "budget"),
            "ppo_clip": self.ppo_clip == 0,
            "micro_batch": self.micro_batch >= 1,
            "micro_batch_tokens": self.micro_batch_tokens >= 0,
            "logit_chunk_mb": self.logit_chunk_mb > 0,
            "mode": self.mode in ("async", "sync"),
            # sync publishes exactly batch_groups tasks per version: a skipped group would stall it
            "skip_uniform_groups": not (self.skip_uniform_groups and self.mode == "sync"),
            "batch_groups": self.batch_groups >= 1,
            "group_size": self.group_size >= 1,
            "max_lag": self.max_lag >= 0,
            "max_k3": self.max_k3 >= 0,
            "is_clip": self.is_clip > 0,
            "keyframe_interval": self.keyframe_interval >= 1,
            "lease_ttl_s": self.lease_ttl_s > 0,
            "sync_task_timeout_s": self.sync_task_timeout_s >= 0,
            "debug_step_delay_s": self.debug_step_delay_s >= 0,
            "checkpoint_every": self.checkpoint_every >= 1,
            "lr_schedule": self.lr_schedule in ("constant", "cosine"),
            "lr_warmup_steps": self.lr_warmup_steps >= 0,
            "lr_decay_steps": self.lr_decay_steps >= 0,
            "lr_min_ratio": 0.0 <= self.lr_min_ratio <= 1.0,
            "kl_coef": self.kl_coef >= 0,
            "mixed_precision": self.mixed_precision in ("auto", "bf16", "fp32"),
            "chat_template": not self.chat_template or self.tokenizer != "char",   # char has no template
            "publish": self.publish in ("gathered", "sharded"),
            "delta_context": self.delta_context in (True, False, "auto"),
            "elastic_nnodes": _nnodes_ok(self.elastic_nnodes),
            "elastic_nproc_per_node": self.elastic_nproc_per_node >= 1,
            "elastic_max_restarts": self.elastic_max_restarts >= 0,
            "elastic_rdzv_endpoint": ":" in self.elastic_rdzv_endpoint,
            "warmstart_steps": self.warmstart_steps >= 0,
            "warmstart_batch": self.warmstart_batch >= 1,
            "threads": self.threads >= 0,
            "warmstart_threads": self.warmstart_threads >= 0,
            "warmstart_until": 0.0 <= self.warmstart_until <= 1.0
                               and (self.warmstart_until == 0 or self.warmstart_steps > 0),   # the cap
            "warmstart_check_every": self.warmstart_check_every >= 1,
            "warmstart_check_from": self.warmstart_check_from >= 0,
            "warmstart_check_n": self.warmstart_check_n >= 1,
            "warmstart_from": not self.warmstart_from or Path(self.warmstart_from).is_file(),
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            hint = "".join(f"; {k}: {HINTS[k]}" for k in bad if k in HINTS)
            raise ValueError(f"TrainerConfig: invalid value for {', '.join(bad)}: "
                             + ", ".join(f"{k}={getattr(self, k)!r}" for k in bad) + hint)

    @property
    def use_delta_context(self) -> bool:
        """delta_context resolved: "auto" codes by context exactly when the weights are pretrained
        (real weights: ~25 % smaller deltas for an encode that is a small fraction of the step; a
        fresh toy model's encode is a larger share of its tiny step and its deltas gain less)."""
        if self.delta_context == "auto":
            return bool(self.init_checkpoint)
        return bool(self.delta_context)

    @property
    def renew_s(self) -> float:
        return self.lease_renew_s or self.lease_ttl_s / 3


def _nnodes_ok(v: str) -> bool:
    """torchrun's --nnodes: N or MIN:MAX with 1 <= MIN <= MAX."""
    parts = str(v).split(":")
    if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
        return False
    lo, hi = int(parts[0]), int(parts[-1])
    return 1 <= lo <= hi
