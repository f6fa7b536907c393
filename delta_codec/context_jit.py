"""Compiled (numba) rank <-> position for CLASSED chunks (context.py's numpy path is the
fallback and the reference; both give the same bytes and the same applied state).

Classes as in context.py, with at most two thresholds t1 > t2 (one threshold: t2 = 0, so
class 2 is empty): class 0 has exponent >= t1, class 1 t2 <= exponent < t1, class 2 < t2.
Two passes, both sides:
  1. over the chunk: per 64-element word, the membership bits of S_1 = {e < t1} and
     S_2 = {e < t2} and the counts of each before the word (compares into byte flags, which
     LLVM vectorises, then 8 flags to 8 bits by one multiply);
  2. over the changes only: a class-k rank is a difference of those counts plus a popcount
     inside the word (encoder, branch-free per change); the decoder walks each class's
     increasing ranks over the word counts and selects the bit inside the word.
Pass 1 costs about a fifth of a nanosecond per element; pass 2 is O(changes + words), with no
per-word branch that depends on where the changes are (those mispredicted on most words at
~1 % changed). nogil, so apply threads run side by side; cache=True keeps the compiled code
across processes. Temporaries (2 words + 2 counts per 64 elements) live in the worker's
Scratch.
"""
from __future__ import annotations

import numpy as np

from .bits import UNSIGNED_INT
from .context import MAX_THRESHOLDS
from .tasks import scratch

try:
    import numba
    from numba import types
    from numba.extending import intrinsic
except ImportError:  # (numpy fallback in context.py)
    numba = None

available = numba is not None and MAX_THRESHOLDS <= 2  # (the kernels have three classes)
enabled = available  # (tests switch it off to compare with the numpy path)


_L8, _H8 = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080)
_M1, _M2, _M4 = np.uint64(0x5555555555555555), np.uint64(0x3333333333333333), np.uint64(0x0F0F0F0F0F0F0F0F)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_BIG = 1 << 62
_GATHER = np.uint64(0x0102040810204080)  # (w * _GATHER) >> 56: bit i = byte i's low bit
_SEL8 = np.zeros(256 * 8, np.uint8)  # _SEL8[8 * byte + j]: bit index of the byte's j-th set bit
for _b in range(256):
    for _j, _bit in enumerate(i for i in range(8) if _b >> i & 1):
        _SEL8[8 * _b + _j] = _bit


def _bytepop(x):
    """Per-byte popcounts of a 64-bit word (SWAR)."""
    x = x - ((x >> np.uint64(1)) & _M1)
    x = (x & _M2) + ((x >> np.uint64(2)) & _M2)
    return (x + (x >> np.uint64(4))) & _M4


def _pop(x):
    return np.int64((_bytepop(x) * _L8) >> np.uint64(56))


if numba is not None:
    @intrinsic
    def _ctpop(typingctx, x):
        """LLVM's popcount: one instruction where the CPU has it (the SWAR above otherwise)."""
        def codegen(context, builder, signature, args):
            return builder.ctpop(args[0])
        return types.uint64(types.uint64), codegen

    def _popc(x):
        return np.int64(_ctpop(x))
else:
    _popc = _pop


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


def _masks(u, em, t1, t2, m1, m2, cum1, cum2):
    """Pass 1: m1[w], m2[w]: S_1, S_2 membership bits of word w (0 past the chunk's end);
    cum1[w], cum2[w]: members of S_1, S_2 before word w (w <= number of words)."""
    n = u.size
    nw = (n + 63) // 64
    f1 = np.zeros(64, np.uint8)
    f2 = np.zeros(64, np.uint8)
    g1 = f1.view(np.uint64)
    g2 = f2.view(np.uint64)
    s1 = 0
    s2 = 0
    for w in range(nw):
        lo = w * 64
        if lo + 64 <= n:
            for i in range(64):  # (fixed trip count: vectorised)
                e = u[lo + i] & em
                f1[i] = e < t1
                f2[i] = e < t2
        else:
            for i in range(64):
                f1[i] = 0
                f2[i] = 0
            for i in range(n - lo):
                e = u[lo + i] & em
                f1[i] = e < t1
                f2[i] = e < t2
        a1 = np.uint64(0)
        a2 = np.uint64(0)
        for k in range(8):
            a1 |= ((g1[k] * _GATHER) >> np.uint64(56)) << np.uint64(8 * k)
            a2 |= ((g2[k] * _GATHER) >> np.uint64(56)) << np.uint64(8 * k)
        m1[w] = a1
        m2[w] = a2
        cum1[w] = s1
        cum2[w] = s2
        s1 += _popc(a1)
        s2 += _popc(a2)
    cum1[nw] = s1
    cum2[nw] = s2


