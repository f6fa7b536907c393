"""The sections of TrainerConfig (`[trainer.<section>]` tables): one dataclass per piece of code
that owns those knobs, each checking its own values. Torch-free: `asyncrl config check` and
`asyncrl up` build them before any process starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from envs.swe_config import SweSection
from kernel.config import check_section
from policy.reward import PENALTIES

LAMBDA_SCHEDULES = ("fixed", "ramp", "budget")

HINTS = {
    "ppo_clip": "removed (must be 0): with one optimizer step per batch a clip is no trust region "
    "(against this step's own policy the ratio is 1; against the behaviour policy it only "
    "masks stale tokens): use is_mode = 'masked' for that (docs/trainer.md)",
    "penalty_cap": "in (0, 0.5): a penalty spread of 2 x cap under 1 never outweighs success",
    "ramp_versions": "schedule = 'ramp' needs ramp_versions >= 1 (and target)",
    "budget_tokens": "schedule = 'budget' needs budget_tokens > 0 (tokens per answer aimed at)",
    "delta_context": 'true, false or "auto" (on when [trainer.policy] init_checkpoint is set)',
    "background": 'true, false or "auto" (on when [trainer.policy] init_checkpoint is set)',
    "budget_lr": "schedule = 'budget' needs budget_lr > 0 (λ's step per version at 2x the budget)",
}


def check(section: str, obj, checks: dict[str, bool]) -> None:
    """ValueError naming every bad key of a section with its value (and a hint where one helps)."""
    check_section(f"trainer.{section}", obj, checks, HINTS)


@dataclass
class RunSection:
    """This process and its loop (trainer/__main__.py, trainer/leader.py)."""

    mode: str = "async"  # async | sync (publish one batch per version and wait for it)
    max_steps: int = 0  # 0 = forever
    seed: int = 0  # initial weights, task streams, evals
    dir: str = ""  # metrics appended to <dir>/metrics/trainer.jsonl
    # torch intra-op threads of this process (0: torch's default / OMP_NUM_THREADS); `asyncrl up`
    # sets it from its thread plan (asyncrl/thread_plan.py: the cores the workers leave)
    threads: int = 0
    grace_s: float = 30.0  # SIGTERM: gone within grace_s + kernel.lifetime.EXIT_MARGIN_S
    metrics_port: int = 0  # Prometheus /metrics (kernel.metrics); 0 = off
    # the address /metrics listens on: loopback unless an operator opens it (a container's own
    # network: 0.0.0.0, deploy/docker-compose.yml); it has no auth
    metrics_host: str = "127.0.0.1"
    dedupe_window: int = 200_000  # consumed rollout ids remembered (in the checkpoint)
    # sync: a task of the version's batch that yields no group at all (every rollout parked in DLQ,
    # or the task expired) would stall the barrier; after this long without a full batch the
    # missing tasks are published again (0 = [trainer.batch] group_timeout_s)
    sync_task_timeout_s: float = 0.0
    # stranded SCORED messages (max_deliver used up without a verdict, e.g. by repeated step-downs:
    # the server stops redelivering them) are parked in DLQ with a reason by the leader
    sweep_stranded: bool = True

    def __post_init__(self) -> None:
        check(
            "run",
            self,
            {
                "mode": self.mode in ("async", "sync"),
                "threads": self.threads >= 0,
                "sync_task_timeout_s": self.sync_task_timeout_s >= 0,
            },
        )


@dataclass
class PolicySection:
    """What is trained and where (trainer/factory.py build_model)."""

    # {"preset": tiny|small|base50m|base100m, **ModelConfig overrides}; vocab_size defaults to the
    # tokenizer's (workers decode with the same tokenizer)
    model: dict = field(default_factory=dict)
    tokenizer: str = "char"  # char (policy CharTokenizer) | path to a tokenizer.json
    init_checkpoint: str = ""  # optional HF checkpoint dir (policy.load_hf_checkpoint)
    device: str = "auto"  # auto (cuda if available) | cpu | cuda
    mixed_precision: str = "auto"  # auto (bf16 params on CUDA, fp32 on CPU) | bf16 | fp32
    activation_checkpointing: bool = False  # recompute block activations in backward

    def __post_init__(self) -> None:
        check("policy", self, {"mixed_precision": self.mixed_precision in ("auto", "bf16", "fp32")})


@dataclass
class OptimSection:
    """AdamW on fp32 master weights and its lr schedule (factory.build_optimizer, build_schedule)."""

    lr: float = 1e-4
    warmup_steps: int = 0  # linear warmup from lr/warmup to lr
    schedule: str = "constant"  # constant | cosine (after warmup)
    decay_steps: int = 0  # cosine: steps to the floor (0: max_steps - warmup, or none)
    min_ratio: float = 0.0  # cosine floor, fraction of lr
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # 0 = off

    def __post_init__(self) -> None:
        check(
            "optim",
            self,
            {
                "schedule": self.schedule in ("constant", "cosine"),
                "warmup_steps": self.warmup_steps >= 0,
                "decay_steps": self.decay_steps >= 0,
                "min_ratio": 0.0 <= self.min_ratio <= 1.0,
            },
        )


@dataclass
class LossConfig:
    """`[trainer.loss]`: the learner's loss and how it is computed (trainer/loss.py pg_loss takes it
    whole; trainer/learner.py the micro-batching and replay)."""

    # mean: r - mean_g (Dr. GRPO: lambda * cost keeps its scale) | std: (r - mean_g) / (std_g + eps)
    # (std cancels lambda in a group of uniform success: docs/trainer.md#advantage-and-loss)
    adv_norm: str = "mean"
    is_mode: str = "truncated"  # truncated | masked | none
    is_clip: float = 2.0  # C: truncated IS clamps at C; masked IS keeps ratios in [1/C, C]
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # KL penalty (k3 per token) to the frozen initial weights; 0 = off
    # removed: with one optimizer step per batch no clip can be a trust region (docs/trainer.md); must be 0
    ppo_clip: float = 0.0
    micro_batch: int = 32  # sequences per forward pass (at most)
    micro_batch_tokens: int = 16384  # padded tokens per forward (at most; a longer sequence runs alone)
    logit_chunk_mb: float = 64.0  # fp32 [tokens, vocab] logits projected at a time (chunked logprobs)
    replay: bool = True  # recompute logprobs with the workers' sampling masks + fp8 sites
    # a group's completions run packed behind one copy of their prompt (policy/packing.py): the
    # same logprobs and gradients, the prompt's forward and backward done once, not group_size times
    share_prompts: bool = True
    packed_row_tokens: int = 4096  # a packed row holds at most this many tokens (its attention is [L, L])
    # forward/backward at the bf16 rounding of the master (what workers sample from), the update
    # applied to the fp32 master (trainer/published_point.py); false: on the master itself
    published_point: bool = True
    # with published_point: the master starts a uniform random fraction of a bf16 step off each
    # weight on the bf16 grid, so the published bf16 moves from the first step (published_point.py)
    master_dither: bool = False

    def __post_init__(self) -> None:
        check(
            "loss",
            self,
            {
                "adv_norm": self.adv_norm in ("std", "mean"),
                "is_mode": self.is_mode in ("truncated", "masked", "none"),
                "is_clip": self.is_clip > 0,
                "kl_coef": self.kl_coef >= 0,
                "ppo_clip": self.ppo_clip == 0,
                "micro_batch": self.micro_batch >= 1,
                "micro_batch_tokens": self.micro_batch_tokens >= 0,
                "logit_chunk_mb": self.logit_chunk_mb > 0,
                "packed_row_tokens": self.packed_row_tokens >= 1,
            },
        )


@dataclass
class CostSection:
    """The cost penalty and who sets λ (policy/reward.py: the modes, λ steps; trainer/lambda_control.py)."""

    # how the cost penalty enters the advantage (docs/trainer.md#cost-penalty): linear (the scorer's
    # success - λ·cost) | success_only (only successful members pay λ·cost) | group_normalised
    # (cost z-scored in its group, clamped to ±1, scaled by min(λ·mean cost, penalty_cap))
    penalty: str = "linear"
    penalty_cap: float = 0.25  # group_normalised: |penalty| <= this (< 0.5: success stays first)
    # who sets λ (KV rl-control/lambda, stamped on each group at feed time): fixed (never written
    # here) | ramp (target · min(1, version / ramp_versions)) | budget (dual ascent per version:
    # λ <- max(0, λ + budget_lr · (tokens per answer / budget_tokens - 1)))
    schedule: str = "fixed"
    target: float = 0.0
    ramp_versions: int = 0
    budget_tokens: float = 0.0
    budget_lr: float = 0.0

    def __post_init__(self) -> None:
        budget = self.schedule == "budget"
        check(
            "cost",
            self,
            {
                "penalty": self.penalty in PENALTIES,
                "penalty_cap": 0 < self.penalty_cap < 0.5,
                "schedule": self.schedule in LAMBDA_SCHEDULES,
                "target": math.isfinite(self.target) and self.target >= 0,
                "ramp_versions": self.ramp_versions >= (1 if self.schedule == "ramp" else 0),
                "budget_tokens": math.isfinite(self.budget_tokens)
                and self.budget_tokens >= 0
                and (self.budget_tokens > 0 or not budget),
                "budget_lr": math.isfinite(self.budget_lr)
                and self.budget_lr >= 0
                and (self.budget_lr > 0 or not budget),
            },
        )


@dataclass
class BatchSection:
    """Which scored groups make a batch (trainer/batcher.py, trainer/lag_control.py)."""

    groups: int = 4  # groups (tasks) per optimizer step
    group_size: int = 4  # completions per task
    group_timeout_s: float = 120.0  # a group still incomplete after this is used as it is
    max_lag: int = 4  # samples with a token older than this many versions are stale
    stale: str = "drop"  # drop | downweight
    stale_weight: float = 0.5  # downweight: weight = stale_weight ** (lag - max_lag)
    # hold the sampler/learner mismatch (k3_mean) under this by lowering the lag allowed, one version
    # per step, between 1 and max_lag (trainer/lag_control.py); 0 = off (the lag cap is max_lag)
    max_k3: float = 0.0
    fetch_timeout_s: float = 1.0
    # skip groups whose rewards are all equal (DAPO's dynamic sampling): their advantages are 0, so
    # they add no gradient, only dilute the token mean and cost a step and a version; skipped
    # groups are acked at once and recorded with the next version (async mode only)
    skip_uniform: bool = False
    # what "uniform" compares: reward (exact rewards equal: A = 0 under any adv_norm) | success
    # (equal success, rewards differing by cost alone: the lambda * cost signal of such groups is
    # given up for fewer steps; with adv_norm = "std" that signal would be full-scale, see docs)
    skip_uniform_by: str = "reward"

    def __post_init__(self) -> None:
        check(
            "batch",
            self,
            {
                "groups": self.groups >= 1,
                "group_size": self.group_size >= 1,
                "max_lag": self.max_lag >= 0,
                "stale": self.stale in ("drop", "downweight"),
                "max_k3": self.max_k3 >= 0,
                "skip_uniform_by": self.skip_uniform_by in ("reward", "success"),
            },
        )


@dataclass
class TasksSection:
    """Which tasks, how they are asked and fed (trainer/feeding.py), and the held-out evals of them
    (trainer/evaluate.py, trainer/final_eval.py)."""

    envs: list[str] = field(default_factory=lambda: ["arith"])
    sampling: dict = field(default_factory=lambda: {"temperature": 1.0, "max_tokens": 32})
    chat_template: bool = False  # each prompt as the user turn of the tokenizer's chat template
    feed: bool = True  # publish tasks (off when an external feeder runs)
    backlog: int = 8  # async: groups kept queued (undelivered) in TASKS
    max_outstanding: int = 0  # async: generated groups not yet trained, at most (0: 3 x groups)
    eval_every: int = 0  # held-out eval of the published policy every N versions (0 = off)
    eval_prompts: int = 128
    # the `swe` env: its task set, episode limits, prompt and reward mode (envs/swe_config.py);
    # checked (the set read, both splits non-empty) when "swe" is among `envs`
    swe: SweSection = field(default_factory=SweSection)

    def __post_init__(self) -> None:
        if isinstance(self.swe, dict):
            self.swe = SweSection(**self.swe)
        if "swe" in self.envs:
            self.swe.check_task_set()


@dataclass
class PublishSection:
    """How each version reaches the workers (trainer/encoders.py, bus/weights/)."""

    keyframe_interval: int = 20  # a full keyframe every K versions
    # gathered: rank 0 gathers the bf16 state and publishes one delta per version; sharded: every
    # rank encodes the delta of the rows it owns, rank 0 stores the parts and signs one manifest
    # (bus/weights/manifest.py; docs/trainer.md). Keyframes are gathered either way.
    layout: str = "gathered"
    # code delta positions in the context of the base weights (format 4 CLASSED: smaller on real weights,
    # slower to encode and apply; docs/benchmarks.md#delta). "auto": on when the trainer starts from a
    # pretrained checkpoint (policy.init_checkpoint), off for a fresh model (TrainerConfig.use_delta_context)
    delta_context: bool | str = "auto"
    signing_key: str = ""  # ed25519 private key: hex, or a file with hex or PEM; "" = unsigned

    def __post_init__(self) -> None:
        check(
            "publish",
            self,
            {
                "keyframe_interval": self.keyframe_interval >= 1,
                "layout": self.layout in ("gathered", "sharded"),
                "delta_context": self.delta_context in (True, False, "auto"),
            },
        )


@dataclass
class CheckpointSection:
    """Where and how often the trainer's state is saved (trainer/checkpoint.py, trainer/leader.py)."""

    dir: str = "runs/trainer/ckpt"
    keep: int = 3
    # sharded (torchrun) runs: write the DCP shards in the background (torch.distributed.checkpoint.
    # async_save); the checkpoint file naming them is written only once they are complete
    async_save: bool = False
    # checkpoint every K versions instead of every version: the versions between are published at
    # once, but their batches are acked only after the next checkpoint (which records their ids) is
    # durable, so a crash re-trains at most K - 1 versions and loses or double-trains nothing; the
    # new leader publishes its resumed version under its new epoch (followers take it). The last
    # version before a clean stop is always checkpointed. 1 = every version (the default)
    every: int = 1
    # write the checkpoint file in one background thread: the step's state is copied to CPU, the
    # version is published at once and its batch acked only once its file is durable; a version due
    # while the previous write still runs is published uncheckpointed (the `every` path) and recorded
    # by the next write. "auto": on when the trainer starts from a pretrained checkpoint
    # (policy.init_checkpoint: GB-sized state), off for a fresh model. TrainerConfig.checkpoint_in_background
    background: bool | str = "auto"

    def __post_init__(self) -> None:
        check(
            "checkpoint",
            self,
            {"every": self.every >= 1, "background": self.background in (True, False, "auto")},
        )


