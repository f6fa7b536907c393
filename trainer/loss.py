"""Group-relative advantage and the token-level off-policy policy-gradient loss (+ KL to a reference).

Advantage (GRPO-style). For a group g of completions of one task with rewards r_i, over its
live members only (a sample dropped as stale is out of its group's baseline too):
    adv_norm = "mean" (default, Dr. GRPO):  A_i =  r_i - mean_g
    adv_norm = "std":                       A_i = (r_i - mean_g) / (std_g + eps)   (population std)
"std" rescales every group to unit spread: in a group whose success is uniform, rewards are
1 - lambda*L and the std is lambda*std(L), so lambda cancels and length alone gets a full-scale
advantage. "mean" keeps the reward's own scale: such a group's advantages scale with lambda.
A group whose live rewards are all equal (or with one live member) has A = 0 for each member.

Loss. Tokens of every sample in the batch are packed into one flat vector. With
rho_t = pi_theta(y_t) / mu(y_t) (mu = the behaviour logprob the worker shipped) and the log-ratio
clamped to +-20 before any exponent (policy.clamp_log_ratio, the one place):
    is_mode = "truncated": w_t = min(rho_t, C)                         (detached)
    is_mode = "masked":    w_t = rho_t if 1/C <= rho_t <= C else 0    (detached; 0 = rejected)
    is_mode = "none":      w_t = 1
    per-token objective  o_t = w_t A_t (1 + log pi_t - sg(log pi_t))
                         (value w_t A_t, gradient w_t A_t grad log pi: no exponent on the gradient path)
    KL (kl_coef > 0)     q_t = w_t (k3_t + sg(d_t) (log pi_t - sg(log pi_t))),  d_t = log pi_t - log ref_t,
                         k3_t = exp(-d_t) + d_t - 1 (clamped like a log-ratio)
    loss = -sum_t s_t o_t / N - entropy_coef sum_t s_t H_t / N + kl_coef sum_t s_t q_t / N
s_t is the sample weight (0 for dropped stale samples, stale_weight^k when down-weighted) times
"kept" (w_t != 0), and N the number of kept tokens over the whole (global, all ranks) batch: a
rejected token is out of the numerator and the denominator, so the gradient does not shrink with
the rejected fraction (the learner divides by the global kept count once all passes are done).

The KL term is KL(pi || ref), estimated on tokens sampled from mu: E_mu[w k3] = E_pi[k3] =
KL(pi || ref) and E_mu[grad q] = sum_y pi(y) (log pi(y) - log ref(y)) grad log pi(y) = grad KL(pi || ref)
(exact with w = rho; tested on an enumerable vocabulary). k3 alone, differentiated, would give
grad KL(ref || pi) and no importance weight.

No PPO clip: with one optimizer step per batch, a ratio against the proximal policy (this step's
own weights) is 1 wherever the gradient is taken, so it can never be a trust region, and a ratio
against mu only masks tokens by staleness (is_mode = "masked" does that, explicitly).
"""

from __future__ import annotations

import torch

from policy import clamp_log_ratio, masked_is_weight, truncated_is_weight

from .sections import LossConfig  # noqa: F401  ([trainer.loss], taken whole here)

EPS = 1e-6


def group_advantages(
    rewards: torch.Tensor, group: torch.Tensor, norm: str = "mean", live: torch.Tensor | None = None
) -> torch.Tensor:
    """rewards [N] float, group [N] long in 0..G-1 -> advantages [N] (vectorised by scatter).
    live [N] bool (None: all): only live members form their group's baseline; others get A = 0."""
    if rewards.shape != group.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group {tuple(group.shape)} must be equal 1-d")
    if norm not in ("mean", "std"):
        raise ValueError(f"unknown adv_norm {norm!r}")
    live = torch.ones_like(group, dtype=torch.bool) if live is None else live.bool()
    if live.shape != group.shape:
        raise ValueError(f"live {tuple(live.shape)} must match group {tuple(group.shape)}")
    on = live.double()
    r = torch.where(live, rewards.double(), torch.zeros((), dtype=torch.float64))
    G = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(G, dtype=torch.float64).index_add_(0, group, on)
    mean = torch.zeros(G, dtype=torch.float64).index_add_(0, group, r) / count.clamp_min(1)
    centred = (r - mean[group]) * on
    alone = count[group] < 2  # one live member: no baseline, no signal
    if norm == "mean":
        return torch.where(alone, torch.zeros_like(centred), centred).float()
    var = torch.zeros(G, dtype=torch.float64).index_add_(0, group, centred**2) / count.clamp_min(1)
    std = var.sqrt()[group]
    adv = torch.where((std > EPS) & ~alone, centred / (std + EPS), torch.zeros_like(centred))
    return adv.float()


