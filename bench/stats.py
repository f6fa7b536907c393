"""Small statistics shared by the benchmarks."""
from __future__ import annotations

import numpy as np


def pct(xs, q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation) of xs; None for no data."""
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else None
