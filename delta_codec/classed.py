"""CLASSED position coding (format 3): the changed positions of a float chunk coded per class of
base magnitude (context.py picks the classes, context_jit.py runs rank/select when numba is
there): each class's changes as ranks among its members, gaps or a bitmap over the members by
that class's density. encode_classed returns None when one class would do (then GAP)."""
from __future__ import annotations

import numpy as np

from . import context as ctx
from . import context_jit as ctx_jit
from .compress import zc, zd
from .errors import DeltaError
from .modes import BITMAP, BITMAP_FROM, CLASSED, GAP, GROUP_BELOW, GROUPED
from .positions import decode_gaps, encode_gaps, gaps_of, rice_parameter
from .values import encode_values, value_order


def encode_classed(b, n, pos, p: float, shift: int, alloc) -> list | None:
    """CLASSED record, or None when the chosen split has a single class."""
    sample = ctx.exponents(b[::ctx.SAMPLE_STRIDE], shift)
    at = ctx.exponents(np.take(b, pos), shift)
    ts = ctx.choose_thresholds(sample, b.size, at)
    if not ts:
        return None
    if ctx_jit.enabled:
        pos, ranks, bounds, sizes = ctx_jit.encode_ranks(b, pos, shift, ts)
        parts = [ranks[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    else:
        classes = ctx.Classes(ctx.exponents(b, shift, alloc), ts, alloc)
        ci = ctx.class_of(at, ts)
        order = np.argsort(ci, kind="stable")
        pos, ci = np.take(pos, order), np.take(ci, order)
        bounds = np.searchsorted(ci, np.arange(len(ts) + 2))
        parts = [classes.rank(k, pos[lo:hi]) for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]
        sizes = classes.sizes
    fields = [_encode_class(r, sizes[k]) if r.size else [0] for k, r in enumerate(parts)]
    old = np.take(b, pos)
    d = np.take(n, pos)
    d -= old
    flags = 0
    if p < GROUP_BELOW:
        d = np.take(d, value_order(old, shift))
        flags = GROUPED
    vals, vflags = encode_values(d, alloc, nonzero=True)
    return [CLASSED, b.size, pos.size, flags | vflags, vals, ts, fields]


def _encode_class(ranks: np.ndarray, size: int) -> list:
    if ranks.size >= BITMAP_FROM * size:
        mask = np.zeros(size, bool)
        mask[ranks] = True
        return [int(ranks.size), BITMAP, zc(np.packbits(mask))]
    g = gaps_of(ranks)
    k = rice_parameter(g)
    return [int(ranks.size), GAP, k, *encode_gaps(None, k, g)]


def _decode_class(field, size: int, what: str, exact: bool = True):
    """-> strictly increasing ranks in [0, size) (exact=False: size only bounds them; -> (ranks,
    a bitmap's byte count or None), for the caller to check against the class size)."""
    mk = int(field[0])
    if not 0 <= mk <= size:
        raise DeltaError(f"{what}: {mk} changes in a class of {size}")
    nbytes = None
    if mk == 0:
        if len(field) != 1:
            raise DeltaError(f"{what}: malformed class record")
        ranks = np.zeros(0, np.int64)
    elif (mode := int(field[1])) == GAP and len(field) == 6:
        ranks = decode_gaps(int(field[2]), field[3], field[4], field[5], mk, size, what)
    elif mode == BITMAP and len(field) == 3:
        raw = zd(field[2], (size + 7) // 8, what + " bitmap", exact)
        nbytes = len(raw)
        ranks = np.flatnonzero(np.unpackbits(np.frombuffer(raw, np.uint8))[:size].view(bool))
        if ranks.size != mk:
            raise DeltaError(f"{what}: bitmap has {ranks.size} changes, header says {mk}")
    else:
        raise DeltaError(f"{what}: malformed class record")
    return ranks if exact else (ranks, nbytes)


def decode_classed(rec, m: int, count: int, what: str, base_all, shift: int | None, itemsize: int, alloc):
    """-> positions in class order, base bits there."""
    if base_all is None or shift is None:
        raise DeltaError(f"{what}: positions coded by base magnitude, but no base or not a float dtype")
    base = base_all()
    if base.size != count or base.itemsize != itemsize:
        raise DeltaError(f"{what}: base chunk of {base.size} elements, record says {count}")
    ts = ctx.check_thresholds(rec[5], itemsize, shift, what)
    fields = rec[6]
    if not isinstance(fields, list) or len(fields) != len(ts) + 1:
        raise DeltaError(f"{what}: {len(ts)} thresholds need {len(ts) + 1} class records")
    if ctx_jit.enabled:
        # class sizes come out of the select pass: until then ranks are only bounded by the
        # chunk (a bitmap by its bytes), and checked against the sizes after it
        ranks, nbytes = [], []
        for k, f in enumerate(fields):
            r, nb = _decode_class(f, count, f"{what} class {k}", exact=False)
            ranks.append(r)
            nbytes.append(nb)
        if sum(r.size for r in ranks) != m:
            raise DeltaError(f"{what}: classes hold {sum(r.size for r in ranks)} changes, header says {m}")
        pos, found, sizes = ctx_jit.select(base, shift, ts, ranks)
        for k, (f, r, nb, size) in enumerate(zip(found, ranks, nbytes, sizes)):
            if f != r.size:
                raise DeltaError(f"{what} class {k}: rank {int(r[f])} beyond the class of {size}")
            if nb is not None and nb != (size + 7) // 8:
                raise DeltaError(f"{what} class {k}: bitmap of {nb} bytes for a class of {size}")
        return pos, np.take(base, pos)
    classes = ctx.Classes(ctx.exponents(base, shift, alloc), ts, alloc)
    parts = [classes.select(k, _decode_class(f, classes.sizes[k], f"{what} class {k}")) for k, f in enumerate(fields)]
    if sum(p.size for p in parts) != m:
        raise DeltaError(f"{what}: classes hold {sum(p.size for p in parts)} changes, header says {m}")
    pos = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return pos, np.take(base, pos)
