"""The [up] table of a run config: what `asyncrl up` itself runs (children, limits, telemetry)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class UpConfig:
    """The [up] table of a run config (CLI flags override it), checked before anything starts."""

    steps: int = 30
    minutes: float = 9.0
    workers: int = 2
    scorers: int = 1
    trainers: int = 1  # > 1: standbys that take over the lease when the leader dies
    sync: bool = False
    worker_nice: int = 10
    grace_s: float = 10.0  # every child's drain time (unless its own section sets grace_s)
    max_restarts: int = 5  # per child; an unexpected exit past this stays dead
    restart_backoff_s: float = 1.0  # first restart delay, doubling per restart (max 30 s)
    lambda_: float | None = None
    # after the run: the trainer's held-out eval of the last checkpoint (a `python -m trainer
    # --eval-final` child), so the final policy is measured without spending the run's time on it
    final_eval: bool = False
    # versions the WEIGHTS stream keeps per subject (deltas, keyframes): `asyncrl export` rebuilds a
    # version of a stopped run from its store only while the deltas from a keyframe up to it are held
    weights_keep: int = 64
    metrics_port: int = 0  # > 0: the trainer serves /metrics here, scorers and workers on the next ports
    wandb_project: str = ""  # set: log the run to Weights & Biases (asyncrl/tracking.py)
    wandb_entity: str = ""
    wandb_name: str = ""
    wandb_mode: str = ""  # online | offline | disabled ("" = wandb's default / WANDB_MODE)
    wandb_tags: list = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> UpConfig:
        d = dict(d)
        if "lambda" in d:
            d["lambda_"] = d.pop("lambda")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"[up]: unknown key(s) {unknown}; known: "
                f"{sorted(k.rstrip('_') for k in cls.__dataclass_fields__)}"
            )
        for k, v in d.items():
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if k in ("sync", "final_eval"):
                ok, want = isinstance(v, bool), "a bool"
            elif k.startswith("wandb_"):
                ok, want = (
                    (isinstance(v, list), "a list") if k == "wandb_tags" else (isinstance(v, str), "a string")
                )
            elif k in (
                "steps",
                "workers",
                "scorers",
                "trainers",
                "worker_nice",
                "max_restarts",
                "metrics_port",
                "weights_keep",
            ):
                ok, want = number and isinstance(v, int), "an integer"
            else:
                ok, want = number or (k == "lambda_" and v is None), "a number"
            if not ok:
                raise ValueError(f"[up] {k.rstrip('_')}: expected {want}, got {v!r}")
        return cls(**d)

    def __post_init__(self):
        checks = [
            ("steps", self.steps >= 1),
            ("minutes", self.minutes > 0),
            ("workers", self.workers >= 1),
            ("scorers", self.scorers >= 1),
            ("trainers", self.trainers >= 1),
            ("grace_s", self.grace_s >= 0),
            ("max_restarts", self.max_restarts >= 0),
            ("restart_backoff_s", self.restart_backoff_s > 0),
            ("lambda", self.lambda_ is None or self.lambda_ >= 0),
            ("metrics_port", 0 <= self.metrics_port < 65536),
            ("weights_keep", self.weights_keep >= 1),
        ]
        bad = [k for k, ok in checks if not ok]
        if bad:
            attr = {"lambda": "lambda_"}
            raise ValueError(
                "[up]: out of range: " + ", ".join(f"{k} = {getattr(self, attr.get(k, k))!r}" for k in bad)
            )
