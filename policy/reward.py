"""How a reward is computed: every formula, once. Pure functions on floats and float64 arrays
(no torch, no I/O); the scorer prices each member with them, the trainer turns a group's parts
into the rewards it trains on with them, and the trainer's λ schedule moves λ with them.

    score     what the verifier or the episode scored, in [0, 1]: a completion's success, an
              episode's share of passing tests ("fraction") or 1 iff all pass ("resolved")
    cost      rollout_cost: model tokens, wall seconds or tool calls (`[scorer.reward] cost_unit`)
    shaping   overlong_shaping: a soft length penalty near max_tokens (0 for an episode)
    λ         the group's: stamped on its task when fed (ramp_lambda, budget_step move it)
    price     the member alone (the scorer, Scored.reward): reward = score − (λ·cost + shaping)
    trained   trained_rewards, per `[trainer.cost] penalty` mode, over a group (the trainer):
      linear           r_i = the member's price, unchanged
      success_only     r_i = score_i − shaping_i − λ_i·c_i·[success_i]  (a failed member pays no
                       cost: a group where all fail has no cost gradient; cost ranks working answers)
      group_normalised r_i = score_i − shaping_i − s_i·clamp(z_i, −1, 1),  z_i = (c_i − mean_g c) / std_g c,
                       s_i = min(λ_i·mean_g c, cap): the linear penalty's scale at the group's mean
                       cost, its spread bounded by 2·cap < 1, the gap between success and failure
Group statistics are over live members only (as the advantage's baseline is).
"""

from __future__ import annotations

import math

import numpy as np

COST_UNITS = ("tokens", "wall_s", "tool_calls")
EPISODE_REWARDS = ("fraction", "resolved")  # an episode's score: tests passing, or all of them
PENALTIES = ("linear", "success_only", "group_normalised")
EPS = 1e-6


# -- a member's parts ----------------------------------------------------------------------------
def episode_score(result: dict, mode: str) -> tuple[float, bool]:
    """(score, resolved) of a scored episode (EpisodeResult.to_dict()) in reward mode `mode`:
    "fraction" the share of its tests that pass, "resolved" 1 when all of them pass, else 0."""
    if mode not in EPISODE_REWARDS:
        raise ValueError(f"reward mode must be one of {EPISODE_REWARDS}, got {mode!r}")
    score = float(result["reward"])
    resolved = result.get("resolved")
    resolved = score >= 1.0 if not isinstance(resolved, bool) else resolved
    return (1.0 if resolved else 0.0) if mode == "resolved" else score, resolved


def rollout_cost(unit: str, cost_tokens: int, wall_s: float, tool_calls: int) -> float:
    """Cost of one rollout in `unit`: model tokens (an episode's observation tokens are not the
    policy's doing and are not counted), tool calls (commands an episode ran, or a verifier's),
    wall seconds (an episode's from reset to score, commands and generation included)."""
    if unit not in COST_UNITS:
        raise ValueError(f"cost_unit must be one of {COST_UNITS}, got {unit!r}")
    return float({"tokens": cost_tokens, "wall_s": wall_s, "tool_calls": tool_calls}[unit])


def overlong_shaping(n_tokens: int, max_tokens: int, buffer: int, scale: float) -> float:
    """Soft penalty that ramps linearly from 0 to `scale` over the last `buffer` tokens before
    `max_tokens` (completions that hit the limit get the full `scale`). buffer 0 = off."""
    if buffer <= 0 or max_tokens <= 0:
        return 0.0
    start = max_tokens - buffer
    return scale * min(1.0, max(0.0, (n_tokens - start) / buffer))


def price(score: float, cost: float, lam: float, shaping: float = 0.0) -> tuple[float, float]:
    """(penalty, reward) of one member alone: penalty = λ·cost + shaping, reward = score − penalty
    (the linear mode's trained reward). A ValueError names the bad input (NaN, inf, out of range):
    bad input, which the scorer parks at once rather than retrying."""
    for name, ok in (
        ("success", 0.0 <= score <= 1.0),
        ("cost", math.isfinite(cost) and cost >= 0),
        ("lambda", math.isfinite(lam)),
        ("shaping", math.isfinite(shaping)),
    ):
        if not ok:
            raise ValueError(
                f"bad reward input {name}: success={score} cost={cost} lambda={lam} shaping={shaping}"
            )
    penalty = lam * cost + shaping
    if not math.isfinite(penalty):
        raise ValueError(f"penalty lambda*cost+shaping = {penalty} is not finite (lambda={lam} cost={cost})")
    return penalty, score - penalty


# -- a group's trained rewards -------------------------------------------------------------------
def trained_rewards(
    mode: str,
    reward,
    score,
    success,
    cost,
    lam,
    shaping,
    group,
    cap: float = 0.25,
    live=None,
) -> np.ndarray:
    """Per-member rewards [N] float64 under penalty `mode` (module docstring); every input is [N]
    (group: ints 0..G-1; live: bools, None = all). `reward` is each member's price (Scored.reward),
    which the linear mode trains on as it is; the other modes start from score − shaping."""
    if mode not in PENALTIES:
        raise ValueError(f"unknown penalty {mode!r} (one of {PENALTIES})")
    if mode == "linear":
        return np.asarray(reward, dtype=np.float64)
    base = np.asarray(score, dtype=np.float64) - np.asarray(shaping, dtype=np.float64)
    linear = np.asarray(lam, dtype=np.float64) * np.asarray(cost, dtype=np.float64)
    if mode == "success_only":
        return base - linear * (np.asarray(success, dtype=np.float64) >= 1.0)
    return base - group_normalised_penalty(cost, lam, group, cap, live)


def group_normalised_penalty(cost, lam, group, cap: float = 0.25, live=None) -> np.ndarray:
    """[N] min(λ·mean_g c, cap)·clamp(z, −1, 1): each member's cost penalty under group_normalised,
    its group's mean and spread over live members only (vectorised: one bincount per statistic)."""
    c, lam = np.asarray(cost, dtype=np.float64), np.asarray(lam, dtype=np.float64)
    group = np.asarray(group, dtype=np.int64)
    on = (
        np.ones(c.shape, dtype=np.float64)
        if live is None
        else np.asarray(live, dtype=bool).astype(np.float64)
    )
    G = int(group.max()) + 1 if group.size else 0
    count = np.maximum(np.bincount(group, weights=on, minlength=G), 1.0)
    mean = (np.bincount(group, weights=c * on, minlength=G) / count)[group]
    dev = (c - mean) * on
    std = np.sqrt(np.bincount(group, weights=dev**2, minlength=G) / count)[group]
    z = np.clip(np.where(std > EPS, dev / (std + EPS), 0.0), -1.0, 1.0)
    return np.minimum(lam * mean, cap) * z


# -- λ over versions (the trainer's `[trainer.cost] schedule`) ----------------------------------
def ramp_lambda(target: float, versions: int, version: int) -> float:
    """ramp: λ_v = target · min(1, v / versions): success is learnt before cost."""
    return target * min(1.0, max(version, 0) / versions)


def budget_step(lam: float, tokens_per_answer: float, budget_tokens: float, lr: float) -> float:
    """budget: one dual-ascent step: up when answers are longer than the budget, down (to 0 at
    least) under it."""
    return max(0.0, lam + lr * (tokens_per_answer / budget_tokens - 1.0))
