"""Compiled (numba) rank <-> position for CLASSED chunks (context.py's numpy path is the
fallback and the reference; both give the same bytes and the same applied state).

Classes as in context.py: thresholds t_1 > ... > t_K (K <= KMAX), nested sets
S_t = {e < t_t}; class 0 is outside S_1, class k in S_k but not S_{k+1}, class K in S_K.
Two passes, both sides:
  1. over the chunk: per 64-element word, its exponents narrowed to bytes once, then the
     membership bits of each S_t (one 64-lane byte compare each, _lt64; always KMAX compares,
     unrolled, unused thresholds 0 = empty sets),
     and the members of each before every superblock of SB words (counts in registers, stored
     once per superblock: the pass writes the words and little else);
  2. over the changes only. Encoder: a change's class is how many S_t hold it, its rank a
     difference of two of those counts plus popcounts inside its superblock (masks from
     compares: no branch per change). Decoder, per class: a branch-free merge of its
     increasing ranks with its counts per group of BB superblocks, BB - 1 compares for the
     superblock, then the word from SB popcounts and the bit from a select (BMI2's pdep where
     the CPU has a fast one, else a SWAR select). The decoder runs both passes block by block
     (BLOCK_SB superblocks), so each block's base bits are still in cache when its changes'
     base bits are gathered, and its words never leave the cache.
O(chunk / 64 + changes) after the compares; no branch that depends on where the changes are
(the earlier single pass mispredicted on most words at ~1 % changed). nogil, so apply threads
run side by side; cache=True keeps the compiled code across processes. Temporaries (KMAX words
per 64 elements, KMAX counts per superblock) live in the worker's Scratch. Pass 1 asks for the
lines it reads PREFETCH bytes ahead (docs/benchmarks.md: the cold pass is faster). Pass 1 reads the
whole base chunk, which format 2's coding never does on apply: that read is most of what
CLASSED still costs over GAP there.
Also compiled here, with results equal to context.py's: the exponent counts that
choose_thresholds works on, and its split of the exponents (the same sums in the same order).
"""

from __future__ import annotations

import numpy as np

from .bits import UNSIGNED_INT
from .context import MAX_THRESHOLDS, SAMPLE_RUN, SAMPLE_STRIDE, max_threshold
from .tasks import scratch

try:
    import numba
    from numba import types
    from numba.extending import intrinsic

    from .jit_cache import use_environment_cache
    from .llvmlite_guard import guard_llvmlite_lib

    guard_llvmlite_lib()  # (else vLLM's CPU workers fail to start in a process that imported us)
    use_environment_cache(numba)
except ImportError:  # (numpy fallback in context.py)
    numba = None

KMAX = 4  # thresholds the kernels handle (their per-thread arrays are this size)
available = numba is not None and MAX_THRESHOLDS <= KMAX
enabled = available  # (tests switch it off to compare with the numpy path)


