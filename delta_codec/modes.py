"""How a chunk is coded: its position codings, its flags, and the densities that choose among
them (measured crossovers: docs/benchmarks.md). codec.py documents the records they label."""
from __future__ import annotations

CHUNK = 1 << 22
NONE, GAP, BITMAP, DENSE, CLASSED = 0, 1, 2, 3, 4
GROUPED, NIBBLES = 1, 2  # chunk flags
GROUP_BELOW = 0.04   # density below which values are grouped by base exponent
CONTEXT_BELOW = 0.2  # density below which positions may be CLASSED (context=True): at 6 % and 15 %
                     # changed it is ~23 % smaller than GAP (0.1-0.2 bit over the conditional bound,
                     # GAP 1.2-1.8), for ~2-3x format 2's CPU per element at 15 % (~1.5x at 1-6 %;
                     # docs/benchmarks.md); denser chunks were not measured: GAP as in format 2
BITMAP_FROM = 0.4    # density from which positions are a bitmap (below: gaps, about as small and
                     # faster to decode)
DENSE_FROM = 0.6     # density from which every element gets a value