@dataclass
class WarmstartSection:
    """Supervised steps on env demonstrations before RL (trainer/warmstart.py)."""

    steps: int = 0
    lr: float = 1e-3
    # demonstration style passed to the env (arith: default = direct|steps|padded, mixed = direct|steps,
    # or one of them)
    style: str = "default"
    batch: int = 16
    # torch intra-op threads while warm-starting (0: [trainer.run] threads; workers and scorers idle
    # until v0, so it may take more)
    threads: int = 0
    # stop the warm start on a measured success instead of a step count (0 = off: `steps` steps).
    # On: every check_every steps from check_from, play check_n TRAIN-split tasks at the tasks'
    # sampling (the eval split stays unseen: choosing the stop point on it would leak the
    # held-out metric) and stop once success >= until; `steps` is then the cap. Aim: RL starts
    # where a group's outcomes are mixed.
    until: float = 0.0
    check_every: int = 10
    check_from: int = 0  # first step (1-based count of steps done) that may be checked
    check_n: int = 16
    # the warmstart.pt of an earlier run (same model config): loaded instead of running a warm start
    # (RL experiments from one fixed starting policy; the warm start steps above are then not run)
    reuse: str = ""

    def __post_init__(self) -> None:
        check(
            "warmstart",
            self,
            {
                "steps": self.steps >= 0,
                "batch": self.batch >= 1,
                "threads": self.threads >= 0,
                "until": 0.0 <= self.until <= 1.0 and (self.until == 0 or self.steps > 0),  # steps: the cap
                "check_every": self.check_every >= 1,
                "check_from": self.check_from >= 0,
                "check_n": self.check_n >= 1,
                "reuse": not self.reuse or Path(self.reuse).is_file(),
            },
        )


