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

Rank <-> position without listing any class's members: the chunk's exponents are taken once
(one narrowing shift to bytes), then each S_k is one byte compare and one packbits, in
cache-sized blocks; popcounts of its 64-bit words and, per class that has changes, their
running sum give how many members precede each word, so a rank is a binary search into those
sums plus a select inside one word (branch-free, on the byte popcounts of the word; encoder:
a popcount below the bit). The work is one shift and K compare passes over the chunk plus
O(changes); no sort or nonzero over the whole chunk. This numpy path is the fallback and the
reference: with numba installed, context_jit.py does the same in two compiled passes per chunk
(the class words by vector compares, then work per change only), with the same bytes and
results.

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

# at most 5 classes: each threshold is one more vector compare per 64 elements on both sides and one
# more class pass in the decoder; fewer leave more than half a bit per change to the conditional
# bound at ~1 % changed (tests/test_delta_context_bits.py)
MAX_THRESHOLDS = 4
MIN_CHANGES = 64  # fewer changes: the class headers cost more than they save
# a class's header entry, its block in the shared frame (3 bytes + a literal table) and its decode
# pass, in bits, charged when choosing thresholds
CLASS_COST_BITS = 256
SAMPLE_STRIDE = 32  # element counts per exponent are estimated on 1/32 of the elements: every 32nd
SAMPLE_RUN = 512  # run of 512 (1 KiB of bf16: contiguous, so 1/32 of the cache lines are read,
# not all of them as with every 32nd element), in chunks of >= 64 * 32 such runs (fewer runs:
# measured larger on real weights, whose rows differ)
BLOCK = 1 << 19  # elements per cache block of the class pass (its bool temporaries stay in L2)

_SEL8 = np.zeros(256 * 8, np.uint8)  # _SEL8[8 * byte + j]: bit index of the byte's j-th set bit
for _b in range(256):
    for _j, _bit in enumerate(i for i in range(8) if _b >> i & 1):
        _SEL8[8 * _b + _j] = _bit
_L8, _H8 = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080)


def exponents(b: np.ndarray, shift: int, alloc=fresh) -> np.ndarray:
    """Biased exponents of the float elements whose raw bits are b (sign dropped), as uint8
    (uint16 for float64): one shift pass that narrows as it writes (8-bit exponents: the sign
    lands above the kept byte); |bits| < t << shift exactly when the exponent is < t."""
    u = b.view(UNSIGNED_INT[b.itemsize])
    ebits = 8 * b.itemsize - 1 - shift
    key = alloc("ctx.exp", u.size, np.uint8 if ebits <= 8 else np.uint16)
    np.right_shift(u, u.dtype.type(shift), out=key, casting="unsafe")
    if ebits < 8 * key.itemsize:
        key &= key.dtype.type((1 << ebits) - 1)
    return key


def sample(b: np.ndarray) -> np.ndarray:
    """About 1/SAMPLE_STRIDE of b's elements for choose_thresholds' counts: every SAMPLE_STRIDE-th
    run of SAMPLE_RUN elements (every SAMPLE_STRIDE-th element in small chunks)."""
    runs = b.size // SAMPLE_RUN
    if runs < 64 * SAMPLE_STRIDE:
        return b[::SAMPLE_STRIDE]
    return b[: runs * SAMPLE_RUN].reshape(runs, SAMPLE_RUN)[::SAMPLE_STRIDE].reshape(-1)


def max_threshold(itemsize: int, shift: int) -> int:
    return 1 << (8 * itemsize - 1 - shift)


