"""The values of KV rl-control that more than one process reads or writes. λ (key `lambda`) is an
ASCII decimal, finite and >= 0: written by calibrate-cost, `asyncrl up --lambda` and the trainer's
λ schedule, read by the trainer's task feeder and by scorers."""

from __future__ import annotations

import math


def parse_lambda(value: bytes | None) -> float:
    """λ as stored in KV rl-control/lambda; ValueError unless a finite decimal >= 0."""
    if value is None:
        raise ValueError("lambda key is empty (deleted)")
    try:
        lam = float(value.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"lambda value {value[:40]!r} is not a decimal number") from None
    if not math.isfinite(lam) or lam < 0:
        raise ValueError(f"lambda must be finite and >= 0, got {lam}")
    return lam


def format_lambda(lam: float) -> bytes:
    if not math.isfinite(lam) or lam < 0:
        raise ValueError(f"lambda must be finite and >= 0, got {lam}")
    return repr(float(lam)).encode("ascii")
