"""Tolerances for float comparisons, derived from what is compared (docs/testing.md).

Two computations of one quantity that differ only in reduction order (intra-op threads, FSDP shards,
micro-batching, another CPU's kernels) differ by rounding. A fixed rtol/atol that held on one CPU
says nothing about another; these bounds come from the dtype's unit roundoff u, the length n of the
reductions that feed an element, how many of them are chained, and the optimizer steps taken.

    sum_rtol(n)            two orders of an n-term sum differ by <= sum_rtol(n) * sum|x_i|
    forward_tol(model_cfg) (rtol, atol) for a transformer's outputs in two reduction orders
    transformers_tol(..)   (rtol, atol) for our logits against transformers' implementation
    grad_reduction_len(..) n behind a transformer weight's gradient (tokens + layers' matmuls)
    elementwise_rtol(k)    two evaluations of a k-rounding elementwise formula
    fp32_tol(n, depth)     (rtol, atol) for outputs of `depth` chained length-n reductions
    assert_adam_close(...) two AdamW runs whose gradients differ by rounding only

Equality stays where the code guarantees bit-exactness (same kernels, same order: a cast, a copy,
a lossless codec); docs/testing.md lists each comparison with its reason.
"""

from __future__ import annotations

import math

import torch

# Rounding errors of a sum behave like independent zero-mean variables: each order's error is within
# LAMBDA*sqrt(n)*u*sum|x| of the exact sum with probability >= 1 - 2n*exp(-LAMBDA^2/2)
# (Higham & Mary, SIAM J. Sci. Comput. 2019, thm 3.1); 7 makes that < 5e-7 for n up to 1e4. The
# worst case (n*u, Higham 2002 §4.2) is practically never approached and would make most checks useless.
LAMBDA = 7.0


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u = eps/2: the relative error of one rounding (2^-24 for fp32, 2^-8 for bf16)."""
    return torch.finfo(dtype).eps / 2


def sum_rtol(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Two orders of an n-term sum differ by at most this times sum|x_i| (each is within half of it
    of the exact sum)."""
    return 2 * LAMBDA * math.sqrt(max(n, 1)) * unit_roundoff(dtype)


def elementwise_rtol(ops: int, cond: float = 1.0, dtype: torch.dtype = torch.float32) -> float:
    """Two evaluations of one elementwise formula (no reduction) of `ops` roundings each, amplified by
    its condition number `cond` (|x| for exp(x), ...), differ by at most 2*ops*cond*u relative."""
    return 2 * ops * cond * unit_roundoff(dtype)


def fp32_tol(reduction_len: int, depth: int = 1, dtype: torch.dtype = torch.float32) -> dict:
    """rtol/atol (kwargs for torch.testing.assert_close) for outputs of `depth` chained reductions of
    length `reduction_len` each (e.g. a transformer's layers), values O(1): relative errors add along
    the chain, and atol covers outputs that cancel to near 0 (their terms are O(1))."""
    t = depth * sum_rtol(reduction_len, dtype)
    return {"rtol": t, "atol": t}


def forward_tol(model_cfg, scale: float = 1.0) -> dict:
    """rtol/atol for a transformer's outputs (logits, logprobs) computed in two reduction orders (batched
    vs alone, cached vs full, threads): two chained reductions per layer (attention, MLP) and the head,
    each at most max(d_model, d_ff, vocab) long; `scale` is the outputs' magnitude."""
    n = max(model_cfg.d_model, model_cfg.d_ff, model_cfg.vocab_size)
    t = fp32_tol(n, depth=2 * model_cfg.n_layers + 1)["rtol"]
    return {"rtol": t, "atol": t * max(scale, 1.0)}


def transformers_tol(model_cfg, logits: torch.Tensor, positions: int) -> dict:
    """rtol/atol for our logits against `transformers`' on the same weights: forward_tol at the logits'
    size (its own kernels and order), plus its RoPE angles pos * freq rounded in fp32 (ours come from
    float64): u * pos per rotation, q and k, each layer."""
    scale = float(logits.abs().max())
    tol = forward_tol(model_cfg, scale=scale)
    rope = 2 * model_cfg.n_layers * unit_roundoff() * positions * max(1.0, scale)
    return {"rtol": tol["rtol"], "atol": tol["atol"] + rope}


def grad_reduction_len(model_cfg, tokens: int) -> int:
    """Length of the reductions behind one weight's gradient in a transformer: a sum over the batch's
    tokens of terms that each went through every layer's d_model- and d_ff-long matmuls (their
    bounds add along the chain)."""
    return tokens + model_cfg.n_layers * (model_cfg.d_model + model_cfg.d_ff)


def adam_step_bound(betas: tuple[float, float], steps: int) -> float:
    """max |m_hat / sqrt(v_hat)| over any gradients, at step `steps` (by Cauchy-Schwarz on the bias-
    corrected averages): ~1 for the first steps, what one AdamW step can move an element per unit lr."""
    b1, b2 = betas
    a = [(1 - b1) * b1 ** (steps - i) / (1 - b1**steps) for i in range(1, steps + 1)]
    w = [(1 - b2) * b2 ** (steps - i) / (1 - b2**steps) for i in range(1, steps + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, w)))


def assert_adam_close(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    *,
    lrs: list[float],
    betas: tuple[float, float],
    reduction_len: int,
    kappa: float = 1e3,
) -> None:
    """Weights of two AdamW runs from the same start whose gradients differ by rounding only.

    An element's gradient is a sum of reduction_len terms. Where it is well conditioned
    (sum|terms| <= kappa*|g|) its relative error is <= kappa*sum_rtol(n), and an Adam step, which is
    homogeneous of degree 0 in the gradients, moves by at most that fraction of its size; each step
    also rounds the weight (u*|w|). Where the gradient cancels to below sum|terms|/kappa (a fraction
    ~sqrt(n)/kappa of elements for random-sign terms) the step may go either way: still within
    2 * sum_t lr_t * adam_step_bound(t) of the other run, and those elements must stay that rare.
    """
    assert got.keys() == want.keys(), set(got) ^ set(want)
    steps, u = len(lrs), unit_roundoff(torch.float32)
    reach = sum(lr * adam_step_bound(betas, t + 1) for t, lr in enumerate(lrs))
    tight_abs = kappa * sum_rtol(reduction_len) * reach
    loose_abs = 2 * reach
    outside, total, worst = 0, 0, (0.0, "")
    for name, w in want.items():
        d = (got[name].detach().float() - w.detach().float()).abs()
        weight_rounding = 2 * steps * u * w.detach().float().abs()
        assert bool((d <= loose_abs + weight_rounding).all()), (
            f"{name}: differs by {float(d.max()):.3g}, more than AdamW can move it in {steps} steps "
            f"({loose_abs:.3g}): not a rounding difference"
        )
        outside += int((d > tight_abs + weight_rounding).sum())
        total += d.numel()
        worst = max(worst, (float(d.max()), name))
    allowed = math.sqrt(reduction_len) / kappa * total
    assert outside <= allowed, (
        f"{outside} of {total} elements differ by more than rounding explains ({tight_abs:.3g}; at most "
        f"{allowed:.0f} ill-conditioned ones expected); worst {worst[0]:.3g} in {worst[1]}"
    )
