"""reward = success − λ·cost − overlong shaping. Pure functions: the scorer process and the
calibration share them, and tests check them without a bus."""

from __future__ import annotations

import math

COST_UNITS = ("tokens", "wall_s", "tool_calls")
EPISODE_REWARDS = ("fraction", "resolved")  # an episode's score: tests passing, or all of them


def overlong_penalty(n_tokens: int, max_tokens: int, buffer: int, scale: float) -> float:
    """Soft penalty that ramps linearly from 0 to `scale` over the last `buffer` tokens before
    `max_tokens` (completions that hit the limit get the full `scale`). buffer 0 = off."""
    if buffer <= 0 or max_tokens <= 0:
        return 0.0
    start = max_tokens - buffer
    return scale * min(1.0, max(0.0, (n_tokens - start) / buffer))


def rollout_cost(unit: str, cost_tokens: int, wall_s: float, tool_calls: int) -> float:
    """Cost of one rollout in `unit`: model tokens (an episode's observation tokens are not the
    policy's doing and are not counted), tool calls (commands an episode ran, or a verifier's),
    wall seconds (an episode's from reset to score, commands and generation included)."""
    if unit not in COST_UNITS:
        raise ValueError(f"cost_unit must be one of {COST_UNITS}, got {unit!r}")
    return float({"tokens": cost_tokens, "wall_s": wall_s, "tool_calls": tool_calls}[unit])


def compute_reward(success: float, cost: float, lam: float, shaping: float = 0.0) -> tuple[float, float]:
    """(penalty, reward) for a verified completion. A ValueError names the bad input (NaN, inf,
    out of range; `cost` is the rollout's cost_tokens, wall_s or tool_calls): bad input, which the
    scorer parks at once rather than retrying."""
    for name, ok in (
        ("success", 0.0 <= success <= 1.0),
        ("cost", math.isfinite(cost) and cost >= 0),
        ("lambda", math.isfinite(lam)),
        ("shaping", math.isfinite(shaping)),
    ):
        if not ok:
            raise ValueError(
                f"bad reward input {name}: success={success} cost={cost} lambda={lam} shaping={shaping}"
            )
    penalty = lam * cost + shaping
    if not math.isfinite(penalty):
        raise ValueError(f"penalty lambda*cost+shaping = {penalty} is not finite (lambda={lam} cost={cost})")
    return penalty, success - penalty
