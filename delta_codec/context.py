"""Changed positions coded in the context of the base weights (format 3's CLASSED chunks).

With Adam every element moves by about lr, and a float element's bits change only when that
crosses half a unit in its last place, which its exponent sets: the smaller the base value, the
likelier it changes (about twice as likely per octave down). The decoder holds the base, so the
encoder may split a chunk's elements into classes by base magnitude and code each class's
changes on its own, at that class's density, without sending the classes.

Classes: thresholds t_1 > t_2 > ... > t_K (base exponents, chosen per chunk by the encoder)
split the elements by |base bits| into nested sets S_k = {|b| < t_k << mantissa}; class 0 is
the complement of S_1, class k is S_k minus S_{k+1}. A change is coded by its rank among its
class's members (gaps, Rice-coded, or a bitmap over the members when the class is dense).

Rank <-> position without listing any class's members: each S_k is one compare and one
packbits over the chunk; popcounts of its 64-bit words and their running sum give, per
class, how many members precede each word, so a rank is a binary search into those sums
plus a select inside one word (encoder: a popcount below the bit). The work is K compare
passes over the chunk plus O(changes); no sort or nonzero over the whole chunk.

On a GPU the same steps are data-parallel: the compares and per-word popcounts are one
elementwise kernel, the running sums one scan, and each change's rank -> position a binary
search plus an in-word select, i.e. a gather (the gap streams are decoded on the host as now,
or with a scan on the device). Today device tensors decode on the host: the chunk's base bits
are copied over for the compares (see apply.decode_record).
"""
from __future__ import annotations

import numpy as np

from .bits import UNSIGNED_INT, fresh
from .errors import DeltaError

MAX_THRESHOLDS = 3       # at most 5 classes: each threshold is one compare + packbits per chunk on both sides
MIN_CHANGES = 64         # fewer changes: the class headers cost more than they save
CLASS_COST_BITS = 512    # a class's header and decode pass, in bits, charged when choosing thresholds
SAMPLE_STRIDE = 16       # element counts per exponent are estimated on every 16th element

_POP8 = np.array([bin(i).count("1") for i in range(256)], np.uint8)
_SEL8 = np.zeros((256, 8), np.uint8)  # _SEL8[byte, j]: bit index of the byte's j-th set bit
for _b in range(256):
    for _j, _bit in enumerate(i for i in range(8) if _b >> i & 1):
        _SEL8[_b, _j] = _bit


def magnitude2(b: np.ndarray, alloc=fresh) -> np.ndarray:
    """|bits| << 1 as unsigned (the sign bit shifted out): compares against (t << mantissa) << 1."""
    u = b.view(UNSIGNED_INT[b.itemsize])
    return np.left_shift(u, 1, out=alloc("ctx.mag", u.size, u.dtype))


def max_threshold(itemsize: int, shift: int) -> int:
    return 1 << (8 * itemsize - 1 - shift)


