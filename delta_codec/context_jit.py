"""Compiled (numba) rank <-> position for CLASSED chunks: one pass over the chunk's base bits,
no class masks, running sums or binary search (context.py's numpy path is the fallback and the
reference; both give the same bytes and the same applied state).

Classes as in context.py, with at most two thresholds t1 > t2 (one threshold: t2 = 0, so
class 2 is empty): class 0 has exponent >= t1, class 1 t2 <= exponent < t1, class 2 < t2.
Both kernels count S_1 = {e < t1} and S_2 = {e < t2} in straight-line loops that LLVM
vectorises; a class-k rank is then a difference of those counts:
  encoder: walk the changes in order; the counts over the gap before each change give its rank.
  decoder: walk the chunk in small blocks; a block is counted whole (vectorised) unless it holds
           a class's next wanted rank, and only those blocks are walked element by element.
O(chunk + changes); nogil, so apply threads run side by side; cache=True keeps the compiled
code across processes.
"""
from __future__ import annotations

import numpy as np

from .bits import UNSIGNED_INT
from .context import MAX_THRESHOLDS

try:
    import numba

    from .llvmlite_guard import guard_llvmlite_lib
    guard_llvmlite_lib()  # (else vLLM's CPU workers fail to start in a process that imported us)
except ImportError:  # (numpy fallback in context.py)
    numba = None

available = numba is not None and MAX_THRESHOLDS <= 2  # (the kernels have three classes)
enabled = available  # (tests switch it off to compare with the numpy path)


_L8, _H8 = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080)
_M1, _M2, _M4 = np.uint64(0x5555555555555555), np.uint64(0x3333333333333333), np.uint64(0x0F0F0F0F0F0F0F0F)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_SEL8 = np.zeros(256 * 8, np.uint8)  # _SEL8[8 * byte + j]: bit index of the byte's j-th set bit
for _b in range(256):
    for _j, _bit in enumerate(i for i in range(8) if _b >> i & 1):
        _SEL8[8 * _b + _j] = _bit
_BIG = 1 << 62


def _bytepop(x):
    """Per-byte popcounts of a 64-bit word (SWAR: no popcount instruction needed)."""
    x = x - ((x >> np.uint64(1)) & _M1)
    x = (x & _M2) + ((x >> np.uint64(2)) & _M2)
    return (x + (x >> np.uint64(4))) & _M4


def _pop(x):
    return np.int64((_bytepop(x) * _L8) >> np.uint64(56))


def _sel(x, j, tab):
    """Bit index of x's j-th set bit (j < popcount(x)), branch-free: the byte whose running
    popcount passes j, then a table."""
    run = _bytepop(x) * _L8  # byte i: set bits in bytes 0..i (<= 64: no carries)
    ju = np.uint64(j)
    jb = (((ju * _L8) | _H8) - run) & _H8  # high bit kept in bytes with run_i <= j
    sh = (((jb >> np.uint64(7)) * _L8) >> np.uint64(56)) << np.uint64(3)
    prev = ((run << np.uint64(8)) >> sh) & np.uint64(0xFF)
    xb = (x >> sh) & np.uint64(0xFF)
    return np.int64(sh) + np.int64(tab[np.int64(xb * np.uint64(8) + ju - prev)])


BLOCK = 512  # elements per class pass block (its byte flags stay in L1)
_GATHER = np.uint64(0x0102040810204080)  # (w * _GATHER) >> 56: bit i = byte i's low bit


def _flags(u, lo, em, t1, t2, f1, f2):
    """f1[i], f2[i]: element lo + i is in S_1, S_2 (0 past the end); one vectorised pass."""
    cnt = min(BLOCK, u.size - lo)
    if cnt == BLOCK:
        for i in range(BLOCK):
            e = u[lo + i] & em
            f1[i] = e < t1
            f2[i] = e < t2
    else:
        for i in range(BLOCK):
            f1[i] = 0
            f2[i] = 0
        for i in range(cnt):
            e = u[lo + i] & em
            f1[i] = e < t1
            f2[i] = e < t2


def _word(g, w):
    """8 byte flags g[8 w: 8 w + 8] (as words) to 64 bits, a byte per multiply."""
    a = np.uint64(0)
    for k in range(8):
        a |= ((g[w * 8 + k] * _GATHER) >> np.uint64(56)) << np.uint64(8 * k)
    return a