class Classes:
    """Per-class member counts before each 64-element word, for one chunk and its thresholds."""

    def __init__(self, key: np.ndarray, thresholds: list[int], alloc=fresh):
        self.count = n = key.size
        self.nwords = nw = -(-n // 64)
        # packed S_1..S_K (uint64 words), bytes past the chunk's end zero
        packed = [alloc(f"ctx.set{i}", nw * 8, np.uint8) for i in range(len(thresholds))]
        lt = alloc("ctx.lt", min(n, BLOCK), bool)
        ts = [key.dtype.type(t) for t in thresholds]
        for lo in range(0, n, BLOCK):  # (blocks: key and lt stay in cache across the K passes)
            hi = min(n, lo + BLOCK)
            part = lt[: hi - lo]
            for t, out in zip(ts, packed):
                np.less(key[lo:hi], t, out=part)
                bits = np.packbits(part, bitorder="little")
                out[lo // 8 : lo // 8 + bits.size] = bits
        if n % 64:
            for out in packed:
                out[-(-n // 8) :] = 0
        self.sets = [p.view("<u8") for p in packed]
        ends = [int(np.sum(np.bitwise_count(s), dtype=np.int64)) for s in self.sets]
        self.sizes = [a - b for a, b in zip([n, *ends], [*ends, 0])]
        self._before, self._alloc = {}, alloc

    def before(self, k: int) -> np.ndarray:
        """nwords + 1 entries: class k's members in words 0..w-1 (computed once per class)."""
        if k not in self._before:
            out = self._alloc(f"ctx.before{k}", self.nwords + 1, np.int64)
            out[0] = 0
            pc = np.bitwise_count(self.words(k, None))
            out[1:] = pc  # widened, then summed in place (see positions.prefix_sum)
            np.cumsum(out[1:], out=out[1:])
            self._before[k] = out
        return self._before[k]

    def words(self, k: int, w: np.ndarray | None) -> np.ndarray:
        """Class k's membership words at word indices w (None: all words)."""
        size = self.nwords if w is None else w.size
        pick = (lambda s: s.copy()) if w is None else (lambda s: s.take(w))
        if k == 0:
            x = np.full(size, ~np.uint64(0), np.uint64)
            if self.count % 64:
                x[(np.arange(size) if w is None else w) == self.nwords - 1] = np.uint64(
                    (1 << (self.count % 64)) - 1
                )
        else:
            x = pick(self.sets[k - 1])
        if k < len(self.sets):
            x &= ~pick(self.sets[k])
        return x

    def rank(self, k: int, pos: np.ndarray) -> np.ndarray:
        """Ranks among class k's members of positions that are class k members."""
        w = pos >> 6
        below = np.left_shift(np.uint64(1), (pos & 63).astype(np.uint64))
        below -= np.uint64(1)
        below &= self.words(k, w)
        r = self.before(k).take(w)
        r += np.bitwise_count(below)
        return r

    def select(self, k: int, ranks: np.ndarray) -> np.ndarray:
        """Positions of class k's members with these ranks (each < sizes[k]), without a loop over
        bits: the word by binary search, then in the word the byte whose running popcount
        passes the rank (byte popcounts summed across the word by one multiply), then the bit
        from a table."""
        before = self.before(k)
        w = np.searchsorted(before[1:], ranks, side="right")
        j = ranks - before.take(w)  # rank within the word, < its popcount
        x = self.words(k, w)
        run = np.bitwise_count(x.view(np.uint8)).view(np.uint64)
        run *= _L8  # byte i: set bits in bytes 0..i (<= 64: no carries)
        ju = j.astype(np.uint64)
        jb = ju * _L8
        jb |= _H8
        jb -= run  # byte i keeps its high bit where run_i <= j: those bytes precede the target
        jb &= _H8
        byte = np.bitwise_count(jb).astype(np.uint64)  # the target byte's index
        sh = byte << np.uint64(3)
        prev = np.left_shift(run, np.uint64(8))  # byte i: set bits in bytes 0..i-1
        prev >>= sh
        prev &= np.uint64(0xFF)
        x >>= sh
        x &= np.uint64(0xFF)
        x <<= np.uint64(3)
        x += ju
        x -= prev  # 8 * byte value + rank within the byte
        pos = w << 6
        pos += sh.view(np.int64)
        pos += _SEL8.take(x.view(np.int64))
        return pos


def class_of(key_at: np.ndarray, thresholds: list[int]) -> np.ndarray:
    """Class index (0..K) of elements with these exponents."""
    ci = np.searchsorted(np.array(thresholds[::-1], np.int64), key_at, side="right").astype(np.uint8)
    return np.subtract(
        np.uint8(len(thresholds)), ci, out=ci
    )  # (uint8: the encoder's stable sort by class is a radix sort)


def _h(c: np.ndarray, n: np.ndarray) -> np.ndarray:
    """n * binary entropy(c / n), in bits (0 where c is 0 or n)."""
    p = np.clip(c / np.maximum(n, 1), 1e-12, 1 - 1e-12)
    out = -n * (p * np.log2(p) + (1 - p) * np.log2(1 - p))
    return np.where((c <= 0) | (c >= n), 0.0, out)


def exponent_counts(b: np.ndarray, old: np.ndarray, shift: int) -> tuple[np.ndarray, np.ndarray, int]:
    """-> (changes per base exponent (exact; old: the base bits of the changed elements),
    elements per exponent in sample(b), the sample's size), counts over every exponent
    (context_jit.exponent_counts: the same in one pass)."""
    bins = max_threshold(b.itemsize, shift)
    sampled = exponents(sample(b), shift)
    return (
        np.bincount(exponents(old, shift), minlength=bins),
        np.bincount(sampled, minlength=bins),
        sampled.size,
    )


def split(cost: np.ndarray, e: int) -> list[int]:
    """Cut points (indices into 1..e-1) of the cheapest split of e items into <= MAX_THRESHOLDS + 1
    contiguous ranges, cost[i, j] the cost of one range over items i..j-1 (context_jit.split:
    the same, compiled)."""
    best = cost[0].copy()  # best[j]: items[:j] in g ranges
    cuts = [np.zeros(e + 1, np.int64)]
    results = [(best[e], [])]
    for _ in range(min(MAX_THRESHOLDS, e - 1)):
        tot = best[:, None] + cost  # previous ranges over items[:i], one more over items[i:j]
        arg = np.argmin(tot, axis=0)
        best = tot[arg, np.arange(e + 1)]
        cuts.append(arg)
        # walk back the cut points for the full range
        bounds, j2 = [], e
        for c in reversed(cuts[1:]):
            j2 = int(c[j2])
            bounds.append(j2)
        results.append((best[e], bounds))
    return min(results, key=lambda r: r[0])[1]


def choose_thresholds(
    changed: np.ndarray, sampled: np.ndarray, sample_size: int, n: int, split=split
) -> list[int]:
    """Thresholds (descending base exponents) minimising the estimated position entropy plus
    CLASS_COST_BITS per class: an optimal split of the exponents into <= MAX_THRESHOLDS + 1
    contiguous ranges, on per-exponent change counts (exact) and element counts (sampled: of
    sample_size of the chunk's n elements, see sample() and exponent_counts())."""
    hi = np.flatnonzero(changed | sampled)
    if not hi.size:
        return []
    size = int(hi[-1]) + 1  # (the exponents present: sums over them round as they always did)
    changed = changed[:size].astype(np.float64)
    total = np.maximum(sampled[:size].astype(np.float64) * (n / max(sample_size, 1)), changed)
    if total.sum():
        total *= max(n, 1) / total.sum()
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
    bounds = split(cost, e)
    # a cut at index i: classes below exps[i] and from exps[i] on -> threshold exponent exps[i]
    return sorted((int(exps[b]) for b in bounds), reverse=True)


def check_thresholds(thresholds, itemsize: int, shift: int, what: str) -> list[int]:
    try:
        ts = [int(t) for t in thresholds]
    except (TypeError, ValueError):
        raise DeltaError(f"{what}: malformed class thresholds") from None
    top = max_threshold(itemsize, shift)
    if (
        not 1 <= len(ts) <= MAX_THRESHOLDS
        or any(not 0 < t < top for t in ts)
        or any(a <= b for a, b in zip(ts, ts[1:]))
    ):
        raise DeltaError(f"{what}: bad class thresholds {ts[:8]}")
    return ts
