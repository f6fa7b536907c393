"""Trainer-side replay: teacher-forced logprobs through the same sampling transform, the same
kept set and the same fp8 sites the engine used; mismatch metrics and importance weights.

Memory: only completion positions are projected to the vocabulary, `chunk_tokens` rows at a
time (0 = all at once); with more than one chunk each chunk runs under activation
checkpointing, so no [tokens, vocab] tensor outlives its chunk: backward recomputes it. Same
loss and gradient as one chunk (tested); the peak is a few [chunk_tokens, vocab] fp32 copies.

Every log-ratio that goes through an exponent is clamped first (`clamp_log_ratio`, the one
place): exp(±20) is finite in fp32, and a weight of 0 times it stays 0 (inf * 0 would be NaN)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .packing import one_per_row, shared_prompts
from .sampling import (
    FULL,
    SamplingConfig,
    SamplingMask,
    sampling_tensors,
    scale_logits,
    truncated_logprobs,
    truncation,
)

LOG_RATIO_CLAMP = 20.0  # |log pi/mu| beyond this is as off-policy as it gets; exp(20) ~ 4.9e8


def clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """The log-ratio every exponent sees: clamped to +-LOG_RATIO_CLAMP (NaN stays NaN: it is
    found and the step skipped, never hidden)."""
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@dataclass
class LogprobResult:
    logprobs: torch.Tensor  # [B, T] logprob of each completion token (0 where not valid)
    entropy: torch.Tensor  # [B, T] entropy of the (truncated) distribution at that step
    valid: torch.Tensor  # [B, T] bool, T = longest completion


def sequence_logprobs(
    model,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    samplings: Sequence[SamplingConfig] | SamplingConfig,
    masks: Sequence[SamplingMask | None] | None = None,
    replay_mask: bool = True,
    chunk_tokens: int = 0,
    share_prompts: bool = False,
    packed_row_tokens: int = 0,
) -> LogprobResult:
    """Batched, differentiable. replay_mask=True: each token's distribution is rebuilt from its
    shipped kept set (mask=None: re-derived from our own logits with the same truncation).
    replay_mask=False: temperature only, no truncation (what a naive trainer would compute).
    Quant replay is `model.quant`. chunk_tokens: completion tokens projected to the vocabulary
    at a time (0 = all). share_prompts: the completions of one prompt run packed behind a single
    copy of it (policy/packing.py): the same numbers, the prompt computed once; a packed row
    holds at most packed_row_tokens tokens (0: no cap)."""
    B = len(prompts)
    if len(completions) != B:
        raise ValueError(f"{B} prompts but {len(completions)} completions")
    samplings = [samplings] * B if isinstance(samplings, SamplingConfig) else list(samplings)
    masks = [None] * B if masks is None else list(masks)
    if len(samplings) != B or len(masks) != B:
        raise ValueError(
            f"need one sampling config and one mask per sequence ({B}), got {len(samplings)} and {len(masks)}"
        )
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0, got {chunk_tokens}")
    plen = [len(p) for p in prompts]
    clen = [len(c) for c in completions]
    if min(plen, default=1) == 0:
        raise ValueError(
            "every prompt needs at least one token (the first completion token is predicted from it)"
        )
    for i, (m, n) in enumerate(zip(masks, clen)):
        if m is not None and len(m) != n:
            raise ValueError(f"sequence {i}: mask has {len(m)} rows for {n} completion tokens")
    dev = next(model.parameters()).device
    if share_prompts:
        rows = shared_prompts(prompts, completions, dev, packed_row_tokens)
    else:
        rows = one_per_row(prompts, completions, dev)
    Tc = max(clen, default=0)
    C = torch.tensor(clen, device=dev)
    j = torch.arange(Tc, device=dev)
    valid = j[None] < C[:, None]
    rv, pv, target = rows.row, rows.at, rows.target  # N = total completion tokens, sample-major
    temperature, top_p, top_k = (t.repeat_interleave(C) for t in sampling_tensors(samplings, B, dev))
    if not replay_mask:
        temperature = torch.where(temperature > 0, temperature, 1.0)  # greedy: plain softmax
    rowsets = RowSets.of(masks, clen, replay_mask, temperature, top_p, top_k)

    def head(h, w):  # inside the model's forward: only completion positions, chunk by chunk
        return token_logprobs(h[rv, pv], w, target, temperature, top_p, top_k, rowsets, chunk_tokens)

    packed = {} if rows.mask is None else {"pos": rows.pos, "mask": rows.mask}
    tok_lp, ent = model(rows.idx, head=head, **packed)
    at = (torch.arange(B, device=dev)[:, None].expand(B, Tc)[valid], j.expand(B, Tc)[valid])
    out_lp = torch.zeros(B, Tc, device=dev, dtype=tok_lp.dtype).index_put(at, tok_lp)
    out_ent = torch.zeros(B, Tc, device=dev, dtype=ent.dtype).index_put(at, ent)
    return LogprobResult(out_lp, out_ent, valid)


@dataclass
class RowSets:
    """How each completion token's kept set is found, per flat row: `given` rows take the next
    row of `shipped` (the concatenated shipped masks, in row order); the other rows re-derive it
    from the logits (`derive`), or keep the whole vocabulary (replay off). `need`: rows whose kept
    set is not the whole vocabulary (a shipped row that is not FULL, a derived row whose sampling
    truncates); a chunk without one builds no [rows, vocab] mask at all."""

    given: torch.Tensor  # [N] bool
    need: torch.Tensor  # [N] bool
    derive: bool  # re-derive the rows without a shipped mask
    shipped: SamplingMask  # rows of the given rows, in order
    before: np.ndarray  # [N + 1] number of given rows before each flat row

    @classmethod
    def of(cls, masks, clen, replay_mask: bool, temperature, top_p, top_k) -> RowSets:
        dev = temperature.device
        if not replay_mask:
            masks = [None] * len(clen)
        g = np.repeat(np.array([m is not None for m in masks], dtype=bool), clen)
        shipped = SamplingMask.concat([m for m in masks if m is not None])
        given = torch.from_numpy(g).to(dev)
        need = torch.zeros_like(given)
        need[given] = torch.from_numpy(shipped.counts != FULL).to(dev)
        if replay_mask:  # the same rule as sampling.truncation: these rows keep everything
            need |= ~given & ((top_p < 1) | (top_k > 0) | (temperature <= 0))
        return cls(given, need, replay_mask, shipped, np.concatenate([[0], np.cumsum(g)]).astype(np.int64))

    def chunk_keep(self, a: int, b: int, scaled, temperature, top_p, top_k, target) -> torch.Tensor | None:
        """Bool [b-a, V] kept set of rows a..b, or None when every row keeps the whole vocabulary."""
        given, need = self.given[a:b], self.need[a:b]
        if not bool(need.any()):
            return None
        dev = scaled.device
        with torch.no_grad():
            keep = torch.ones_like(scaled, dtype=torch.bool)
            derive = need & ~given
            if self.derive and bool(derive.any()):
                sel = derive.nonzero()[:, 0]
                order, keep_sorted = truncation(scaled[sel], temperature[sel], top_p[sel], top_k[sel])
                keep[sel] = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
                # our logits may differ from the engine's: keep the sampled token so its logprob is finite
                keep[sel, target[sel]] = True
            if bool((need & given).any()):
                sel = given.nonzero()[:, 0]
                rows = self.shipped[int(self.before[a]) : int(self.before[b])]
                shipped = rows.keep_matrix(scaled.shape[1], dev)
                keep[sel] = shipped
                outside = ~shipped.gather(1, target[sel][:, None])[:, 0]
                if outside.any():
                    bad = (sel[outside] + a)[:5].tolist()
                    raise ValueError(
                        f"sampled token outside its shipped kept set at flat rows {bad}: "
                        "mask does not belong to this completion"
                    )
        return keep


def token_logprobs(
    hidden, weight, target, temperature, top_p, top_k, rowsets: RowSets, chunk_tokens: int = 0
):
    """hidden [N, d] of the completion positions, output weight [V, d] -> (logprob of each target
    [N], entropy of each row's kept distribution [N]), `chunk_tokens` rows at a time."""
    N = hidden.shape[0]
    n = chunk_tokens or max(N, 1)
    if N <= n:
        return _chunk(hidden, weight, 0, N, target, temperature, top_p, top_k, rowsets)
    lps, ents = [], []
    for a in range(0, N, n):
        b = min(a + n, N)
        lp, en = checkpoint(
            _chunk, hidden[a:b], weight, a, b, target, temperature, top_p, top_k, rowsets, use_reentrant=False
        )
        lps.append(lp)
        ents.append(en)
    return torch.cat(lps), torch.cat(ents)


def _chunk(hidden, weight, a, b, target, temperature, top_p, top_k, rowsets: RowSets):
    scaled = scale_logits(F.linear(hidden, weight).float(), temperature[a:b])
    tgt = target[a:b]
    keep = rowsets.chunk_keep(a, b, scaled, temperature[a:b], top_p[a:b], top_k[a:b], tgt)
    if keep is None:
        logp = scaled.log_softmax(-1)
        ent = -(logp.exp() * logp).sum(-1)
    else:
        logp = truncated_logprobs(scaled, keep)
        safe = logp.masked_fill(~keep, 0.0)  # 0*(-inf) outside the kept set would poison the gradient
        ent = -(safe.exp() * keep * safe).sum(-1)
    return logp.gather(1, tgt[:, None])[:, 0], ent


def mismatch_metrics(behaviour_logprobs, trainer_logprobs, valid=None, C: float = 2.0) -> dict:
    """Importance ratio pi_trainer / mu_behaviour on tokens sampled from mu. k3 = r - 1 - log r is
    an unbiased, non-negative estimator of KL(mu || pi)."""
    b = torch.as_tensor(behaviour_logprobs, dtype=torch.float64)
    t = torch.as_tensor(trainer_logprobs).detach().to(torch.float64)
    v = torch.ones_like(b, dtype=torch.bool) if valid is None else torch.as_tensor(valid, dtype=torch.bool)
    if b.shape != t.shape or b.shape != v.shape:
        raise ValueError(
            f"shape mismatch: behaviour {tuple(b.shape)}, trainer {tuple(t.shape)}, valid {tuple(v.shape)}"
        )
    if not v.any():
        raise ValueError("mismatch_metrics needs at least one valid token")
    lr = clamp_log_ratio((t - b)[v])
    r = lr.exp()
    return {
        "k3_mean": float((r - 1 - lr).mean()),
        "ratio_mean": float(r.mean()),
        "ratio_p99_abs_log": float(torch.quantile(lr.abs(), 0.99)),
        "frac_outside_C": float(((r < 1 / C) | (r > C)).double().mean()),
        "C": C,
        "tokens": int(v.sum()),
    }


def truncated_is_weight(log_ratio: torch.Tensor, C: float = 2.0) -> torch.Tensor:
    """TIS: min(pi/mu, C), detached (a weight on the policy-gradient term, not a path for grads)."""
    return clamp_log_ratio(log_ratio.detach()).exp().clamp(max=C)


def masked_is_weight(log_ratio: torch.Tensor, C: float = 2.0) -> torch.Tensor:
    """MIS: pi/mu where it lies in [1/C, C], else 0 (tokens too far off-policy are dropped)."""
    r = clamp_log_ratio(log_ratio.detach()).exp()
    return torch.where((r >= 1 / C) & (r <= C), r, torch.zeros_like(r))
