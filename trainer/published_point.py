"""The gradient at the weights the workers sample from.

Workers hold the bf16 rounding of the trainer's fp32 master weights (what a version publishes).
A forward on the master itself is another policy: once the master has moved by less than half a
bf16 step in most elements, which a few dozen AdamW steps at lr 3e-6 do, the trainer's replay
and the sampler disagree with no version lag at all (docs/trainer.md has the measurement). So a
step runs its forward and backward at the published point (every floating parameter rounded to
bf16, held in its own dtype) and the optimizer updates the master: the straight-through estimator
of mixed-precision training, and an importance ratio of exactly 1 for tokens of the same version.
Memory: one copy of this rank's parameters while the step's passes run."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def at_published_point(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16, on: bool = True):
    """Inside: the model's parameters are their `dtype` rounding; on exit, the exact master
    values again (gradients stay: they were taken at the rounded point)."""
    params = [p for p in model.parameters() if on and p.is_floating_point() and p.dtype != dtype]
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        for p in params:
            p.copy_(p.to(dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
