"""How a chunk is coded: its position codings, its flags, and the densities that choose among
them (measured crossovers: docs/benchmarks.md). codec.py documents the records they label."""
from __future__ import annotations

CHUNK = 1 << 22
NONE, GAP, BITMAP, DENSE, CLASSED = 0, 1, 2, 3, 4
GROUPED, NIBBLES = 1, 2  # chunk flags
GROUP_BELOW = 0.04   # density below which values are grouped by base exponent
CONTEXT_BELOW = 0.05  # density below which positions may be CLASSED (above: its per-change rank/select
                      # work costs more than the speed floors allow; GAP as in format 2)
BITMAP_FROM = 0.4    # density from which positions are a bitmap (below: gaps, about as small and
                     # faster to decode)
DENSE_FROM = 0.6     # density from which every element gets a value
