"""Small statistics shared by the benchmarks."""

from __future__ import annotations

import numpy as np


def pct(xs, q: float, method: str = "linear") -> float | None:
    """The q-th percentile (0-100) of xs; None for no data. method: numpy's (linear
    interpolation; "inverted_cdf" is the nearest rank, a value that occurred)."""
    return float(np.percentile(np.asarray(xs, np.float64), q, method=method)) if len(xs) else None
