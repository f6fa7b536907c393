"""Learning-rate schedule: linear warmup, then constant or cosine decay to a floor.

The step index is the optimizer's own count of completed steps (AdamW keeps it per parameter
and it is in every checkpoint), so a resumed run continues the schedule where it stopped."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class LRSchedule:
    lr: float
    warmup_steps: int = 0
    kind: str = "constant"  # constant | cosine
    decay_steps: int = 0  # cosine: steps from the end of warmup to the floor (0 = no decay)
    min_ratio: float = 0.0  # cosine floor as a fraction of lr

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be constant or cosine, got {self.kind!r}")
        if self.warmup_steps < 0 or self.decay_steps < 0 or not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError("lr_warmup_steps and lr_decay_steps must be >= 0 and lr_min_ratio in [0, 1]")

    def at(self, step: int) -> float:
        """LR for the optimizer step that follows `step` completed ones."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.kind == "constant" or self.decay_steps == 0:
            return self.lr
        t = min(step - self.warmup_steps, self.decay_steps) / self.decay_steps
        return self.lr * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def completed_steps(opt: torch.optim.Optimizer) -> int:
    for st in opt.state.values():
        if "step" in st:
            return int(st["step"])
    return 0


def apply_schedule(opt: torch.optim.Optimizer, sched: LRSchedule | None) -> float:
    """Set every param group's lr for the coming step; returns it."""
    lr = sched.at(completed_steps(opt)) if sched else opt.param_groups[0]["lr"]
    for g in opt.param_groups:
        g["lr"] = lr
    return lr
