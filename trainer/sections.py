"""The sections of TrainerConfig (`[trainer.<section>]` tables): one config class per piece of code
that owns those knobs, each field's bounds and description on it (kernel.config names the table
and key in every error). Torch-free: `asyncrl config check` and `asyncrl up` build them before any
process starts."""

from __future__ import annotations

from dataclasses import field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from envs.swe_config import SweSection
from kernel.config import CsvList, config_class
from policy.reward import PENALTIES

LAMBDA_SCHEDULES = ("fixed", "ramp", "budget")
AUTO = 'true, false or "auto" (on when [trainer.policy] init_checkpoint is set)'


@config_class
class RunSection:
    """This process and its loop (trainer/__main__.py, trainer/leader.py)."""

    mode: Annotated[
        Literal["async", "sync"], Field(description="sync: publish one batch per version and wait for it")
    ] = "async"
    max_steps: Annotated[int, Field(description="0 = forever")] = 0
    seed: Annotated[int, Field(description="initial weights, task streams, evals")] = 0
    dir: Annotated[str, Field(description="metrics appended to <dir>/metrics/trainer.jsonl")] = ""
    threads: Annotated[
        int,
        Field(
            ge=0,
            description="torch intra-op threads of this process (0: torch's default / OMP_NUM_THREADS); "
            "`asyncrl up` sets it from its thread plan (asyncrl/thread_plan.py: the cores the workers leave)",
        ),
    ] = 0
    grace_s: Annotated[
        float, Field(description="SIGTERM: gone within grace_s + kernel.lifetime.EXIT_MARGIN_S")
    ] = 30.0
    metrics_port: Annotated[int, Field(description="Prometheus /metrics (kernel.metrics); 0 = off")] = 0
    metrics_host: Annotated[
        str,
        Field(
            description="the address /metrics listens on: loopback unless an operator opens it (a "
            "container's own network: 0.0.0.0, deploy/docker-compose.yml); it has no auth"
        ),
    ] = "127.0.0.1"
    dedupe_window: Annotated[
        int, Field(description="consumed rollout ids remembered (in the checkpoint)")
    ] = 200_000
    sync_task_timeout_s: Annotated[
        float,
        Field(
            ge=0,
            description="sync: a task of the version's batch that yields no group at all (every rollout "
            "parked in DLQ, or the task expired) would stall the barrier; after this long without a full "
            "batch the missing tasks are published again (0 = [trainer.batch] group_timeout_s)",
        ),
    ] = 0.0
    sweep_stranded: Annotated[
        bool,
        Field(
            description="stranded SCORED messages (max_deliver used up without a verdict, e.g. by "
            "repeated step-downs: the server stops redelivering them) are parked in DLQ with a reason "
            "by the leader"
        ),
    ] = True


@config_class
class PolicySection:
    """What is trained and where (trainer/factory.py build_model)."""

    model: Annotated[
        dict,
        Field(
            description='{"preset": tiny|small|base50m|base100m, **ModelConfig overrides}; vocab_size '
            "defaults to the tokenizer's (workers decode with the same tokenizer)"
        ),
    ] = field(default_factory=dict)
    tokenizer: Annotated[str, Field(description="char (policy CharTokenizer) | path to a tokenizer.json")] = (
        "char"
    )
    init_checkpoint: Annotated[
        str, Field(description="optional HF checkpoint dir (policy.load_hf_checkpoint)")
    ] = ""
    device: Annotated[str, Field(description="auto (cuda if available) | cpu | cuda")] = "auto"
    mixed_precision: Annotated[
        Literal["auto", "bf16", "fp32"], Field(description="auto: bf16 params on CUDA, fp32 on CPU")
    ] = "auto"
    activation_checkpointing: Annotated[
        bool, Field(description="recompute block activations in backward")
    ] = False


