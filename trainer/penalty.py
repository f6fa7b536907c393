"""How the cost penalty enters a group's rewards (TrainerConfig.penalty), before the advantage.

The scorer publishes reward = score - λ·cost - shaping with its parts (Scored: success, cost,
lambda_, penalty = λ·cost + shaping); here the trainer, which knows the group, may re-apply λ:
    linear           r_i = score_i - shaping_i - λ_i·c_i              (the scorer's reward, unchanged)
    success_only     r_i = score_i - shaping_i - λ_i·c_i·[success_i]  (a failed member pays nothing: a
                     group where all fail has no cost gradient; cost only ranks answers that work)
    group_normalised r_i = score_i - shaping_i - s_i·clamp(z_i, -1, 1),  z_i = (c_i - mean_g c) / std_g c,
                     s_i = min(λ_i·mean_g c, cap): the penalty's scale is the linear one at the group's
                     mean cost, its spread is bounded by 2·cap < 1, the gap between success and failure
Group statistics are taken over live members only (as the baseline is). Vectorised (scatter).
"""

from __future__ import annotations

import torch

from .config import PENALTIES

EPS = 1e-6


def apply_penalty(
    reward: torch.Tensor,
    success: torch.Tensor,
    cost: torch.Tensor,
    lam: torch.Tensor,
    penalty: torch.Tensor,
    group: torch.Tensor,
    mode: str = "linear",
    cap: float = 0.25,
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sample rewards [N] under `mode` (see the module docstring); every input is [N] (group long).
    Pass float64 rewards: (r + λ·c) recovers the score exactly only in the precision r was made in."""
    if mode not in PENALTIES:
        raise ValueError(f"unknown penalty {mode!r} (one of {PENALTIES})")
    if mode == "linear":
        return reward
    r, c, lam = reward.double(), cost.double(), lam.double()
    linear = lam * c
    base = r + linear  # score - shaping: the reward without its λ·cost
    if mode == "success_only":
        return (base - linear * (success >= 1.0)).to(reward.dtype)
    live = torch.ones_like(group, dtype=torch.bool) if live is None else live.bool()
    on = live.double()
    G = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(G, dtype=torch.float64).index_add_(0, group, on)
    mean = torch.zeros(G, dtype=torch.float64).index_add_(0, group, c * on) / count.clamp_min(1)
    dev = (c - mean[group]) * on
    var = torch.zeros(G, dtype=torch.float64).index_add_(0, group, dev**2) / count.clamp_min(1)
    std = var.sqrt()[group]
    z = torch.where(std > EPS, dev / (std + EPS), torch.zeros_like(dev)).clamp(-1.0, 1.0)
    scale = (lam * mean[group]).clamp(max=cap)
    return (base - scale * z).to(reward.dtype)
