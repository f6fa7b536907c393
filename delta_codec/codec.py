"""One chunk's record: which coding its positions get, and its encode / decode (pure numpy).

A chunk is CHUNK consecutive elements of one tensor (4 Mi: large enough that the ~50 numpy
calls per chunk are few, so two threads rarely wait on each other's GIL hand-offs; see
docs/benchmarks.md; its temporaries live in per-worker Scratch buffers). Its changed positions are
coded one of three ways, chosen from the chunk's density before anything is built (measured
crossovers; the sizes are close there):
  GAP    gaps between changes, Rice-coded: k raw low bits + the high part as bytes, zstd'd.
         k = 0 up to a mean gap of 32 (the gaps themselves as bytes: zstd's Huffman stage codes
         them near their entropy, and decoding is one zstd call and one cumsum)
  BITMAP one bit per element, zstd'd (40-60 % changed)
  DENSE  no positions at all: every element gets a value (>= 60 % changed)
  CLASSED (format 3, encode_delta(context=True); float dtypes below CONTEXT_BELOW) positions coded
         per class of base magnitude (context.py): each class's changes as ranks among its members,
         gaps or a bitmap over the members by that class's density. Chosen when the estimated saving
         beats the classes' cost; otherwise GAP.
Values are the difference of the raw integer bit patterns (wrapping at the element width, so a
bijection for any pair; a small float update moves the pattern by a few units either way),
zig-zag coded, then zstd'd as nibble pairs (changed values: codes < 16 two a byte, larger ones
in an overflow stream) or as byte planes (dense chunks, or when many codes are large). In
sparse chunks (< GROUP_BELOW changed) values are grouped by the exponent of their base value
first (the decoder has the base, so this is free on the wire and saves bits); denser chunks skip
it (a sort per side).

Chunk record (a list; record.py splits it into a msgpack head, in the container header, and its
byte fields, the tensor's record body):
  [NONE, count, 0]
  [GAP, count, m, flags, values, k, high bytes (zstd), low bits, overflow (<u8)]
  [BITMAP, count, m, flags, values, bitmap (zstd)]
  [DENSE, count, m, 0, values of all count elements (byte planes)]
  [CLASSED, count, m, flags, values, [t_1 > ... > t_K], [class 0, ..., class K], streams]
    class: [m_k, k] (gaps, Rice parameter k) | [m_k, -1, bitmap bytes] | [0] (no changes);
    streams: ONE zstd frame (a block per stream, compress.zc_blocks) holding, class by class,
    high bytes (m_k), low bits and overflow (lengths follow from m_k, k and the escapes in the
    high bytes) or the bitmap: a class costs a few header bytes, not three fields and a frame
    (format 4; format 3 had a frame per class). Values in class order (class 0's changes by
    position, then class 1's ...)
flags: GROUPED (values ordered by base exponent), NIBBLES (values as [zstd(codes < 16, two a
byte; 0 = in the overflow), zstd(byte planes of the overflow codes)], else zstd(byte planes)).

The parts: modes.py (codings, flags, thresholds), values.py, positions.py (gaps, Rice, bitmap),
classed.py (CLASSED, with context.py / context_jit.py), compress.py (zstd).
"""

from __future__ import annotations

import numpy as np

from . import context as ctx
from . import sparse_jit
from .bits import fresh
from .classed import decode_classed, encode_classed
from .compress import zd
from .errors import DeltaError
from .modes import (
    BITMAP,
    BITMAP_FROM,
    CLASSED,
    CONTEXT_BELOW,
    DENSE,
    DENSE_FROM,
    GAP,
    GROUP_BELOW,
    GROUPED,
    NIBBLES,
    NONE,
)
from .positions import decode_gaps, encode_bitmap, encode_gaps, gaps_of, positions, rice_parameter
from .values import decode_values, encode_values, value_order


