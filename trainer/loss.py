"""Group-relative advantage and the token-level off-policy policy-gradient loss.

Advantage (GRPO-style). For a group g of completions of one task with rewards r_i:
    adv_norm = "std":  A_i = (r_i - mean_g) / (std_g + eps)      std_g is the population std
    adv_norm = "mean": A_i =  r_i - mean_g
A group whose rewards are all equal carries no signal: A = 0 for each member.

Loss. Tokens of every sample in the batch are packed into one flat vector. With
rho_t = pi_theta(y_t) / mu(y_t) (mu = the behaviour logprob the worker shipped):
    is_mode = "truncated": w_t = min(rho_t, C)                         (detached)
    is_mode = "masked":    w_t = rho_t if 1/C <= rho_t <= C else 0    (detached)
    is_mode = "none":      w_t = 1
    per-token objective  o_t = rho_t * A_t * sg(w_t / rho_t)          (value w_t A_t, gradient w_t A_t grad log pi)
    with ppo_clip = eps:  o_t = min(rho_t A_t, clip(rho_t, 1-eps, 1+eps) A_t) * sg(w_t / rho_t)
    loss = -sum_t s_t * o_t / N  - entropy_coef * sum_t s_t * H_t / N
s_t is the sample weight (0 for dropped stale samples, stale_weight^k when down-weighted) and
N the number of tokens with s_t > 0 over the whole (global, all ranks) batch, so a long answer
weighs by its tokens (token-level mean) and data-parallel shards sum to the 1-process loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from policy import masked_is_weight, truncated_is_weight

EPS = 1e-6


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, norm: str = "std") -> torch.Tensor:
    """rewards [N] float, group [N] long in 0..G-1 -> advantages [N] (vectorised by scatter)."""
    if rewards.shape != group.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group {tuple(group.shape)} must be equal 1-d")
    r = rewards.double()
    G = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(G, dtype=torch.float64).index_add_(0, group, torch.ones_like(r))
    mean = torch.zeros(G, dtype=torch.float64).index_add_(0, group, r) / count
    centred = r - mean[group]
    if norm == "mean":
        return centred.float()
    var = torch.zeros(G, dtype=torch.float64).index_add_(0, group, centred**2) / count
    std = var.sqrt()[group]
    adv = torch.where(std > EPS, centred / (std + EPS), torch.zeros_like(centred))
    return adv.float()


@dataclass
class LossConfig:
    is_mode: str = "truncated"
    is_clip: float = 2.0
    ppo_clip: float = 0.0
    entropy_coef: float = 0.0


def is_weights(logp: torch.Tensor, behav: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Detached importance weights pi/mu per token per the configured correction."""
    log_ratio = logp.detach() - behav
    if cfg.is_mode == "truncated":
        return truncated_is_weight(log_ratio, cfg.is_clip)
    if cfg.is_mode == "masked":
        return masked_is_weight(log_ratio, cfg.is_clip)
    if cfg.is_mode == "none":
        return torch.ones_like(log_ratio)
    raise ValueError(f"unknown is_mode {cfg.is_mode!r}")


def pg_loss(logp: torch.Tensor, behav: torch.Tensor, adv: torch.Tensor, weight: torch.Tensor,
            n_tokens: float, cfg: LossConfig, entropy: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, dict]:
    """Token-level PG loss over packed tokens [T]; returns (loss, stats). See module docstring."""
    if not (logp.shape == behav.shape == adv.shape == weight.shape):
        raise ValueError("logp, behav, adv, weight must have the same shape [T]")
    w = is_weights(logp, behav, cfg)
    log_rho = logp - behav
    rho = log_rho.exp()
    if cfg.ppo_clip > 0:
        eps = cfg.ppo_clip
        surr = torch.minimum(rho * adv, rho.clamp(1 - eps, 1 + eps) * adv)
        clipped = ((rho.detach() - 1).abs() > eps) & ((rho.detach() - 1).sign() == adv.sign())
    else:
        surr = rho * adv
        clipped = torch.zeros_like(rho, dtype=torch.bool)
    # the IS surrogate: its gradient is the truncated/masked-IS policy gradient w * A * grad log pi,
    # and its value (w * A) falls as the step moves probability towards positive advantages
    obj = surr * (w / rho.detach().clamp_min(EPS))
    n = max(float(n_tokens), 1.0)
    loss = -(weight * obj).sum() / n
    if entropy is not None and cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * (weight * entropy).sum() / n
    live = weight > 0
    r = rho.detach()[live]
    stats = {
        "is_weight_mean": float(w[live].mean()) if live.any() else 0.0,
        "frac_truncated": float((r > cfg.is_clip).float().mean()) if live.any() and cfg.is_mode == "truncated" else 0.0,
        "frac_masked": float((w[live] == 0).float().mean()) if live.any() and cfg.is_mode == "masked" else 0.0,
        "frac_clipped": float(clipped[live].float().mean()) if live.any() else 0.0,
    }
    return loss, stats
