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


def dither_master(model: torch.nn.Module, seed: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Move each master weight that lies exactly on the `dtype` grid (a pretrained checkpoint stored
    in bf16 does) by a uniform random fraction of its grid step, within (-1/2, 1/2) step, so that its
    rounding, the published point, is unchanged; returns how many moved.

    Why: the workers sample round(master). Started on the grid, a weight's rounding moves only once
    the master has drifted half a step, which at lr 1e-5 takes AdamW a dozen steps or more: the
    sampled policy stands still while the master learns (TRL's fp32 policy after 8 steps, rounded to
    bf16, falls from 0.40 to 0.20 held-out on arith-chat-12: the gain was below bf16's resolution).
    With a uniform offset the rounding is unbiased, E[round(master + drift)] = w + drift, from the
    first step; a weight still flips only when its master crosses a midpoint, so deltas stay sparse.
    Seeded: every rank of a group dithers alike. Resume reads the dithered master from the checkpoint."""
    g = torch.Generator().manual_seed(seed)
    moved = 0
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point() or p.dtype == dtype:
                continue
            w = p.detach()
            rounded = w.to(dtype).to(w.dtype)
            _, e = torch.frexp(w)  # |w| in [2^(e-1), 2^e): the grid step there is 2^(e-1)·eps
            step = torch.ldexp(torch.full_like(w, torch.finfo(dtype).eps), e - 1)
            u = torch.rand(w.shape, generator=g, dtype=w.dtype).to(w.device) - 0.5
            cand = w + u * step
            # off-grid masters (an fp32 checkpoint) are dithered already; a candidate that would
            # round elsewhere (a tie, or below a power of two where the step halves) stays put
            keep = (rounded == w) & (w != 0) & (cand.to(dtype).to(w.dtype) == rounded)
            w.copy_(torch.where(keep, cand, w))
            moved += int(keep.sum())
    return moved