def _enc(u, em, t1, t2, pos, out_pos, out_rank, starts, sizes, m1, m2, cum1, cum2):
    """pos: sorted changed positions -> out_pos/out_rank in class order (class 0's by position,
    then class 1's ...), starts[k]: class k's first index there; sizes: class member counts."""
    m = pos.size
    n = u.size
    _masks(u, em, t1, t2, m1, m2, cum1, cum2)
    ci = np.empty(m, np.uint8)
    rk = np.empty(m, np.int64)
    n1 = 0
    n2 = 0
    for j in range(m):
        p = pos[j]
        w = p >> 6
        b = np.uint64(p & 63)
        below = (np.uint64(1) << b) - np.uint64(1)
        a1 = m1[w]
        a2 = m2[w]
        x1 = np.int64((a1 >> b) & np.uint64(1))
        x2 = np.int64((a2 >> b) & np.uint64(1))
        s1 = cum1[w] + _popc(a1 & below)  # members of S_1, S_2 before p
        s2 = cum2[w] + _popc(a2 & below)
        r0 = p - s1
        r1 = s1 - s2
        rk[j] = r0 + x1 * (r1 - r0) + x2 * (s2 - r1)  # (class 0, 1, 2: x1 + x2)
        ci[j] = x1 + x2
        n1 += x1
        n2 += x2
    nw = (n + 63) // 64
    sizes[0] = n - cum1[nw]
    sizes[1] = cum1[nw] - cum2[nw]
    sizes[2] = cum2[nw]
    starts[0] = 0
    starts[1] = m - n1
    starts[2] = m - n2
    starts[3] = m
    f = starts[:3].copy()
    for j in range(m):
        c = ci[j]
        out_pos[f[c]] = pos[j]
        out_rank[f[c]] = rk[j]
        f[c] += 1


SB = 4  # words per superblock of the decoder's rank -> word search


def _before(k, w, n, cum1, cum2):
    """Class k's members before word w (w <= number of words)."""
    if k == 0:
        return min(w * 64, n) - cum1[w]
    if k == 1:
        return cum1[w] - cum2[w]
    return cum2[w]


def _word_k(k, w, n, m1, m2):
    """Class k's membership bits of word w (0 past the chunk's end: the words are padded)."""
    if k == 0:
        left = min(max(n - w * 64, 0), 64)
        valid = ((np.uint64(1) << np.uint64(left & 63)) - np.uint64(1)) | (_ALL * np.uint64(left >= 64))
        return ~m1[w] & valid
    if k == 1:
        return m1[w] & ~m2[w]
    return m2[w]