class Classes:
    """Per-class member counts before each 64-element word, for one chunk and its thresholds."""

    def __init__(self, mag2: np.ndarray, thresholds: list[int], shift: int, alloc=fresh):
        self.count = n = mag2.size
        self.nwords = nw = -(-n // 64)
        self.sets = []  # packed S_1..S_K, as uint64 words
        lt = alloc("ctx.lt", n, bool)
        for i, t in enumerate(thresholds):
            np.less(mag2, mag2.dtype.type(t << (shift + 1)), out=lt)
            w = np.packbits(lt, bitorder="little")
            if n % 64:  # (whole chunks are multiples of 64: no copy)
                w = np.concatenate([w, np.zeros(nw * 8 - w.size, np.uint8)])
            self.sets.append(w.view("<u8"))
        # popcounts per word and running sums, per nested set (S_0: all elements)
        pcs = [np.full(nw, 64, np.uint8)]
        if n % 64:
            pcs[0][-1] = n % 64
        pcs += [np.bitwise_count(s) for s in self.sets]
        pcs.append(np.zeros(nw, np.uint8))
        self.pc = [(a.astype(np.int64) - b) for a, b in zip(pcs[:-1], pcs[1:])]  # class k = S_k - S_{k+1}
        self.cum = [np.cumsum(p) for p in self.pc]  # members in words 0..w, inclusive
        self.sizes = [int(c[-1]) if nw else 0 for c in self.cum]

    def words(self, k: int, w: np.ndarray) -> np.ndarray:
        """Class k's membership words at word indices w."""
        inner = self.sets[k].take(w) if k < len(self.sets) else None
        if k == 0:
            x = np.full(w.size, ~np.uint64(0), np.uint64)
            if self.count % 64:
                x[w == self.nwords - 1] = np.uint64((1 << (self.count % 64)) - 1)
        else:
            x = self.sets[k - 1].take(w)
        if inner is not None:
            x &= ~inner
        return x

    def rank(self, k: int, pos: np.ndarray) -> np.ndarray:
        """Ranks among class k's members of positions that are class k members."""
        w = pos >> 6
        below = (np.uint64(1) << (pos & 63).astype(np.uint64)) - np.uint64(1)
        return self.cum[k].take(w) - self.pc[k].take(w) + np.bitwise_count(self.words(k, w) & below)

    def select(self, k: int, ranks: np.ndarray) -> np.ndarray:
        """Positions of class k's members with these ranks (each < sizes[k])."""
        w = np.searchsorted(self.cum[k], ranks, side="right")
        j = ranks - (self.cum[k].take(w) - self.pc[k].take(w))
        xb = self.words(k, w).view(np.uint8).reshape(-1, 8)  # little endian: byte i = bits 8i..8i+7
        cs = np.cumsum(_POP8.take(xb), axis=1, dtype=np.int64)
        bi = np.count_nonzero(cs <= j[:, None], axis=1)
        rows = np.arange(bi.size)
        jj = j - np.where(bi > 0, cs[rows, np.maximum(bi - 1, 0)], 0)
        return (w << 6) + (bi << 3) + _SEL8[xb[rows, bi], jj]


def class_of(mag2_at: np.ndarray, thresholds: list[int], shift: int) -> np.ndarray:
    """Class index (0..K) of elements with these |bits| << 1 values."""
    keys = np.array([t << (shift + 1) for t in thresholds[::-1]], np.uint64)  # ascending
    return len(thresholds) - np.searchsorted(keys, mag2_at.astype(np.uint64), side="right")


def _h(c: np.ndarray, n: np.ndarray) -> np.ndarray:
    """n * binary entropy(c / n), in bits (0 where c is 0 or n)."""
    p = np.clip(c / np.maximum(n, 1), 1e-12, 1 - 1e-12)
    out = -n * (p * np.log2(p) + (1 - p) * np.log2(1 - p))
    return np.where((c <= 0) | (c >= n), 0.0, out)


def choose_thresholds(mag2: np.ndarray, changed_mag2: np.ndarray, shift: int) -> list[int]:
    """Thresholds (descending base exponents) minimising the estimated position entropy plus
    CLASS_COST_BITS per class: an optimal split of the exponents into <= MAX_THRESHOLDS + 1
    contiguous ranges, on per-exponent change counts (exact) and element counts (sampled)."""
    s = shift + 1
    changed = np.bincount((changed_mag2 >> s).astype(np.int64))
    total = np.bincount((mag2[::SAMPLE_STRIDE] >> s).astype(np.int64)).astype(np.float64) * SAMPLE_STRIDE
    size = max(changed.size, total.size)
    changed = np.pad(changed, (0, size - changed.size)).astype(np.float64)
    total = np.maximum(np.pad(total, (0, size - total.size)), changed)
    if total.sum():
        total *= max(mag2.size, 1) / total.sum()
    exps = np.flatnonzero(total)  # ranges are between present exponents
    if exps.size < 2:
        return []
    cc, nn = np.cumsum(changed[exps]), np.cumsum(total[exps])
    cc, nn = np.r_[0, cc], np.r_[0, nn]
    e = exps.size
    # cost[i, j]: one class over exps[i:j]
    i, j = np.triu_indices(e + 1, 1)
    cost = np.full((e + 1, e + 1), np.inf)
    cost[i, j] = _h(cc[j] - cc[i], nn[j] - nn[i]) + CLASS_COST_BITS
    best = cost[0].copy()  # best[j]: exps[:j] in g classes
    cuts = [np.zeros(e + 1, np.int64)]
    results = [(best[e], [])]
    for _ in range(min(MAX_THRESHOLDS, e - 1)):
        tot = best[:, None] + cost  # previous classes over exps[:i], one more over exps[i:j]
        arg = np.argmin(tot, axis=0)
        best = tot[arg, np.arange(e + 1)]
        cuts.append(arg)
        # walk back the cut points for the full range
        bounds, j2 = [], e
        for c in reversed(cuts[1:]):
            j2 = int(c[j2])
            bounds.append(j2)
        results.append((best[e], bounds))
    _, bounds = min(results, key=lambda r: r[0])
    # a cut at index i: classes below exps[i] and from exps[i] on -> threshold exponent exps[i]
    return sorted((int(exps[b]) for b in bounds), reverse=True)


def check_thresholds(thresholds, itemsize: int, shift: int, what: str) -> list[int]:
    try:
        ts = [int(t) for t in thresholds]
    except (TypeError, ValueError):
        raise DeltaError(f"{what}: malformed class thresholds") from None
    top = max_threshold(itemsize, shift)
    if not 1 <= len(ts) <= MAX_THRESHOLDS or any(not 0 < t < top for t in ts) or any(
            a <= b for a, b in zip(ts, ts[1:])):
        raise DeltaError(f"{what}: bad class thresholds {ts[:8]}")
    return ts