def _cnt(g, w):
    """How many of the 64 byte flags g[8 w: 8 w + 8] (as words) are set: bytes summed (each
    <= 8) across the words, then across the bytes by one multiply."""
    a = g[w * 8]
    for k in range(1, 8):
        a += g[w * 8 + k]
    return np.int64((a * _L8) >> np.uint64(56))


def _full(n, lo):
    """Mask of the word at lo's elements that exist."""
    left = n - lo
    return _ALL if left >= 64 else ((np.uint64(1) << np.uint64(max(left, 0))) - np.uint64(1))


def _enc(u, em, t1, t2, pos, out_pos, out_rank, starts, sizes):
    """pos: sorted changed positions -> out_pos/out_rank in class order (class 0's by position,
    then class 1's ...), starts[k]: class k's first index there; sizes: class member counts."""
    m = pos.size
    n = u.size
    ci = np.empty(m, np.uint8)
    rk = np.empty(m, np.int64)
    c0 = 0
    c1 = 0
    c2 = 0
    nk = np.zeros(3, np.int64)
    j = 0
    f1 = np.empty(BLOCK, np.uint8)
    f2 = np.empty(BLOCK, np.uint8)
    g1 = f1.view(np.uint64)
    g2 = f2.view(np.uint64)
    for w in range((n + 63) // 64):
        lo = w * 64
        if lo % BLOCK == 0:
            _flags(u, lo, em, t1, t2, f1, f2)
        q = (lo % BLOCK) // 64
        s1 = _cnt(g1, q)
        s2 = _cnt(g2, q)
        if not (j < m and pos[j] < lo + 64):  # no change in this word
            c0 += min(64, n - lo) - s1
            c1 += s1 - s2
            c2 += s2
            continue
        m1 = _word(g1, q)
        m2 = _word(g2, q)
        k0 = _full(n, lo) & ~m1
        k1 = m1 & ~m2
        while j < m and pos[j] < lo + 64:
            b = np.uint64(pos[j] - lo)
            below = (np.uint64(1) << b) - np.uint64(1)
            if (k0 >> b) & np.uint64(1):
                ci[j] = 0
                rk[j] = c0 + _pop(k0 & below)
            elif (k1 >> b) & np.uint64(1):
                ci[j] = 1
                rk[j] = c1 + _pop(k1 & below)
            else:
                ci[j] = 2
                rk[j] = c2 + _pop(m2 & below)
            nk[ci[j]] += 1
            j += 1
        c0 += _pop(k0)
        c1 += _pop(k1)
        c2 += _pop(m2)
    sizes[0] = c0
    sizes[1] = c1
    sizes[2] = c2
    starts[0] = 0
    starts[1] = nk[0]
    starts[2] = nk[0] + nk[1]
    starts[3] = m
    f = starts[:3].copy()
    for j in range(m):
        c = ci[j]
        out_pos[f[c]] = pos[j]
        out_rank[f[c]] = rk[j]
        f[c] += 1


def _dec(u, em, t1, t2, ranks, starts, out, found, sizes, tab):
    """ranks: each class's strictly increasing ranks, class k's at starts[k]:starts[k+1] ->
    out: their positions, same layout; found[k]: how many of class k's ranks were found (fewer
    than given: a rank beyond the class); sizes: class member counts (the pass runs to the
    chunk's end for them)."""
    n = u.size
    c0 = 0
    c1 = 0
    c2 = 0
    i0 = starts[0]
    i1 = starts[1]
    i2 = starts[2]
    e0 = starts[1]
    e1 = starts[2]
    e2 = starts[3]
    w0 = ranks[i0] if i0 < e0 else _BIG
    w1 = ranks[i1] if i1 < e1 else _BIG
    w2 = ranks[i2] if i2 < e2 else _BIG
    f1 = np.empty(BLOCK, np.uint8)
    f2 = np.empty(BLOCK, np.uint8)
    g1 = f1.view(np.uint64)
    g2 = f2.view(np.uint64)
    for w in range((n + 63) // 64):
        lo = w * 64
        if lo % BLOCK == 0:
            _flags(u, lo, em, t1, t2, f1, f2)
        q = (lo % BLOCK) // 64
        s1 = _cnt(g1, q)
        p2 = _cnt(g2, q)
        p0 = min(64, n - lo) - s1
        p1 = s1 - p2
        if w0 >= c0 + p0 and w1 >= c1 + p1 and w2 >= c2 + p2:  # no wanted rank in this word
            c0 += p0
            c1 += p1
            c2 += p2
            continue
        if w0 < c0 + p0:  # (each class's mask only where it has a wanted rank here)
            k0 = _full(n, lo) & ~_word(g1, q)
            while w0 < c0 + p0:
                out[i0] = lo + _sel(k0, w0 - c0, tab)
                i0 += 1
                w0 = ranks[i0] if i0 < e0 else _BIG
        if w1 < c1 + p1:
            k1 = _word(g1, q) & ~_word(g2, q)
            while w1 < c1 + p1:
                out[i1] = lo + _sel(k1, w1 - c1, tab)
                i1 += 1
                w1 = ranks[i1] if i1 < e1 else _BIG
        if w2 < c2 + p2:
            m2 = _word(g2, q)
            while w2 < c2 + p2:
                out[i2] = lo + _sel(m2, w2 - c2, tab)
                i2 += 1
                w2 = ranks[i2] if i2 < e2 else _BIG
        c0 += p0
        c1 += p1
        c2 += p2
    sizes[0] = c0
    sizes[1] = c1
    sizes[2] = c2
    found[0] = i0 - starts[0]
    found[1] = i1 - starts[1]
    found[2] = i2 - starts[2]


if available:
    _jit = numba.njit(nogil=True, cache=True)
    _inl = numba.njit(nogil=True, cache=True, inline="always")  # (helpers: calls between compiled functions are not inlined otherwise)
    _bytepop, _pop, _sel, _flags, _word, _cnt, _full = (_inl(f) for f in (_bytepop, _pop, _sel, _flags, _word, _cnt, _full))
    _enc, _dec = _jit(_enc), _jit(_dec)


def _args(b: np.ndarray, shift: int, thresholds: list[int]):
    """Unsigned view, |bits| mask, thresholds on |bits| (|bits| < t << shift: exponent < t; one
    mask and compare per element, no shift)."""
    u = b.view(UNSIGNED_INT[b.itemsize])
    t = u.dtype.type
    t1 = thresholds[0]
    t2 = thresholds[1] if len(thresholds) > 1 else 0
    return u, t((1 << (8 * b.itemsize - 1)) - 1), t(t1 << shift), t(t2 << shift)


def encode_ranks(b: np.ndarray, pos: np.ndarray, shift: int, thresholds: list[int]):
    """-> (positions in class order, their ranks within their class, class bounds (K + 2),
    class sizes (K + 1))."""
    u, em, t1, t2 = _args(b, shift, thresholds)
    out_pos = np.empty(pos.size, np.int64)
    out_rank = np.empty(pos.size, np.int64)
    starts = np.empty(4, np.int64)
    sizes = np.empty(3, np.int64)
    _enc(u, em, t1, t2, pos.astype(np.int64, copy=False), out_pos, out_rank, starts, sizes)
    k = len(thresholds) + 1
    return out_pos, out_rank, starts[:k + 1].tolist(), sizes[:k].tolist()


def select(b: np.ndarray, shift: int, thresholds: list[int], parts: list[np.ndarray]):
    """parts[k]: class k's strictly increasing ranks -> (positions in class order, ranks found
    per class, class sizes)."""
    u, em, t1, t2 = _args(b, shift, thresholds)
    parts = [*parts, *[np.zeros(0, np.int64)] * (3 - len(parts))]
    starts = np.cumsum([0, *(p.size for p in parts)]).astype(np.int64)
    ranks = np.concatenate(parts).astype(np.int64, copy=False)
    out = np.empty(ranks.size, np.int64)
    found = np.zeros(3, np.int64)
    sizes = np.zeros(3, np.int64)
    _dec(u, em, t1, t2, ranks, starts, out, found, sizes, _SEL8)
    k = len(thresholds) + 1
    return out, found[:k].tolist(), sizes[:k].tolist()


def warm() -> None:
    """Compile (or load from the cache) for every float width, outside any timed region."""
    if not available:
        return
    for dt, shift in ((np.int8, 3), (np.int16, 7), (np.int32, 23), (np.int64, 52)):
        b = np.arange(64, dtype=dt)
        eb = 8 * b.itemsize - 1 - shift
        ts = [3, 1] if eb > 2 else [1]
        op, r, st, sz = encode_ranks(b, np.array([1, 5], np.int64), shift, ts)
        select(b, shift, ts, [r[st[k]:st[k + 1]] for k in range(len(ts) + 1)])