def _dec(u, em, t1, t2, ranks, starts, out, found, sizes, tab, m1, m2, cum1, cum2, sbk, sbi):
    """ranks: each class's strictly increasing ranks, class k's at starts[k]:starts[k+1] ->
    out: their positions, same layout; found[k]: how many of class k's ranks were found (fewer
    than given: a rank beyond the class); sizes: class member counts.
    Per class, without a branch that depends on the data: a merge of the ranks with the class's
    counts before each superblock of SB words (sbk) gives each rank's superblock (sbi); then
    the word inside it from SB popcounts, and the bit from _sel."""
    n = u.size
    nw = (n + 63) // 64
    nsb = (nw + SB - 1) // SB
    _masks(u, em, t1, t2, m1, m2, cum1, cum2)
    for w in range(nw, nsb * SB):
        m1[w] = 0
        m2[w] = 0
    for k in range(3):
        s = starts[k]
        e = starts[k + 1]
        sizes[k] = _before(k, nw, n, cum1, cum2)
        for q in range(nsb):
            sbk[q] = _before(k, q * SB, n, cum1, cum2)
        sbk[nsb] = sizes[k]
        sbk[nsb + 1] = _BIG  # (the merge stops at nsb: beyond the class)
        q = 0
        i = s
        while i < e:  # (at most e - s + nsb steps)
            r = ranks[i]
            adv = np.int64(sbk[q + 1] <= r)
            sbi[i] = q
            q += adv
            i += 1 - adv
        f = e - s
        for i in range(s, e):
            q = sbi[i]
            if q == nsb:
                f = i - s
                break
            j = ranks[i] - sbk[q]
            w0 = q * SB
            x0 = _word_k(k, w0, n, m1, m2)
            x1 = _word_k(k, w0 + 1, n, m1, m2)
            x2 = _word_k(k, w0 + 2, n, m1, m2)
            x3 = _word_k(k, w0 + 3, n, m1, m2)
            p1 = _popc(x0)
            p2 = p1 + _popc(x1)
            p3 = p2 + _popc(x2)
            h1 = np.int64(p1 <= j)
            h2 = np.int64(p2 <= j)
            h3 = np.int64(p3 <= j)
            x = x0 + np.uint64(h1) * (x1 - x0) + np.uint64(h2) * (x2 - x1) + np.uint64(h3) * (x3 - x2)
            pre = h1 * p1 + h2 * (p2 - p1) + h3 * (p3 - p2)
            out[i] = (w0 + h1 + h2 + h3) * 64 + _sel(x, j - pre, tab)
        found[k] = f


if available:
    _jit = numba.njit(nogil=True, cache=True)
    _inl = numba.njit(nogil=True, cache=True, inline="always")  # (helpers: calls between compiled functions are not inlined otherwise)
    _bytepop, _pop, _popc, _sel, _masks, _before, _word_k = (
        _inl(f) for f in (_bytepop, _pop, _popc, _sel, _masks, _before, _word_k))
    _enc, _dec = _jit(_enc), _jit(_dec)


def _args(b: np.ndarray, shift: int, thresholds: list[int]):
    """Unsigned view, |bits| mask, thresholds on |bits| (|bits| < t << shift: exponent < t; one
    mask and compare per element, no shift)."""
    u = b.view(UNSIGNED_INT[b.itemsize])
    t = u.dtype.type
    t1 = thresholds[0]
    t2 = thresholds[1] if len(thresholds) > 1 else 0
    return u, t((1 << (8 * b.itemsize - 1)) - 1), t(t1 << shift), t(t2 << shift)


def _temps(n: int):
    """Pass 1's words (padded to whole superblocks) and counts, in the worker's Scratch."""
    alloc, nw = scratch(), (n + 63) // 64
    nwp = -(-nw // SB) * SB
    return (alloc("jit.m1", nwp, np.uint64), alloc("jit.m2", nwp, np.uint64),
            alloc("jit.cum1", nw + 1, np.int64), alloc("jit.cum2", nw + 1, np.int64))


def encode_ranks(b: np.ndarray, pos: np.ndarray, shift: int, thresholds: list[int]):
    """-> (positions in class order, their ranks within their class, class bounds (K + 2),
    class sizes (K + 1))."""
    u, em, t1, t2 = _args(b, shift, thresholds)
    out_pos = np.empty(pos.size, np.int64)
    out_rank = np.empty(pos.size, np.int64)
    starts = np.empty(4, np.int64)
    sizes = np.empty(3, np.int64)
    _enc(u, em, t1, t2, pos.astype(np.int64, copy=False), out_pos, out_rank, starts, sizes, *_temps(u.size))
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
    alloc, nsb = scratch(), -(-u.size // (64 * SB))
    _dec(u, em, t1, t2, ranks, starts, out, found, sizes, _SEL8, *_temps(u.size), alloc("jit.sbk", nsb + 2, np.int64),
         alloc("jit.sbi", ranks.size, np.int64))
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