@dataclass
class LeaseSection:
    """The leader lease (trainer/lease.py)."""

    ttl_s: float = 15.0
    renew_s: float = 0.0  # 0 = ttl / 3

    def __post_init__(self) -> None:
        check("lease", self, {"ttl_s": self.ttl_s > 0})

    @property
    def renew_every_s(self) -> float:
        return self.renew_s or self.ttl_s / 3


@dataclass
class ElasticSection:
    """`python -m trainer --elastic` (trainer/elastic.py): torchrun's elastic agent, one agent per
    node; agents beyond the MAX of nnodes wait as spares and join when a node fails."""

    nnodes: str = "2:2"  # MIN:MAX agents (nodes), or N
    nproc_per_node: int = 1  # ranks per agent (one per GPU)
    rdzv_endpoint: str = "127.0.0.1:29400"  # host:port of the c10d rendezvous store
    rdzv_id: str = "asyncrl-trainer"  # the same on every agent of one group
    max_restarts: int = 3  # worker-group restarts (re-rendezvous) before an agent gives up
    rdzv_host: bool = False  # this node hosts the store (one node: not swappable)
    rdzv_conf: str = ""  # more torchrun --rdzv_conf: "join_timeout=120,keep_alive_interval=1"

    def __post_init__(self) -> None:
        check(
            "elastic",
            self,
            {
                "nnodes": _nnodes_ok(self.nnodes),
                "nproc_per_node": self.nproc_per_node >= 1,
                "max_restarts": self.max_restarts >= 0,
                "rdzv_endpoint": ":" in self.rdzv_endpoint,
            },
        )


@dataclass
class FaultsSection:
    """Fault injection for bench.chaos and tests only: all off in production (not in the docs' tables)."""

    stop_before_publish: int = 0  # SIGSTOP itself after the lease CAS, just before writing version N
    probe_when_deposed: bool = False  # once deposed, try one more publication skipping its own checks
    # hold each trained batch this long between its step and its checkpoint, i.e. a step +
    # publication slower than ack_wait (tests/test_trainer_slow_step.py). 0 = off.
    step_delay_s: float = 0.0
    # background checkpoints: the writer sleeps this long before each write, so that versions go out
    # ahead of their checkpoint (tests/test_trainer_background_checkpoint.py). 0 = off.
    checkpoint_delay_s: float = 0.0

    def __post_init__(self) -> None:
        check(
            "faults",
            self,
            {"step_delay_s": self.step_delay_s >= 0, "checkpoint_delay_s": self.checkpoint_delay_s >= 0},
        )


def _nnodes_ok(v: str) -> bool:
    """torchrun's --nnodes: N or MIN:MAX with 1 <= MIN <= MAX."""
    parts = str(v).split(":")
    if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
        return False
    lo, hi = int(parts[0]), int(parts[-1])
    return 1 <= lo <= hi
