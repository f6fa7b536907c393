"""Coding of changed values: the difference of the raw integer bit patterns (wrapping at the
element width, so a bijection for any pair; a small float update moves the pattern by a few
units either way), zig-zag coded, then zstd'd as nibble pairs (changed values: codes < 16 two a
byte, larger ones in an overflow stream) or as byte planes (dense chunks, or when many codes are
large). In sparse chunks values may be grouped by the exponent of their base value first
(value_order: the decoder has the base, so this is free on the wire and saves bits)."""

from __future__ import annotations

import numpy as np

from . import sparse_jit
from .bits import SIGNED_INT, UNSIGNED_INT, fresh, from_planes, planes, unzigzag, unzigzag_small, zigzag
from .compress import zc, zd
from .errors import DeltaError
from .modes import NIBBLES
from .positions import positions


def encode_values(d: np.ndarray, alloc=fresh, nonzero: bool = False) -> tuple:
    """Signed differences (wrapping) -> (wire field, flags). The zig-zag codes as zstd'd byte
    planes; or, when every difference is nonzero (the changed values of a sparse chunk) and at
    most a quarter of the codes are >= 16: NIBBLES, two codes a byte, 0 marking a code kept in an
    overflow stream (byte planes, in order). zstd codes the nibble-pair bytes near their entropy,
    while the low-entropy low plane draws chance matches (slower and larger; docs/benchmarks.md)."""
    z = zigzag(d, alloc)
    m = z.size
    if nonzero and m:
        lt = np.less(z, 16, out=alloc("nib.small", m, bool))
        over_n = m - int(np.count_nonzero(lt))
        if over_n * 4 <= m:
            me = m + (m & 1)
            nib = alloc("nib", me, np.uint8)
            nib[:m] = z  # truncating; then 0 where the code does not fit
            np.multiply(nib[:m], lt, out=nib[:m])
            nib[m:] = 0
            pairs = nib.view("<u2")  # code 2i in the low byte, 2i+1 in the high byte
            lo = np.bitwise_and(pairs, 0xF, out=alloc("nib.lo", me // 2, "<u2"))
            lo |= np.bitwise_and(
                np.right_shift(pairs, 4, out=alloc("nib.hi", me // 2, "<u2")),
                0xF0,
                out=alloc("nib.hi", me // 2, "<u2"),
            )
            packed = alloc("nib.packed", me // 2, np.uint8)
            packed[...] = lo
            over = b""
            if over_n:
                esc = np.logical_not(lt, out=lt)
                over = zc(planes(np.take(z, positions(esc, over_n, alloc))))
            return [zc(packed), over], NIBBLES
    return zc(planes(z, alloc)), 0


def _decode_nibbles(field, itemsize: int, m: int, what: str, alloc) -> np.ndarray:
    if not (isinstance(field, list) and len(field) == 2):
        raise DeltaError(f"{what}: malformed nibble-coded values")
    me = m + (m & 1)
    packed = np.frombuffer(zd(field[0], me // 2, what), np.uint8)
    if sparse_jit.enabled:  # one compiled pass: values, and where the escapes are
        d = alloc("uz.wide" if itemsize > 1 else "uz", m, SIGNED_INT[itemsize])
        esc_at = alloc("nib.escat", m, np.int64)
        over_n = sparse_jit.nibbles(packed, d, esc_at)
        esc_at = esc_at[:over_n]
    else:
        pairs = alloc("nib.pairs", me // 2, "<u2")
        pairs[...] = packed
        hi = np.left_shift(pairs, 4, out=alloc("nib.hi", me // 2, "<u2"))
        hi &= 0xF00
        pairs &= 0xF
        pairs |= hi
        codes = pairs.view(np.uint8)[:m]
        d = unzigzag_small(codes, itemsize, alloc)
        esc = np.equal(codes, 0, out=alloc("nib.esc", m, bool))
        over_n = int(np.count_nonzero(esc))
        esc_at = positions(esc, over_n, alloc) if over_n else None
    if over_n:
        z = from_planes(zd(field[1], over_n * itemsize, what + " overflow"), itemsize, over_n)
        d[esc_at] = unzigzag(z)
    elif len(field[1]):
        raise DeltaError(f"{what}: overflow stream without escapes")
    return d


def decode_values(buf, itemsize: int, m: int, what: str, alloc=fresh, flags: int = 0) -> np.ndarray:
    """-> m signed differences (in `alloc`'s "uz.wide" buffer, or "uz" for 1-byte dtypes)."""
    if flags & NIBBLES:
        return _decode_nibbles(buf, itemsize, m, what, alloc)
    raw = np.frombuffer(zd(buf, m * itemsize, what), np.uint8)
    if itemsize == 1:
        return unzigzag(raw, alloc)
    hi = raw[m:]
    wide = np.flatnonzero(np.not_equal(hi, 0, out=alloc("wide", hi.size, bool)))  # codes >= 256: rare
    if wide.size * 8 > m:
        out = alloc("uz.wide", m, SIGNED_INT[itemsize])
        out[...] = unzigzag(from_planes(raw, itemsize, m))
        return out
    d = unzigzag_small(raw[:m], itemsize, alloc)  # every code from its low byte, then the wide ones fixed
    if wide.size:
        idx = wide if itemsize == 2 else np.unique(wide % m)
        ut = UNSIGNED_INT[itemsize]
        z = raw[idx].astype(ut)
        for i in range(1, itemsize):
            z |= raw[i * m + idx].astype(ut) << ut(8 * i)
        d[idx] = unzigzag(z)
    return d


def value_order(base_at_pos: np.ndarray, shift: int | None) -> np.ndarray | None:
    """Permutation grouping changed values by the exponent of their base value: how many units an
    update moves depends on the exponent, so zstd's per-block Huffman tables fit each group
    (bits saved on AdamW updates: docs/benchmarks.md). The decoder has the base, so it is free."""
    if shift is None or base_at_pos.size < 2:
        return None
    exp = (base_at_pos >> base_at_pos.dtype.type(shift)).astype(
        np.uint8
    )  # exponent (+ sign): 8-bit radix sort
    return sparse_jit.group_order(exp) if sparse_jit.enabled else np.argsort(exp, kind="stable")
