"""CLASSED position coding (format 3): the changed positions of a float chunk coded per class of
base magnitude (context.py picks the classes, context_jit.py runs rank/select when numba is
there): each class's changes as ranks among its members, gaps or a bitmap over the members by
that class's density, all classes' streams in one zstd frame (codec.py documents the record).
encode_classed returns None when one class would do (then GAP)."""

from __future__ import annotations

import numpy as np

from . import context as ctx
from . import context_jit as ctx_jit
from .compress import zc_blocks, zd
from .errors import DeltaError
from .modes import BITMAP_FROM, CLASSED, GROUP_BELOW, GROUPED
from .positions import ESC, check_gap_header, gap_streams, gaps_from, gaps_of, low_len, rice_parameter
from .values import encode_values, value_order


def encode_classed(b, pos, old, d, p: float, shift: int, alloc) -> list | None:
    """CLASSED record, or None when the chosen split has a single class. pos: the changed
    positions, old and d the base bits and differences there (position order; the class order
    permutes them into new arrays)."""
    if ctx_jit.enabled:
        ts = ctx.choose_thresholds(*ctx_jit.exponent_counts(b, old, shift), b.size, split=ctx_jit.split)
    else:
        ts = ctx.choose_thresholds(*ctx.exponent_counts(b, old, shift), b.size)
    if not ts:
        return None
    if ctx_jit.enabled:
        pos, ranks, bounds, sizes, old, d = ctx_jit.encode_ranks(b, pos, shift, ts, old, d)
        parts = [ranks[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    else:
        key = ctx.exponents(b, shift, alloc)
        classes = ctx.Classes(key, ts, alloc)
        ci = ctx.class_of(np.take(key, pos), ts)
        order = np.argsort(ci, kind="stable")
        pos, ci, old, d = np.take(pos, order), np.take(ci, order), np.take(old, order), np.take(d, order)
        bounds = np.searchsorted(ci, np.arange(len(ts) + 2))
        parts = [classes.rank(k, pos[lo:hi]) for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]
        sizes = classes.sizes
    streams = []
    entries = [_encode_class(r, sizes[k], streams) for k, r in enumerate(parts)]
    flags = 0
    if p < GROUP_BELOW:
        d = np.take(d, value_order(old, shift))
        flags = GROUPED
    vals, vflags = encode_values(d, alloc, nonzero=True)
    return [CLASSED, b.size, pos.size, flags | vflags, vals, ts, entries, zc_blocks(streams)]


_BITMAP_CLASS = -1  # class entry [m_k, -1, bitmap bytes]; [m_k, k] is GAP with Rice parameter k


def _encode_class(ranks: np.ndarray, size: int, streams: list) -> list:
    """A class's entry; its byte streams appended to `streams` (high bytes, low bits, overflow;
    or the bitmap)."""
    if not ranks.size:
        return [0]
    if ranks.size >= BITMAP_FROM * size:
        mask = np.zeros(size, bool)
        mask[ranks] = True
        bits = np.packbits(mask)
        streams.append(bits)
        return [int(ranks.size), _BITMAP_CLASS, int(bits.size)]
    g = gaps_of(ranks)
    k = rice_parameter(g)
    streams.extend(gap_streams(k, g))
    return [int(ranks.size), k]


def _class_entries(entries, count: int, what: str) -> tuple[list, int]:
    """Checked class entries -> ([(m_k, k or None for a bitmap, bitmap bytes)], the most bytes
    their streams can take)."""
    out, most = [], 0
    for i, e in enumerate(entries):
        w = f"{what} class {i}"
        if not isinstance(e, list) or not 1 <= len(e) <= 3:
            raise DeltaError(f"{w}: malformed class record")
        mk = int(e[0])
        if not 0 <= mk <= count:
            raise DeltaError(f"{w}: {mk} changes in a class of at most {count}")
        if len(e) == 1 and mk == 0:
            out.append((0, None, 0))
        elif len(e) == 2 and mk and 0 <= (k := int(e[1])) <= 32:
            check_gap_header(k, mk, count, w)
            out.append((mk, k, 0))
            most += mk + low_len(k, mk) + 8 * mk
        elif len(e) == 3 and mk and int(e[1]) == _BITMAP_CLASS and 0 < (nb := int(e[2])) <= (count + 7) // 8:
            out.append((mk, None, nb))
            most += nb
        else:
            raise DeltaError(f"{w}: malformed class record")
    return out, most


def _decode_classes(entries, raw, count: int, what: str) -> list:
    """-> per class (strictly increasing ranks, each < count, a bitmap's byte count or None) from
    the decompressed streams (every byte of them used)."""
    mv, off, out = memoryview(raw), 0, []

    def take(n: int, w: str):
        nonlocal off
        if off + n > len(mv):
            raise DeltaError(f"{w}: class streams end early")
        off += n
        return mv[off - n : off]

    for i, (mk, k, nb) in enumerate(entries):
        w = f"{what} class {i}"
        if mk == 0:
            out.append((np.zeros(0, np.int64), None))
        elif k is None:
            bits = np.unpackbits(np.frombuffer(take(nb, w), np.uint8))[:count]
            ranks = np.flatnonzero(bits.view(bool))
            if ranks.size != mk:
                raise DeltaError(f"{w}: bitmap has {ranks.size} changes, header says {mk}")
            out.append((ranks, nb))
        else:
            q8 = np.frombuffer(take(mk, w), np.uint8)
            low = take(low_len(k, mk), w)
            over = take(8 * int(np.count_nonzero(q8 == ESC)), w)
            out.append((gaps_from(k, q8, low, over, mk, count, w), None))
    if off != len(mv):
        raise DeltaError(f"{what}: {len(mv) - off} bytes beyond the class streams")
    return out


def decode_classed(rec, m: int, count: int, what: str, base_all, shift: int | None, itemsize: int, alloc):
    """-> positions in class order, base bits there."""
    if base_all is None or shift is None:
        raise DeltaError(f"{what}: positions coded by base magnitude, but no base or not a float dtype")
    base = base_all()
    if base.size != count or base.itemsize != itemsize:
        raise DeltaError(f"{what}: base chunk of {base.size} elements, record says {count}")
    ts = ctx.check_thresholds(rec[5], itemsize, shift, what)
    if not isinstance(rec[6], list) or len(rec[6]) != len(ts) + 1 or len(rec) != 8:
        raise DeltaError(f"{what}: {len(ts)} thresholds need {len(ts) + 1} class records")
    entries, most = _class_entries(rec[6], count, what)
    if not most:  # (zstd reads a bound of 0 as none)
        raise DeltaError(f"{what}: classed chunk without changes")
    if sum(e[0] for e in entries) != m:
        raise DeltaError(f"{what}: classes hold {sum(e[0] for e in entries)} changes, header says {m}")
    decoded = _decode_classes(entries, zd(rec[7], most, what + " class streams", exact=False), count, what)
    if ctx_jit.enabled:
        # class sizes come out of the select pass: until then ranks are only bounded by the
        # chunk (a bitmap by its bytes), and checked against the sizes after it
        ranks = [r for r, _ in decoded]
        pos, old, found, sizes = ctx_jit.select(base, shift, ts, ranks)
        for k, ((r, nb), f, size) in enumerate(zip(decoded, found, sizes)):
            if f != r.size:
                raise DeltaError(f"{what} class {k}: rank {int(r[f])} beyond the class of {size}")
            if nb is not None and nb != (size + 7) // 8:
                raise DeltaError(f"{what} class {k}: bitmap of {nb} bytes for a class of {size}")
        return pos, old
    classes = ctx.Classes(ctx.exponents(base, shift, alloc), ts, alloc)
    parts = []
    for k, ((r, nb), size) in enumerate(zip(decoded, classes.sizes)):
        if r.size and int(r[-1]) >= size:
            raise DeltaError(f"{what} class {k}: rank {int(r[-1])} beyond the class of {size}")
        if nb is not None and nb != (size + 7) // 8:
            raise DeltaError(f"{what} class {k}: bitmap of {nb} bytes for a class of {size}")
        parts.append(classes.select(k, r))
    pos = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return pos, np.take(base, pos)