def is_weights(logp: torch.Tensor, behav: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Detached importance weights pi/mu per token per the configured correction."""
    log_ratio = clamp_log_ratio(logp.detach() - behav)
    if cfg.is_mode == "truncated":
        return truncated_is_weight(log_ratio, cfg.is_clip)
    if cfg.is_mode == "masked":
        return masked_is_weight(log_ratio, cfg.is_clip)
    if cfg.is_mode == "none":
        return torch.ones_like(log_ratio)
    raise ValueError(f"unknown is_mode {cfg.is_mode!r}")


def pg_loss(
    logp: torch.Tensor,
    behav: torch.Tensor,
    adv: torch.Tensor,
    weight: torch.Tensor,
    n_tokens: float,
    cfg: LossConfig,
    entropy: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Token-level loss over packed tokens [T], divided by n_tokens; returns (loss, stats).
    stats["kept"]: live tokens not rejected by the IS correction (the caller's N). See module doc."""
    if not (logp.shape == behav.shape == adv.shape == weight.shape):
        raise ValueError("logp, behav, adv, weight must have the same shape [T]")
    # a non-finite behaviour logprob is garbage, not "very off-policy": its weight is NaN, so a live
    # one makes the loss NaN and the step is skipped (the clamp below would otherwise hide -inf)
    w = torch.where(torch.isfinite(behav), is_weights(logp, behav, cfg), torch.full_like(behav, float("nan")))
    # a NaN weight counts as kept: it must reach the loss (and skip the step), not vanish
    s = torch.where(weight > 0, weight, torch.zeros_like(weight)) * (w != 0)
    live = s > 0
    # coefficients are 0 (never NaN) off the live tokens, so a dropped token cannot poison anything
    coef = torch.where(live, s * w, torch.zeros_like(w))
    centred = logp - logp.detach()  # 0 in value, grad log pi in gradient: no exponent on that path
    n = max(float(n_tokens), 1.0)
    loss = -(coef * torch.where(live, adv, torch.zeros_like(adv)) * (1 + centred)).sum() / n
    if entropy is not None and cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * torch.where(live, s * entropy, torch.zeros_like(entropy)).sum() / n
    stats: dict = {"kept": float(live.sum())}
    if ref is not None:
        d = logp.detach() - ref
        k3 = clamp_log_ratio(-d).exp() + clamp_log_ratio(d) - 1
        if cfg.kl_coef:
            q = coef * (k3 + d * centred)
            loss = loss + cfg.kl_coef * torch.where(live, q, torch.zeros_like(q)).sum() / n
        stats["kl_sum"] = float(torch.where(live, s * w * k3, torch.zeros_like(k3)).sum())
        stats["kl_weight"] = float(torch.where(live, s * w, torch.zeros_like(k3)).sum())
    on, mode = weight > 0, cfg.is_mode
    rho = clamp_log_ratio(logp.detach() - behav).exp()[on]
    stats.update(
        {
            "is_weight_mean": float(w[on].mean()) if on.any() else 0.0,
            "frac_truncated": float((rho > cfg.is_clip).float().mean())
            if on.any() and mode == "truncated"
            else 0.0,
            "frac_masked": float((w[on] == 0).float().mean()) if on.any() and mode == "masked" else 0.0,
        }
    )
    return loss, stats
