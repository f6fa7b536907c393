"""How a chunk is coded: its position codings, its flags, and the densities that choose among
them (measured crossovers: docs/benchmarks.md). codec.py documents the records they label."""

from __future__ import annotations

CHUNK = 1 << 22
NONE, GAP, BITMAP, DENSE, CLASSED = 0, 1, 2, 3, 4
GROUPED, NIBBLES = 1, 2  # chunk flags
GROUP_BELOW = 0.04  # density below which values are grouped by base exponent
CONTEXT_BELOW = 0.2  # density below which positions may be CLASSED (context=True): smaller than GAP
# up to here (GAP is 1.2-1.8 bits over the conditional bound at 6-15 % changed),
# for more rank/select CPU the denser the chunk (docs/benchmarks.md); denser
# chunks not measured: GAP as in format 2
BITMAP_FROM = 0.4  # density from which positions are a bitmap (below: gaps, about as small and
# faster to decode)
DENSE_FROM = 0.6  # density from which every element gets a value