@config_class
class OptimSection:
    """AdamW on fp32 master weights and its lr schedule (factory.build_optimizer, build_schedule)."""

    lr: float = 1e-4
    warmup_steps: Annotated[int, Field(ge=0, description="linear warmup from lr/warmup to lr")] = 0
    schedule: Annotated[Literal["constant", "cosine"], Field(description="after warmup")] = "constant"
    decay_steps: Annotated[
        int, Field(ge=0, description="cosine: steps to the floor (0: max_steps - warmup, or none)")
    ] = 0
    min_ratio: Annotated[float, Field(ge=0, le=1, description="cosine floor, fraction of lr")] = 0.0
    betas: CsvList[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    grad_clip: Annotated[float, Field(description="0 = off")] = 1.0


@config_class
class LossConfig:
    """`[trainer.loss]`: the learner's loss and how it is computed (trainer/loss.py pg_loss takes it
    whole; trainer/learner.py the micro-batching and replay)."""

    adv_norm: Annotated[
        Literal["std", "mean"],
        Field(
            description="mean: r - mean_g (Dr. GRPO: lambda * cost keeps its scale) | std: (r - mean_g) "
            "/ (std_g + eps) (std cancels lambda in a group of uniform success: "
            "docs/trainer.md#advantage-and-loss)"
        ),
    ] = "mean"
    is_mode: Literal["truncated", "masked", "none"] = "truncated"
    is_clip: Annotated[
        float, Field(gt=0, description="C: truncated IS clamps at C; masked IS keeps ratios in [1/C, C]")
    ] = 2.0
    entropy_coef: float = 0.0
    kl_coef: Annotated[
        float, Field(ge=0, description="KL penalty (k3 per token) to the frozen initial weights; 0 = off")
    ] = 0.0
    ppo_clip: Annotated[
        float,
        Field(
            description="removed (must be 0): with one optimizer step per batch a clip is no trust region "
            "(against this step's own policy the ratio is 1; against the behaviour policy it only masks "
            "stale tokens): use is_mode = 'masked' for that (docs/trainer.md)"
        ),
    ] = 0.0
    micro_batch: Annotated[int, Field(ge=1, description="sequences per forward pass (at most)")] = 32
    micro_batch_tokens: Annotated[
        int, Field(ge=0, description="padded tokens per forward (at most; a longer sequence runs alone)")
    ] = 16384
    logit_chunk_mb: Annotated[
        float, Field(gt=0, description="fp32 [tokens, vocab] logits projected at a time (chunked logprobs)")
    ] = 64.0
    replay: Annotated[
        bool, Field(description="recompute logprobs with the workers' sampling masks + fp8 sites")
    ] = True
    share_prompts: Annotated[
        bool,
        Field(
            description="a group's completions run packed behind one copy of their prompt "
            "(policy/packing.py): the same logprobs and gradients, the prompt's forward and backward "
            "done once, not group_size times"
        ),
    ] = True
    packed_row_tokens: Annotated[
        int, Field(ge=1, description="a packed row holds at most this many tokens (its attention is [L, L])")
    ] = 4096
    published_point: Annotated[
        bool,
        Field(
            description="forward/backward at the bf16 rounding of the master (what workers sample "
            "from), the update applied to the fp32 master (trainer/published_point.py); false: on the "
            "master itself"
        ),
    ] = True
    master_dither: Annotated[
        bool,
        Field(
            description="with published_point: the master starts a uniform random fraction of a bf16 "
            "step off each weight on the bf16 grid, so the published bf16 moves from the first step"
        ),
    ] = False

    @field_validator("ppo_clip")
    @classmethod
    def _no_ppo_clip(cls, v: float) -> float:
        if v != 0:
            raise ValueError(
                f"must be 0, got {v!r}: removed, with one optimizer step per batch a clip is no trust "
                "region; use is_mode = 'masked' for that (docs/trainer.md)"
            )
        return v


@config_class
class CostSection:
    """The cost penalty and who sets λ (policy/reward.py: the modes, λ steps; trainer/lambda_control.py)."""

    penalty: Annotated[
        Literal[PENALTIES],
        Field(
            description="how the cost penalty enters the advantage (docs/trainer.md#cost-penalty): linear "
            "(the scorer's success - λ·cost) | success_only (only successful members pay λ·cost) | "
            "group_normalised (cost z-scored in its group, clamped to ±1, scaled by min(λ·mean cost, "
            "penalty_cap))"
        ),
    ] = "linear"
    penalty_cap: Annotated[
        float,
        Field(
            gt=0,
            lt=0.5,
            description="group_normalised: |penalty| <= this (< 0.5: a penalty spread of 2 x cap under 1 "
            "never outweighs success)",
        ),
    ] = 0.25
    schedule: Annotated[
        Literal[LAMBDA_SCHEDULES],
        Field(
            description="who sets λ (KV rl-control/lambda, stamped on each group at feed time): fixed "
            "(never written here) | ramp (target · min(1, version / ramp_versions)) | budget (dual ascent "
            "per version: λ <- max(0, λ + budget_lr · (tokens per answer / budget_tokens - 1)))"
        ),
    ] = "fixed"
    target: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    ramp_versions: Annotated[int, Field(ge=0, description="schedule = 'ramp' needs it >= 1")] = 0
    budget_tokens: Annotated[
        float,
        Field(ge=0, allow_inf_nan=False, description="schedule = 'budget': tokens per answer aimed at (> 0)"),
    ] = 0.0
    budget_lr: Annotated[
        float,
        Field(
            ge=0,
            allow_inf_nan=False,
            description="schedule = 'budget': λ's step per version at 2x the budget (> 0)",
        ),
    ] = 0.0

    @model_validator(mode="after")
    def _schedule_needs(self):
        if self.schedule == "ramp" and self.ramp_versions < 1:
            raise ValueError(
                f"schedule = 'ramp' needs ramp_versions >= 1, got ramp_versions={self.ramp_versions}"
            )
        if self.schedule == "budget":
            bad = [
                f"{k}={getattr(self, k)!r}" for k in ("budget_tokens", "budget_lr") if getattr(self, k) <= 0
            ]
            if bad:
                raise ValueError(
                    f"schedule = 'budget' needs budget_tokens > 0 and budget_lr > 0, got {', '.join(bad)}"
                )
        return self


@config_class
class BatchSection:
    """Which scored groups make a batch (trainer/batcher.py, trainer/lag_control.py)."""

    groups: Annotated[int, Field(ge=1, description="groups (tasks) per optimizer step")] = 4
    group_size: Annotated[int, Field(ge=1, description="completions per task")] = 4
    group_timeout_s: Annotated[
        float, Field(description="a group still incomplete after this is used as it is")
    ] = 120.0
    max_lag: Annotated[
        int, Field(ge=0, description="samples with a token older than this many versions are stale")
    ] = 4
    stale: Literal["drop", "downweight"] = "drop"
    stale_weight: Annotated[
        float, Field(description="downweight: weight = stale_weight ** (lag - max_lag)")
    ] = 0.5
    max_k3: Annotated[
        float,
        Field(
            ge=0,
            description="hold the sampler/learner mismatch (k3_mean) under this by lowering the lag "
            "allowed, one version per step, between 1 and max_lag (trainer/lag_control.py); 0 = off",
        ),
    ] = 0.0
    fetch_timeout_s: float = 1.0
    skip_uniform: Annotated[
        bool,
        Field(
            description="skip groups whose rewards are all equal (DAPO's dynamic sampling): their "
            "advantages are 0, so they add no gradient, only dilute the token mean and cost a step and a "
            "version; skipped groups are acked at once and recorded with the next version (async only)"
        ),
    ] = False
    skip_uniform_by: Annotated[
        Literal["reward", "success"],
        Field(
            description='what "uniform" compares: reward (exact rewards equal: A = 0 under any adv_norm) | '
            "success (equal success, rewards differing by cost alone: the lambda * cost signal of such "
            'groups is given up for fewer steps; with adv_norm = "std" that signal would be full-scale)'
        ),
    ] = "reward"


@config_class
class TasksSection:
    """Which tasks, how they are asked and fed (trainer/feeding.py), and the held-out evals of them
    (trainer/evaluate.py, trainer/final_eval.py)."""

    envs: CsvList[str] = field(default_factory=lambda: ["arith"])
    sampling: dict = field(default_factory=lambda: {"temperature": 1.0, "max_tokens": 32})
    chat_template: Annotated[
        bool, Field(description="each prompt as the user turn of the tokenizer's chat template")
    ] = False
    feed: Annotated[bool, Field(description="publish tasks (off when an external feeder runs)")] = True
    backlog: Annotated[int, Field(description="async: groups kept queued (undelivered) in TASKS")] = 8
    max_outstanding: Annotated[
        int, Field(description="async: generated groups not yet trained, at most (0: 3 x groups)")
    ] = 0
    eval_every: Annotated[
        int, Field(description="held-out eval of the published policy every N versions (0 = off)")
    ] = 0
    eval_prompts: int = 128
    swe: Annotated[
        SweSection,
        Field(
            description="the `swe` env: its task set, episode limits, prompt and reward mode "
            '(envs/swe_config.py); checked (the set read, both splits non-empty) when "swe" is among `envs`'
        ),
    ] = field(default_factory=SweSection)

    @model_validator(mode="after")
    def _swe_task_set(self):
        if "swe" in self.envs:
            self.swe.check_task_set()
        return self


@config_class
class PublishSection:
    """How each version reaches the workers (trainer/encoders.py, bus/weights/)."""

    keyframe_interval: Annotated[int, Field(ge=1, description="a full keyframe every K versions")] = 20
    layout: Annotated[
        Literal["gathered", "sharded"],
        Field(
            description="gathered: rank 0 gathers the bf16 state and publishes one delta per version; "
            "sharded: every rank encodes the delta of the rows it owns, rank 0 stores the parts and signs "
            "one manifest (bus/weights/manifest.py; docs/trainer.md). Keyframes are gathered either way."
        ),
    ] = "gathered"
    delta_context: Annotated[
        bool | Literal["auto"],
        Field(
            description="code delta positions in the context of the base weights (format 4 CLASSED: "
            "smaller on real weights, slower to encode and apply; docs/benchmarks.md#delta): " + AUTO
        ),
    ] = "auto"
    signing_key: Annotated[
        str, Field(description='ed25519 private key: hex, or a file with hex or PEM; "" = unsigned')
    ] = ""


@config_class
class CheckpointSection:
    """Where and how often the trainer's state is saved (trainer/checkpoint.py, trainer/leader.py)."""

    dir: str = "runs/trainer/ckpt"
    keep: int = 3
    async_save: Annotated[
        bool,
        Field(
            description="sharded (torchrun) runs: write the DCP shards in the background "
            "(torch.distributed.checkpoint.async_save); the checkpoint file naming them is written only "
            "once they are complete"
        ),
    ] = False
    every: Annotated[
        int,
        Field(
            ge=1,
            description="checkpoint every K versions instead of every version: the versions between are "
            "published at once, but their batches are acked only after the next checkpoint (which records "
            "their ids) is durable, so a crash re-trains at most K - 1 versions and loses or double-trains "
            "nothing; the last version before a clean stop is always checkpointed. 1 = every version",
        ),
    ] = 1
    background: Annotated[
        bool | Literal["auto"],
        Field(
            description="write the checkpoint file in one background thread: the step's state is copied "
            "to CPU, the version is published at once and its batch acked only once its file is durable; "
            "a version due while the previous write still runs is published uncheckpointed and recorded "
            "by the next write (TrainerConfig.checkpoint_in_background): " + AUTO
        ),
    ] = "auto"


@config_class
class WarmstartSection:
    """Supervised steps on env demonstrations before RL (trainer/warmstart.py)."""

    steps: Annotated[int, Field(ge=0)] = 0
    lr: float = 1e-3
    style: Annotated[
        str,
        Field(
            description="demonstration style passed to the env (arith: default = direct|steps|padded, "
            "mixed = direct|steps, or one of them)"
        ),
    ] = "default"
    batch: Annotated[int, Field(ge=1)] = 16
    threads: Annotated[
        int,
        Field(
            ge=0,
            description="torch intra-op threads while warm-starting (0: [trainer.run] threads; workers "
            "and scorers idle until v0, so it may take more)",
        ),
    ] = 0
    until: Annotated[
        float,
        Field(
            ge=0,
            le=1,
            description="stop the warm start on a measured success instead of a step count (0 = off: "
            "`steps` steps). On: every check_every steps from check_from, play check_n TRAIN-split tasks "
            "at the tasks' sampling (the eval split stays unseen: choosing the stop point on it would "
            "leak the held-out metric) and stop once success >= until; `steps` is then the cap",
        ),
    ] = 0.0
    check_every: Annotated[int, Field(ge=1)] = 10
    check_from: Annotated[
        int, Field(ge=0, description="first step (1-based count of steps done) that may be checked")
    ] = 0
    check_n: Annotated[int, Field(ge=1)] = 16
    reuse: Annotated[
        str,
        Field(
            description="the warmstart.pt of an earlier run (same model config): loaded instead of "
            "running a warm start (RL experiments from one fixed starting policy)"
        ),
    ] = ""

    @field_validator("reuse")
    @classmethod
    def _reuse_is_a_file(cls, v: str) -> str:
        if v and not Path(v).is_file():
            raise ValueError(f"{v!r} is not a file (the warmstart.pt of an earlier run)")
        return v

    @model_validator(mode="after")
    def _until_needs_steps(self):
        if self.until and not self.steps:  # steps: the cap
            raise ValueError(f"until = {self.until!r} needs steps > 0 (the cap), got steps={self.steps}")
        return self


@config_class
class LeaseSection:
    """The leader lease (trainer/lease.py)."""

    ttl_s: Annotated[float, Field(gt=0)] = 15.0
    renew_s: Annotated[float, Field(description="0 = ttl / 3")] = 0.0

    @property
    def renew_every_s(self) -> float:
        return self.renew_s or self.ttl_s / 3


@config_class
class ElasticSection:
    """`python -m trainer --elastic` (trainer/elastic.py): torchrun's elastic agent, one agent per
    node; agents beyond the MAX of nnodes wait as spares and join when a node fails."""

    nnodes: Annotated[str, Field(description="MIN:MAX agents (nodes), or N; 1 <= MIN <= MAX")] = "2:2"
    nproc_per_node: Annotated[int, Field(ge=1, description="ranks per agent (one per GPU)")] = 1
    rdzv_endpoint: Annotated[
        str, Field(pattern=r".*:", description="host:port of the c10d rendezvous store")
    ] = "127.0.0.1:29400"
    rdzv_id: Annotated[str, Field(description="the same on every agent of one group")] = "asyncrl-trainer"
    max_restarts: Annotated[
        int, Field(ge=0, description="worker-group restarts (re-rendezvous) before an agent gives up")
    ] = 3
    rdzv_host: Annotated[bool, Field(description="this node hosts the store (one node: not swappable)")] = (
        False
    )
    rdzv_conf: Annotated[
        str, Field(description='more torchrun --rdzv_conf: "join_timeout=120,keep_alive_interval=1"')
    ] = ""

    @field_validator("nnodes")
    @classmethod
    def _nnodes(cls, v: str) -> str:
        """torchrun's --nnodes: N or MIN:MAX with 1 <= MIN <= MAX."""
        parts = str(v).split(":")
        if (
            len(parts) not in (1, 2)
            or not all(p.isdigit() for p in parts)
            or not 1 <= int(parts[0]) <= int(parts[-1])
        ):
            raise ValueError(f"must be N or MIN:MAX with 1 <= MIN <= MAX, got {v!r}")
        return v


@config_class
class FaultsSection:
    """Fault injection for bench.chaos and tests only: all off in production (not in the docs' tables)."""

    stop_before_publish: Annotated[
        int, Field(description="SIGSTOP itself after the lease CAS, just before writing version N")
    ] = 0
    probe_when_deposed: Annotated[
        bool, Field(description="once deposed, try one more publication skipping its own checks")
    ] = False
    step_delay_s: Annotated[
        float,
        Field(
            ge=0,
            description="hold each trained batch this long between its step and its checkpoint, i.e. a "
            "step + publication slower than ack_wait (tests/test_trainer_slow_step.py). 0 = off",
        ),
    ] = 0.0
    checkpoint_delay_s: Annotated[
        float,
        Field(
            ge=0,
            description="background checkpoints: the writer sleeps this long before each write, so that "
            "versions go out ahead of their checkpoint (tests/test_trainer_background_checkpoint.py). "
            "0 = off",
        ),
    ] = 0.0