_L8, _H8 = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080)
_M1, _M2, _M4 = np.uint64(0x5555555555555555), np.uint64(0x3333333333333333), np.uint64(0x0F0F0F0F0F0F0F0F)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_BIG = 1 << 62
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
    from llvmlite import ir

    @intrinsic
    def _ctpop(typingctx, x):
        """LLVM's popcount: one instruction where the CPU has it (the SWAR above otherwise)."""

        def codegen(context, builder, signature, args):
            return builder.ctpop(args[0])

        return types.uint64(types.uint64), codegen

    def _popc(x):
        return np.int64(_ctpop(x))

    @intrinsic
    def _lt64(typingctx, arr, start, em, sh, t):
        """Bit i: ((arr[start + i] & em) >> sh) < (t >> sh) (unsigned: exponent < threshold
        exponent), for i < 64; arr[start: start + 64] must exist. One compare of a 64-lane
        vector, its lane bits as the word: the exponents are narrowed to bytes first (16 bits for
        float64's 11-bit exponents), so a 16-bit element's 64 lanes are one byte compare into a
        64-bit mask register (AVX-512BW) per threshold, not two word compares and a merge;
        inlined side by side, the four thresholds share the load, mask, shift and narrowing."""

        def codegen(context, builder, signature, args):
            arrty = signature.args[0]
            lty = context.get_value_type(arrty.dtype)
            nty = ir.IntType(16 if lty.width > 32 else min(8, lty.width))
            vty, nvty = ir.VectorType(lty, 64), ir.VectorType(nty, 64)
            data = context.make_array(arrty)(context, builder, args[0]).data
            v = builder.load(builder.bitcast(builder.gep(data, [args[1]]), vty.as_pointer()), align=1)

            def splat(val, ty):
                one = builder.insert_element(
                    ir.Constant(vty, ir.Undefined),
                    context.cast(builder, val, ty, arrty.dtype),
                    ir.Constant(ir.IntType(32), 0),
                )
                return builder.shuffle_vector(
                    one,
                    ir.Constant(vty, ir.Undefined),
                    ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64),
                )

            sh = splat(args[3], signature.args[3])
            e = builder.lshr(builder.and_(v, splat(args[2], signature.args[2])), sh)
            te = builder.lshr(splat(args[4], signature.args[4]), sh)
            if nty.width < lty.width:
                e, te = builder.trunc(e, nvty), builder.trunc(te, nvty)
            return builder.bitcast(builder.icmp_unsigned("<", e, te), ir.IntType(64))

        return types.uint64(arr, types.intp, em, sh, t), codegen

    @intrinsic
    def _pdep(typingctx, src, mask):
        """BMI2's parallel bit deposit (only compiled where the CPU has it: see _sel)."""

        def codegen(context, builder, signature, args):
            from numba.core import cgutils

            fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(64)])
            return builder.call(
                cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.bmi.pdep.64"), args
            )

        return types.uint64(types.uint64, types.uint64), codegen

    @intrinsic
    def _prefetch(typingctx, arr, byte):
        """Ask the cache for the line at byte `byte` of arr's data (a read, to be kept); past the
        end is harmless (a prefetch never faults)."""

        def codegen(context, builder, signature, args):
            from numba.core import cgutils

            i8p = ir.IntType(8).as_pointer()
            data = builder.bitcast(context.make_array(signature.args[0])(context, builder, args[0]).data, i8p)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
            i32 = lambda v: ir.Constant(ir.IntType(32), v)
            builder.call(
                cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8"),
                [builder.gep(data, [args[1]]), i32(0), i32(3), i32(1)],
            )
            return context.get_dummy_value()

        return types.void(arr, types.intp), codegen

    @intrinsic
    def cttz(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

        return types.uint64(types.uint64), codegen

    try:
        import llvmlite.binding as _llvm

        # (Zen 1/2 have BMI2 but a microcoded pdep, slower than the portable select)
        _BMI2 = bool(_llvm.get_host_cpu_features().get("bmi2")) and _llvm.get_host_cpu_name() not in (
            "znver1",
            "znver2",
        )
    except Exception:  # (unknown host: the portable select)
        _BMI2 = False
else:
    _popc = _pop
    _BMI2 = False


def _sel_swar(x, j, tab):
    """Bit index of x's j-th set bit (j < popcount(x)), branch-free: the byte whose running
    popcount passes j, then a table."""
    run = _bytepop(x) * _L8  # byte i: set bits in bytes 0..i (<= 64: no carries)
    ju = np.uint64(j)
    jb = (((ju * _L8) | _H8) - run) & _H8  # high bit kept in bytes with run_i <= j
    sh = (((jb >> np.uint64(7)) * _L8) >> np.uint64(56)) << np.uint64(3)
    prev = ((run << np.uint64(8)) >> sh) & np.uint64(0xFF)
    xb = (x >> sh) & np.uint64(0xFF)
    return np.int64(sh) + np.int64(tab[np.int64(xb * np.uint64(8) + ju - prev)])


def _sel_bmi2(x, j, tab):
    """The same with BMI2: deposit bit j into x's set bits, then its index (two instructions)."""
    return np.int64(cttz(_pdep(np.uint64(1) << np.uint64(j), x)))


_sel = _sel_bmi2 if _BMI2 else _sel_swar


PREFETCH = 8192  # bytes ahead that pass 1 asks the cache for
SB = 4  # words per superblock: members are counted per superblock, popcounts find the word inside
BB = 8  # superblocks per group of the decoder's merge (fewer merge steps; compares find the superblock)
BLOCK_SB = 512  # superblocks per block of the decoder (128 Ki elements: 256 KiB of bf16 and 64 KiB of
# words, in L2 from the block's compares to its gathers; a chunk-wide pass read the
# chunk from memory twice and wrote its words there)


def _masks(u, em, sh, ts, m, sbc):
    """Pass 1: m[t, w]: membership bits of S_t = {|bits| < ts[t]} in word w (0 past the chunk's
    end), t < KMAX (thresholds past the chunk's are 0: empty sets, so every chunk runs the same
    four compares, unrolled, with the counts in registers); sbc[t, q]: members of S_t before
    superblock q (q <= number of superblocks; the last entry counts the whole chunk)."""
    n = u.size
    nw = (n + 63) // 64
    nsb = (nw + SB - 1) // SB
    t0, t1, t2, t3 = ts[0], ts[1], ts[2], ts[3]
    s0 = s1 = s2 = s3 = np.int64(0)
    full = n // 64
    for q in range(nsb):
        sbc[0, q] = s0
        sbc[1, q] = s1
        sbc[2, q] = s2
        sbc[3, q] = s3
        for w in range(q * SB, min(q * SB + SB, full)):
            for c in range(0, 64 * u.itemsize, 64):  # (the word's lines, PREFETCH bytes ahead)
                _prefetch(u, (w * 64) * u.itemsize + PREFETCH + c)
            a0 = _lt64(u, w * 64, em, sh, t0)
            a1 = _lt64(u, w * 64, em, sh, t1)
            a2 = _lt64(u, w * 64, em, sh, t2)
            a3 = _lt64(u, w * 64, em, sh, t3)
            m[0, w] = a0
            m[1, w] = a1
            m[2, w] = a2
            m[3, w] = a3
            s0 += _popc(a0)
            s1 += _popc(a1)
            s2 += _popc(a2)
            s3 += _popc(a3)
    if n % 64:  # the last, partial word (in the last superblock: its count is already stored)
        lo = n - n % 64
        for t in range(KMAX):
            a = np.uint64(0)
            for i in range(n - lo):
                a |= np.uint64((u[lo + i] & em) < ts[t]) << np.uint64(i)
            m[t, nw - 1] = a
        s0 += _popc(m[0, nw - 1])
        s1 += _popc(m[1, nw - 1])
        s2 += _popc(m[2, nw - 1])
        s3 += _popc(m[3, nw - 1])
    sbc[0, nsb] = s0
    sbc[1, nsb] = s1
    sbc[2, nsb] = s2
    sbc[3, nsb] = s3
    for t in range(KMAX):
        for w in range(nw, m.shape[1]):  # (padding to whole superblocks)
            m[t, w] = 0


def _sb_before(k, q, n, sbc):
    """Class k's members before superblock q (q <= number of superblocks)."""
    hi = min(q * SB * 64, n) if k == 0 else sbc[k - 1, q]
    return hi - (sbc[k, q] if k < KMAX else 0)


def _upto(a0, a1, a2, a3, r, below):
    """Set bits of words a0..a3 of a superblock before bit `below` of word r (< SB): whole words
    before r, `below`'s bits of word r, none after (masks from compares: no branch)."""
    f0, f1, f2 = _ones(0 < r), _ones(1 < r), _ones(2 < r)  # word i wholly before
    return (
        _popc(a0 & (f0 | (_ones(r == 0) & below)))
        + _popc(a1 & (f1 | (_ones(r == 1) & below)))
        + _popc(a2 & (f2 | (_ones(r == 2) & below)))
        + _popc(a3 & _ones(r == 3) & below)
    )


def _ones(flag):
    """All ones where flag, else 0."""
    return np.uint64(0) - np.uint64(flag)


def _enc(u, em, sh, ts, nt, pos, out_pos, out_rank, starts, sizes, m, sbc, old, d, out_old, out_d):
    """pos: sorted changed positions -> out_pos/out_rank in class order (class 0's by position,
    then class 1's ...), starts[k]: class k's first index there; sizes: class member counts.
    A change's class c is how many S_t hold it; with S_{-1} = p, S_t = members of S_t before p
    (0 for the empty sets past nt), its rank is S_{c-1} - S_c (no branch). old, d (values per
    change, position order; or empty) are put in class order too (out_old, out_d)."""
    mm = pos.size
    n = u.size
    nw = (n + 63) // 64
    nsb = (nw + SB - 1) // SB
    _masks(u, em, sh, ts, m, sbc)
    ci = np.empty(mm, np.uint8)
    rk = np.empty(mm, np.int64)
    nk = np.zeros(KMAX + 1, np.int64)
    for j in range(mm):
        p = pos[j]
        w = p >> 6
        q = w >> 2
        r = w & 3
        w0 = q * SB
        b = np.uint64(p & 63)
        below = (np.uint64(1) << b) - np.uint64(1)
        c0 = sbc[0, q] + _upto(m[0, w0], m[0, w0 + 1], m[0, w0 + 2], m[0, w0 + 3], r, below)
        c1 = sbc[1, q] + _upto(m[1, w0], m[1, w0 + 1], m[1, w0 + 2], m[1, w0 + 3], r, below)
        c2 = sbc[2, q] + _upto(m[2, w0], m[2, w0 + 1], m[2, w0 + 2], m[2, w0 + 3], r, below)
        c3 = sbc[3, q] + _upto(m[3, w0], m[3, w0 + 1], m[3, w0 + 2], m[3, w0 + 3], r, below)
        c = (
            np.int64((m[0, w] >> b) & np.uint64(1))
            + np.int64((m[1, w] >> b) & np.uint64(1))
            + np.int64((m[2, w] >> b) & np.uint64(1))
            + np.int64((m[3, w] >> b) & np.uint64(1))
        )
        e0, e1, e2, e3, e4 = (
            np.int64(c == 0),
            np.int64(c == 1),
            np.int64(c == 2),
            np.int64(c == 3),
            np.int64(c == 4),
        )
        rk[j] = (p * e0 + c0 * e1 + c1 * e2 + c2 * e3 + c3 * e4) - (c0 * e0 + c1 * e1 + c2 * e2 + c3 * e3)
        ci[j] = c
        nk[c] += 1
    starts[0] = 0
    for k in range(nt + 1):
        sizes[k] = _sb_before(k, nsb, n, sbc)
        starts[k + 1] = starts[k] + nk[k]
    f = starts[: nt + 1].copy()
    for j in range(mm):
        c = ci[j]
        out_pos[f[c]] = pos[j]
        out_rank[f[c]] = rk[j]
        f[c] += 1
    if old.size:
        f[:] = starts[: nt + 1]
        for j in range(mm):
            c = ci[j]
            out_old[f[c]] = old[j]
            out_d[f[c]] = d[j]
            f[c] += 1


def _dec(u, em, sh, ts, nt, ranks, starts, out, old, found, sizes, m, sbc, sbk, sbi, cur, tot):
    """ranks: each class's strictly increasing ranks, class k's at starts[k]:starts[k+1] ->
    out: their positions, same layout, and old: the base bits there; found[k]: how many of class
    k's ranks were found (fewer than given: a rank beyond the class); sizes: class member counts.
    Block by block (BLOCK_SB superblocks, so the block's bits and words stay in cache from its
    compares to the gathers of its changes' base bits): pass 1 on the block, then per class the
    ranks that fall in it, without a branch that depends on the data: a merge of those ranks with
    the class's counts before each superblock (sbk) per group of BB gives each rank's superblock
    (sbi); then the word inside it from SB popcounts, and the bit from _sel. cur[k]: class k's
    next rank; tot[k]: its members before the block."""
    n = u.size
    nsb = (n + 64 * SB - 1) // (64 * SB)
    for k in range(nt + 1):
        cur[k] = starts[k]
        tot[k] = 0
    for b0 in range(0, nsb, BLOCK_SB):
        lo = b0 * SB * 64
        hi = min(n, lo + BLOCK_SB * SB * 64)
        blk = u[lo:hi]
        nb = hi - lo
        nq = (nb + 64 * SB - 1) // (64 * SB)
        ng = nq // BB + 1  # groups, the last holding superblock nq (counts at the block's end)
        _masks(blk, em, sh, ts, m, sbc)
        for k in range(nt + 1):
            before = tot[k]
            end = before + _sb_before(k, nq, nb, sbc)
            tot[k] = end
            s = cur[k]
            e = s
            while e < starts[k + 1] and ranks[e] < end:
                e += 1
            if s == e:
                continue
            cur[k] = e
            for q in range(nq):
                sbk[q] = before + _sb_before(k, q, nb, sbc)
            sbk[nq] = end
            for q in range(nq + 1, ng * BB + 1):
                sbk[q] = _BIG
            g = 0
            i = s
            while i < e:  # merge with every BB-th count (at most e - s + ng steps)
                r = ranks[i]
                adv = np.int64(sbk[(g + 1) * BB] <= r)
                sbi[i] = g
                g += adv
                i += 1 - adv
            for i in range(s, e):  # the superblock inside the group: BB - 1 compares
                r = ranks[i]
                q0 = sbi[i] * BB
                h = np.int64(0)
                for t in range(1, BB):
                    h += np.int64(sbk[q0 + t] <= r)
                sbi[i] = q0 + h
            # class k's words: (row hi, or all ones for class 0) and not (row lo, none past KMAX)
            rh = max(k - 1, 0)
            ah = _ALL if k == 0 else np.uint64(0)
            rl = min(k, KMAX - 1)
            al = _ALL if k < KMAX else np.uint64(0)
            for i in range(s, e):
                q = sbi[i]
                j = ranks[i] - sbk[q]
                w0 = q * SB
                x0 = (m[rh, w0] | ah) & ~(m[rl, w0] & al)
                x1 = (m[rh, w0 + 1] | ah) & ~(m[rl, w0 + 1] & al)
                x2 = (m[rh, w0 + 2] | ah) & ~(m[rl, w0 + 2] & al)
                x3 = (m[rh, w0 + 3] | ah) & ~(m[rl, w0 + 3] & al)
                p1 = _popc(x0)
                p2 = p1 + _popc(x1)
                p3 = p2 + _popc(x2)
                h1 = np.int64(p1 <= j)
                h2 = np.int64(p2 <= j)
                h3 = np.int64(p3 <= j)
                x = x0 + np.uint64(h1) * (x1 - x0) + np.uint64(h2) * (x2 - x1) + np.uint64(h3) * (x3 - x2)
                pre = h1 * p1 + h2 * (p2 - p1) + h3 * (p3 - p2)
                p = lo + (w0 + h1 + h2 + h3) * 64 + _sel(x, j - pre, _SEL8)
                out[i] = p
                old[i] = u[p]
    for k in range(nt + 1):
        sizes[k] = tot[k]
        found[k] = cur[k] - starts[k]


def _counts(u, shift, ebits, old, changed, sampled):
    """context.exponent_counts in one pass: changes per exponent, and elements per exponent in
    context.sample()'s elements (every SAMPLE_STRIDE-th run of SAMPLE_RUN, or every
    SAMPLE_STRIDE-th element in small chunks) -> the sample's size. Four partial counts, summed
    at the end (neighbours often share an exponent: one count would wait on its last store)."""
    sh = u.dtype.type(shift)
    em = u.dtype.type((1 << ebits) - 1)
    h = np.zeros((4, 1 << ebits), np.int64)
    mm = old.size
    for j in range(0, mm - mm % 4, 4):
        h[0, (old[j] >> sh) & em] += 1
        h[1, (old[j + 1] >> sh) & em] += 1
        h[2, (old[j + 2] >> sh) & em] += 1
        h[3, (old[j + 3] >> sh) & em] += 1
    for j in range(mm - mm % 4, mm):
        h[0, (old[j] >> sh) & em] += 1
    for x in range(1 << ebits):
        changed[x] = h[0, x] + h[1, x] + h[2, x] + h[3, x]
    h[:] = 0
    runs = u.size // SAMPLE_RUN
    size = 0
    if runs < 64 * SAMPLE_STRIDE:
        for i in range(0, u.size, SAMPLE_STRIDE):
            h[i & 3, (u[i] >> sh) & em] += 1
            size += 1
    else:
        for r in range(0, runs, SAMPLE_STRIDE):
            for i in range(r * SAMPLE_RUN, r * SAMPLE_RUN + SAMPLE_RUN, 4):  # (SAMPLE_RUN: a multiple of 4)
                h[0, (u[i] >> sh) & em] += 1
                h[1, (u[i + 1] >> sh) & em] += 1
                h[2, (u[i + 2] >> sh) & em] += 1
                h[3, (u[i + 3] >> sh) & em] += 1
            size += SAMPLE_RUN
    for x in range(1 << ebits):
        sampled[x] = h[0, x] + h[1, x] + h[2, x] + h[3, x]
    return size


def _split(cost, e, kmax, cuts, bounds):
    """context.split, compiled: the same sums in the same order, the first minimum on ties ->
    number of cut points (in bounds)."""
    best = cost[0].copy()
    best_total = best[e]
    best_g = 0
    for g in range(1, min(kmax, e - 1) + 1):
        nb = np.empty(e + 1)
        for j in range(e + 1):
            a = 0
            v = best[0] + cost[0, j]
            for i in range(1, e + 1):
                x = best[i] + cost[i, j]
                if x < v:
                    v = x
                    a = i
            nb[j] = v
            cuts[g, j] = a
        best = nb
        if best[e] < best_total:
            best_total = best[e]
            best_g = g
    j2 = e
    for g in range(best_g, 0, -1):
        j2 = cuts[g, j2]
        bounds[best_g - g] = j2
    return best_g


if available:
    _jit = numba.njit(nogil=True, cache=True)
    _inl = numba.njit(
        nogil=True, cache=True, inline="always"
    )  # (helpers: calls between compiled functions are not inlined otherwise)
    _bytepop, _pop, _popc, _sel, _masks, _sb_before, _upto, _ones = (
        _inl(f) for f in (_bytepop, _pop, _popc, _sel, _masks, _sb_before, _upto, _ones)
    )
    _enc, _dec, _counts, _split = _jit(_enc), _jit(_dec), _jit(_counts), _jit(_split)


def _args(b: np.ndarray, shift: int, thresholds: list[int]):
    """Unsigned view, |bits| mask, the shift to the exponent, thresholds on |bits| (|bits| < t <<
    shift exactly when the exponent is < t), their count."""
    u = b.view(UNSIGNED_INT[b.itemsize])
    ts = np.zeros(KMAX, u.dtype)
    ts[: len(thresholds)] = [t << shift for t in thresholds]
    return u, u.dtype.type((1 << (8 * b.itemsize - 1)) - 1), u.dtype.type(shift), ts, len(thresholds)


def _temps(n: int):
    """Pass 1's words (padded to whole superblocks) and counts per superblock, in the worker's
    Scratch."""
    alloc, nsb = scratch(), -(-n // (64 * SB))
    return (
        alloc("jit.m", KMAX * nsb * SB, np.uint64).reshape(KMAX, nsb * SB),
        alloc("jit.sbc", KMAX * (nsb + 1), np.int64).reshape(KMAX, nsb + 1),
    )


def encode_ranks(b: np.ndarray, pos: np.ndarray, shift: int, thresholds: list[int], old=None, d=None):
    """-> (positions in class order, their ranks within their class, class bounds (K + 2),
    class sizes (K + 1)); with old and d (b's dtype, one per position): also them in class
    order."""
    u, em, sh, ts, nt = _args(b, shift, thresholds)
    out_pos = np.empty(pos.size, np.int64)
    out_rank = np.empty(pos.size, np.int64)
    starts = np.zeros(KMAX + 2, np.int64)
    sizes = np.zeros(KMAX + 1, np.int64)
    carry = old is not None
    old, d = (old, d) if carry else (b[:0], b[:0])
    out_old, out_d = np.empty_like(old), np.empty_like(d)
    _enc(
        u,
        em,
        sh,
        ts,
        nt,
        pos.astype(np.int64, copy=False),
        out_pos,
        out_rank,
        starts,
        sizes,
        *_temps(u.size),
        old,
        d,
        out_old,
        out_d,
    )
    res = out_pos, out_rank, starts[: nt + 2].tolist(), sizes[: nt + 1].tolist()
    return (*res, out_old, out_d) if carry else res


def select(b: np.ndarray, shift: int, thresholds: list[int], parts: list[np.ndarray]):
    """parts[k]: class k's strictly increasing ranks (K + 1 of them) -> (positions in class
    order, b there, ranks found per class, class sizes)."""
    u, em, sh, ts, nt = _args(b, shift, thresholds)
    starts = np.cumsum([0, *(p.size for p in parts)]).astype(np.int64)
    ranks = np.concatenate(parts).astype(np.int64, copy=False)
    out = np.empty(ranks.size, np.int64)
    old = np.empty(ranks.size, u.dtype)
    found = np.zeros(KMAX + 1, np.int64)
    sizes = np.zeros(KMAX + 1, np.int64)
    alloc = scratch()
    _dec(
        u,
        em,
        sh,
        ts,
        nt,
        ranks,
        starts,
        out,
        old,
        found,
        sizes,
        alloc("jit.bm", KMAX * BLOCK_SB * SB, np.uint64).reshape(KMAX, BLOCK_SB * SB),
        alloc("jit.bsbc", KMAX * (BLOCK_SB + 1), np.int64).reshape(KMAX, BLOCK_SB + 1),
        alloc("jit.sbk", (BLOCK_SB // BB + 1) * BB + 1, np.int64),
        alloc("jit.sbi", ranks.size, np.int64),
        np.zeros(KMAX + 1, np.int64),
        np.zeros(KMAX + 1, np.int64),
    )
    return out, old.view(b.dtype), found[: nt + 1].tolist(), sizes[: nt + 1].tolist()


def exponent_counts(b: np.ndarray, old: np.ndarray, shift: int) -> tuple[np.ndarray, np.ndarray, int]:
    """context.exponent_counts (the same counts) in one compiled pass over the sample's runs and
    the changed elements' base bits."""
    ut = UNSIGNED_INT[b.itemsize]
    bins = max_threshold(b.itemsize, shift)
    changed, sampled = np.zeros(bins, np.int64), np.zeros(bins, np.int64)
    size = _counts(b.view(ut), shift, (bins - 1).bit_length(), old.view(ut), changed, sampled)
    return changed, sampled, size


def split(cost: np.ndarray, e: int) -> list[int]:
    """context.split, compiled (the same cut points)."""
    cuts = np.zeros((MAX_THRESHOLDS + 1, e + 1), np.int64)
    bounds = np.zeros(MAX_THRESHOLDS, np.int64)
    return bounds[: _split(cost, e, MAX_THRESHOLDS, cuts, bounds)].tolist()


def warm() -> None:
    """Compile (or load from the cache) for every float width, outside any timed region."""
    if not available:
        return
    for dt, shift in ((np.int8, 3), (np.int16, 7), (np.int32, 23), (np.int64, 52)):
        b = np.arange(64, dtype=dt)
        eb = 8 * b.itemsize - 1 - shift
        ts = [3, 1] if eb > 2 else [1]
        op, r, st, sz = encode_ranks(b, np.array([1, 5], np.int64), shift, ts)
        select(b, shift, ts, [r[st[k] : st[k + 1]] for k in range(len(ts) + 1)])
        encode_ranks(b, np.array([1, 5], np.int64), shift, ts, b[[1, 5]], b[[1, 5]])
        exponent_counts(b, b[[1, 5]], shift)
    split(np.zeros((3, 3)), 2)
