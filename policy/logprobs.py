"""Trainer-side replay: teacher-forced logprobs through the same sampling transform, the same
kept set and the same fp8 sites the engine used; mismatch metrics and importance weights."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .sampling import SamplingConfig, SamplingMask, sampling_tensors, scale_logits, truncated_logprobs, truncation


@dataclass
class LogprobResult:
    logprobs: torch.Tensor     # [B, T] logprob of each completion token (0 where not valid)
    entropy: torch.Tensor      # [B, T] entropy of the (truncated) distribution at that step
    valid: torch.Tensor        # [B, T] bool, T = longest completion


def sequence_logprobs(model, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                      samplings: Sequence[SamplingConfig] | SamplingConfig,
                      masks: Sequence[SamplingMask | None] | None = None,
                      replay_mask: bool = True) -> LogprobResult:
    """Batched, differentiable. replay_mask=True: each token's distribution is rebuilt from its
    shipped kept set (mask=None: re-derived from our own logits with the same truncation).
    replay_mask=False: temperature only, no truncation (what a naive trainer would compute).
    Quant replay is `model.quant`."""
    B = len(prompts)
    if len(completions) != B:
        raise ValueError(f"{B} prompts but {len(completions)} completions")
    samplings = [samplings] * B if isinstance(samplings, SamplingConfig) else list(samplings)
    masks = [None] * B if masks is None else list(masks)
    if len(samplings) != B or len(masks) != B:
        raise ValueError(f"need one sampling config and one mask per sequence ({B}), "
                         f"got {len(samplings)} and {len(masks)}")
    plen = [len(p) for p in prompts]
    clen = [len(c) for c in completions]
    if min(plen, default=1) == 0:
        raise ValueError("every prompt needs at least one token (the first completion token is predicted from it)")
    for i, (m, n) in enumerate(zip(masks, clen)):
        if m is not None and len(m) != n:
            raise ValueError(f"sequence {i}: mask has {len(m)} rows for {n} completion tokens")
    dev = next(model.parameters()).device
    Tc, Tf = max(clen, default=0), max(p + c for p, c in zip(plen, clen))
    idx = torch.zeros(B, Tf, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        idx[i, :plen[i] + clen[i]] = torch.as_tensor(list(p) + list(c), dtype=torch.long)
    idx = idx.to(dev)
    P, C = torch.tensor(plen, device=dev), torch.tensor(clen, device=dev)
    j = torch.arange(Tc, device=dev)
    valid = j[None] < C[:, None]
    # logits at position plen-1+j predict completion token j (right padding never leaks: causal)
    pos = (P[:, None] - 1 + j[None]).clamp(max=Tf - 1)
    logits = model(idx)
    rows = torch.arange(B, device=dev)[:, None].expand(B, Tc)
    lg = logits[rows[valid], pos[valid]]                         # [N, V], N = total completion tokens
    target = idx[rows[valid], (pos + 1).clamp(max=Tf - 1)[valid]]
    temperature, top_p, top_k = (t.repeat_interleave(C) for t in sampling_tensors(samplings, B, dev))
    if not replay_mask:
        temperature = torch.where(temperature > 0, temperature, 1.0)     # greedy: plain softmax
    scaled = scale_logits(lg, temperature)
    keep = kept_sets(scaled, temperature, top_p, top_k, masks, clen, target) if replay_mask \
        else torch.ones_like(scaled, dtype=torch.bool)
    logp = truncated_logprobs(scaled, keep)
    tok_lp = logp.gather(1, target[:, None])[:, 0]
    safe = logp.masked_fill(~keep, 0.0)     # 0*(-inf) outside the kept set would poison the gradient
    ent = -(safe.exp() * keep * safe).sum(-1)
    out_lp = torch.zeros(B, Tc, device=dev, dtype=tok_lp.dtype).index_put((rows[valid], j.expand(B, Tc)[valid]), tok_lp)
    out_ent = torch.zeros(B, Tc, device=dev, dtype=ent.dtype).index_put((rows[valid], j.expand(B, Tc)[valid]), ent)
    return LogprobResult(out_lp, out_ent, valid)


def kept_sets(scaled, temperature, top_p, top_k, masks, clen, target) -> torch.Tensor:
    """Bool [N, V] kept set per token: shipped masks where given, else re-derived from `scaled`."""
    dev = scaled.device
    start = np.concatenate([[0], np.cumsum(clen)]).astype(np.int64)

    def flat_rows(seqs):
        return torch.from_numpy(np.concatenate([np.arange(start[i], start[i + 1]) for i in seqs])).to(dev)

    with torch.no_grad():
        keep = torch.ones_like(scaled, dtype=torch.bool)
        derive = [i for i, m in enumerate(masks) if m is None and clen[i]]
        if derive:
            sel = flat_rows(derive)
            order, keep_sorted = truncation(scaled[sel], temperature[sel], top_p[sel], top_k[sel])
            keep[sel] = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
            # our logits may differ from the engine's: keep the sampled token so its logprob is finite
            keep[sel, target[sel]] = True
        given = [i for i, m in enumerate(masks) if m is not None and clen[i]]
        if given:
            sel = flat_rows(given)
            shipped = SamplingMask.concat([masks[i] for i in given]).keep_matrix(scaled.shape[1], dev)
            keep[sel] = shipped
            outside = ~shipped.gather(1, target[sel][:, None])[:, 0]
            if outside.any():
                raise ValueError(f"sampled token outside its shipped kept set at flat rows "
                                 f"{sel[outside][:5].tolist()}: mask does not belong to this completion")
    return keep


def mismatch_metrics(behaviour_logprobs, trainer_logprobs, valid=None, C: float = 2.0) -> dict:
    """Importance ratio pi_trainer / mu_behaviour on tokens sampled from mu. k3 = r - 1 - log r is
    an unbiased, non-negative estimator of KL(mu || pi)."""
    b = torch.as_tensor(behaviour_logprobs, dtype=torch.float64)
    t = torch.as_tensor(trainer_logprobs).detach().to(torch.float64)
    v = torch.ones_like(b, dtype=torch.bool) if valid is None else torch.as_tensor(valid, dtype=torch.bool)
    if b.shape != t.shape or b.shape != v.shape:
        raise ValueError(f"shape mismatch: behaviour {tuple(b.shape)}, trainer {tuple(t.shape)}, valid {tuple(v.shape)}")
    if not v.any():
        raise ValueError("mismatch_metrics needs at least one valid token")
    lr = (t - b)[v]
    r = lr.exp()
    return {"k3_mean": float((r - 1 - lr).mean()), "ratio_mean": float(r.mean()),
            "ratio_p99_abs_log": float(torch.quantile(lr.abs(), 0.99)),
            "frac_outside_C": float(((r < 1 / C) | (r > C)).double().mean()), "C": C, "tokens": int(v.sum())}


def truncated_is_weight(log_ratio: torch.Tensor, C: float = 2.0) -> torch.Tensor:
    """TIS: min(pi/mu, C), detached (a weight on the policy-gradient term, not a path for grads)."""
    return log_ratio.detach().exp().clamp(max=C)


def masked_is_weight(log_ratio: torch.Tensor, C: float = 2.0) -> torch.Tensor:
    """MIS: pi/mu where it lies in [1/C, C], else 0 (tokens too far off-policy are dropped)."""
    r = log_ratio.detach().exp()
    return torch.where((r >= 1 / C) & (r <= C), r, torch.zeros_like(r))