def encode_chunk(
    b: np.ndarray, n: np.ndarray, shift: int | None = None, alloc=fresh, context: bool = True
) -> tuple[list, int]:
    """-> (wire record, changed count). b, n: same-size signed-int views of base and new bits;
    shift: mantissa bits of a float dtype (value grouping and position context), None otherwise;
    alloc: where temporaries live (a Scratch reuses them across chunks); context: False codes
    positions without the base (format 2's chunk coding, kept for comparisons)."""
    count = b.size
    if sparse_jit.enabled:  # (positions, base bits there and differences in one pass)
        pos, old, d = sparse_jit.diff(b, n, alloc)
        m = pos.size
    else:
        mask = np.not_equal(b, n, out=alloc("mask", count, bool))
        m = int(np.count_nonzero(mask))
    if m == 0:
        return [NONE, count, 0], 0
    p = m / count
    if p >= DENSE_FROM:
        return [
            DENSE,
            count,
            m,
            0,
            encode_values(np.subtract(n, b, out=alloc("d", count, b.dtype)), alloc)[0],
        ], m
    if not sparse_jit.enabled:
        pos = positions(mask, m, alloc)
        old = np.take(b, pos, out=alloc("old", m, b.dtype))  # (take: faster than fancy indexing)
        d = np.take(n, pos, out=alloc("d", m, b.dtype))
        d -= old  # wraps at the element width: a bijection for any pair
    if context and shift is not None and p < CONTEXT_BELOW and m >= ctx.MIN_CHANGES:
        rec = encode_classed(b, pos, old, d, p, shift, alloc)
        if rec is not None:
            return rec, m
    flags = 0
    if p < GROUP_BELOW and shift is not None and m > 1:
        d = np.take(d, value_order(old, shift), out=alloc("old", m, b.dtype))
        flags = GROUPED
    vals, vflags = encode_values(d, alloc, nonzero=True)
    flags |= vflags
    if p >= BITMAP_FROM:
        return [BITMAP, count, m, flags, vals, encode_bitmap(pos, count)], m
    g = gaps_of(pos, alloc)
    del pos
    k = rice_parameter(g)
    return [GAP, count, m, flags, vals, k, *encode_gaps(None, k, g, alloc)], m


def chunk_header(rec, what: str) -> tuple[int, int, int]:
    try:
        mode, count, m = int(rec[0]), int(rec[1]), int(rec[2])
    except (TypeError, ValueError, IndexError):
        raise DeltaError(f"{what}: malformed chunk record") from None
    if not 0 <= m <= count:
        raise DeltaError(f"{what}: {m} changes in a chunk of {count}")
    return mode, count, m


def decode_chunk(
    rec, itemsize: int, what: str, base_at=None, shift: int | None = None, alloc=fresh, base_all=None
):
    """-> (positions or None for dense, signed differences in position order (CLASSED: in the
    positions' order), element count, base bits at the positions or None). Validates
    everything. base_at(positions) -> base bits there (needed to undo value grouping; without
    it a grouped chunk is refused); base_all() -> the chunk's base bits (needed for CLASSED).
    With a Scratch as `alloc`, positions and differences live in it: use them before the next
    chunk."""
    mode, count, m = chunk_header(rec, what)
    old = None
    try:
        if mode == NONE:
            if m:
                raise DeltaError(f"{what}: {m} changes in an unchanged chunk")
            return np.zeros(0, np.int64), np.zeros(0, np.int8), count, None
        flags = int(rec[3])
        if flags & ~(0 if mode == DENSE else GROUPED | NIBBLES):
            raise DeltaError(f"{what}: unknown chunk flags {flags:#x}")
        if mode == DENSE:
            return None, decode_values(rec[4], itemsize, count, what, alloc), count, None
        if mode == GAP:
            pos = decode_gaps(int(rec[5]), rec[6], rec[7], rec[8], m, count, what, alloc)
        elif mode == BITMAP:
            mask = np.unpackbits(np.frombuffer(zd(rec[5], (count + 7) // 8, what + " bitmap"), np.uint8))[
                :count
            ]
            pos = np.flatnonzero(mask.view(bool))  # (bool nonzero: much faster than uint8's)
            if pos.size != m:
                raise DeltaError(f"{what}: bitmap has {pos.size} changes, header says {m}")
        elif mode == CLASSED:
            pos, old = decode_classed(rec, m, count, what, base_all, shift, itemsize, alloc)
        else:
            raise DeltaError(f"{what}: unknown position coding {mode}")
        d = decode_values(rec[4], itemsize, m, what + " values", alloc, flags)
    except DeltaError:
        raise
    except (TypeError, ValueError, IndexError):
        raise DeltaError(f"{what}: malformed chunk record") from None
    if flags & GROUPED:
        if old is None and (base_at is None or shift is None):
            raise DeltaError(f"{what}: values grouped by exponent, but no base or not a float dtype")
        if old is None:
            old = base_at(pos)
        if sparse_jit.enabled and old.size > 1 and old.dtype == d.dtype:
            d = sparse_jit.ungroup(old, shift, d)
        elif (perm := value_order(old, shift)) is not None:
            out = np.empty_like(d)
            out[perm] = d
            d = out
    return pos, d, count, old
