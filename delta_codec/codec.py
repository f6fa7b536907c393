"""Per-chunk coding of changed positions and changed values (pure numpy, vectorised).

A chunk is CHUNK consecutive elements of one tensor (4 Mi: large enough that the ~50 numpy
calls per chunk are few, so two threads rarely wait on each other's GIL hand-offs; see
docs/benchmarks.md; its temporaries live in per-worker Scratch buffers). Its changed positions are coded one of three
ways, chosen from the chunk's density before anything is built (measured crossovers; the sizes
are close there):
  GAP    gaps between changes, Rice-coded: k raw low bits + the high part as bytes, zstd'd.
         k = 0 up to a mean gap of 32 (the gaps themselves as bytes: zstd's Huffman stage codes
         them near their entropy, and decoding is one zstd call and one cumsum)
  BITMAP one bit per element, zstd'd (40-60 % changed)
  DENSE  no positions at all: every element gets a value (>= 60 % changed)
  CLASSED (format 3, encode_delta(context=True); float dtypes below CONTEXT_BELOW) positions coded per class of base magnitude
         (context.py): each class's changes as ranks among its members, gaps or a bitmap over
         the members by that class's density. Chosen when the estimated saving beats the
         classes' cost; otherwise GAP.
Values are the difference of the raw integer bit patterns (wrapping at the element width, so a
bijection for any pair; a small float update moves the pattern by a few units either way),
zig-zag coded, then zstd'd as nibble pairs (changed values: codes < 16 two a byte, larger ones
in an overflow stream) or as byte planes (dense chunks, or when many codes are large). In
sparse chunks (< GROUP_BELOW changed) values are grouped by the exponent of their base value
first (the decoder has the base, so this is free on the wire and saves bits); denser chunks skip
it (a sort per side).

Chunk record (a list; container.py frames its byte fields after a msgpack header):
  [NONE, count, 0]
  [GAP, count, m, flags, values, k, high bytes (zstd), low bits, overflow (<u8)]
  [BITMAP, count, m, flags, values, bitmap (zstd)]
  [DENSE, count, m, 0, values of all count elements (byte planes)]
  [CLASSED, count, m, flags, values, [t_1 > ... > t_K], [class 0, ..., class K]]
    class: [m_k, GAP, k, high bytes (zstd), low bits, overflow] | [m_k, BITMAP, bitmap (zstd)]
           | [0]; values in class order (class 0's changes by position, then class 1's ...)
flags: GROUPED (values ordered by base exponent), NIBBLES (values as [zstd(codes < 16, two a
byte; 0 = in the overflow), zstd(byte planes of the overflow codes)], else zstd(byte planes)).
"""
from __future__ import annotations

import threading

import numpy as np
import zstandard

from . import context as ctx
from . import context_jit as ctx_jit
from .bits import SIGNED_INT, UNSIGNED_INT, fresh, from_planes, planes, unzigzag, unzigzag_small, zigzag
from .errors import DeltaError

CHUNK = 1 << 22
NONE, GAP, BITMAP, DENSE, CLASSED = 0, 1, 2, 3, 4
GROUPED, NIBBLES = 1, 2  # chunk flags
GROUP_BELOW = 0.04   # density below which values are grouped by base exponent
CONTEXT_BELOW = 0.05  # density below which positions may be CLASSED (above: its per-change rank/select
                      # work costs more than the speed floors allow; GAP as in format 2)
BITMAP_FROM = 0.4    # density from which positions are a bitmap (below: gaps, about as small and
                     # faster to decode)
DENSE_FROM = 0.6     # density from which every element gets a value
_ESC = 255  # high part of a gap >= 255 is stored in the overflow stream

# zstd "fast" with long minimum matches and a tiny hash table: on these streams (value codes,
# gap bytes, byte planes of weights) matches are rare, so level 1's match search mostly costs
# time and its short matches cost bits (measured faster and smaller than level 1 on value and
# keyframe planes: docs/benchmarks.md).
ZSTD_PARAMS = zstandard.ZstdCompressionParameters(
    strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7,
    target_length=0)

_tls = threading.local()  # zstd contexts are reused (cheaper) but not shared across threads


def zc(data) -> bytes:
    if not hasattr(_tls, "c"):
        _tls.c = zstandard.ZstdCompressor(compression_params=ZSTD_PARAMS)
    return _tls.c.compress(data)


def zd(data, size: int, what: str, exact: bool = True) -> bytes:
    """zstd-decompressed data of `size` bytes (exact=False: at most size; the caller checks)."""
    if not hasattr(_tls, "d"):
        _tls.d = zstandard.ZstdDecompressor()
    try:
        out = _tls.d.decompress(data, max_output_size=size)
    except zstandard.ZstdError as e:
        raise DeltaError(f"{what}: zstd stream is corrupt ({e})") from None
    if exact and len(out) != size:
        raise DeltaError(f"{what}: decompressed {len(out)} bytes, expected {size}")
    return out


# --- values ----------------------------------------------------------------------------------

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
            lo |= np.bitwise_and(np.right_shift(pairs, 4, out=alloc("nib.hi", me // 2, "<u2")), 0xF0,
                                 out=alloc("nib.hi", me // 2, "<u2"))
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
    if over_n:
        z = from_planes(zd(field[1], over_n * itemsize, what + " overflow"), itemsize, over_n)
        d[positions(esc, over_n, alloc)] = unzigzag(z)
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


# --- positions -------------------------------------------------------------------------------

def _pack_low(low: np.ndarray, k: int) -> bytes:
    """k-bit values, packed: a low-byte plane while k > 8, then groups of 8 values -> k bytes
    (8 values of k <= 8 bits fit one uint64 word)."""
    if k == 0:
        return b""
    if k > 8:
        head = (low & 0xFF).astype(np.uint8).tobytes()
        return head + _pack_low(low >> 8, k - 8)
    v = np.zeros(-(-low.size // 8) * 8, np.uint64)
    v[: low.size] = low
    v = v.reshape(-1, 8)
    w = v[:, 0].copy()
    for j in range(1, 8):
        w |= v[:, j] << np.uint64(j * k)
    return w.view(np.uint8).reshape(-1, 8)[:, :k].tobytes()


def _low_len(k: int, m: int) -> int:
    return 0 if k == 0 else (m + _low_len(k - 8, m) if k > 8 else -(-m // 8) * k)


def _unpack_low(buf, k: int, m: int) -> np.ndarray:
    if len(buf) != _low_len(k, m):
        raise DeltaError(f"low-bit stream has {len(buf)} bytes, expected {_low_len(k, m)}")
    if k == 0:
        return np.zeros(m, np.int64)
    if k > 8:
        rest = _unpack_low(buf[m:], k - 8, m) << 8
        rest |= np.frombuffer(buf, np.uint8, m)
        return rest
    g = np.zeros((len(buf) // k, 8), np.uint8)
    g[:, :k] = np.frombuffer(buf, np.uint8).reshape(-1, k)
    w = g.view(np.uint64)  # (groups, 1)
    vals = (w >> (np.arange(8, dtype=np.uint64) * np.uint64(k))) & np.uint64((1 << k) - 1)
    return vals.reshape(-1)[:m].view(np.int64)  # values < 2^8: same bits


def positions(mask: np.ndarray, m: int, alloc=fresh) -> np.ndarray:
    """np.flatnonzero(mask) for a bool mask with m True. numpy's bool nonzero is branch-free from
    ~10 % set, but below that its zero-skipping loop is slow (mispredicts most around 5 %);
    there, nonzero over the mask's 8-byte words, then over the set words' bytes (both in numpy's
    fast regimes), is faster (docs/benchmarks.md)."""
    n = mask.size - mask.size % 8
    if not (m * 10 < mask.size and n >= 1 << 16):  # (small masks: fewer numpy calls pay more)
        return np.flatnonzero(mask)
    words = mask[:n].view(np.uint64)
    nzw = np.flatnonzero(np.not_equal(words, 0, out=alloc("nz.words", words.size, bool)))
    r = np.flatnonzero(np.take(words, nzw, out=alloc("nz.set", nzw.size, np.uint64)).view(bool))
    pos = np.take(nzw, np.right_shift(r, 3, out=alloc("nz.word", r.size, r.dtype)))
    pos <<= 3
    r &= 7
    pos += r
    if n < mask.size:
        pos = np.concatenate([pos, np.flatnonzero(mask[n:]) + n])
    return pos


def prefix_sum(q8: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[i] = q8[0] + ... + q8[i] (uint8 -> int64): widened first (one SIMD pass), then summed
    in place (faster than numpy's buffered, casting cumsum). numpy's cumsum keeps the GIL while
    it runs; torch's releases it but runs on a second, spinning OpenMP thread that the other
    apply thread needs (no faster with 2 apply threads, more CPU)."""
    out[...] = q8
    return np.cumsum(out, out=out)


def gaps_of(pos: np.ndarray, alloc=fresh) -> np.ndarray:
    """pos[0], then pos[i] - pos[i-1] (>= 1): positions are their cumulative sum."""
    g = alloc("gaps", pos.size, pos.dtype)
    if pos.size:
        g[0] = pos[0]
        np.subtract(pos[1:], pos[:-1], out=g[1:])
    return g


def rice_parameter(gaps: np.ndarray) -> int:
    """k minimising k raw bits + the entropy of the high byte + 64 bits per escape, estimated
    on <= 4 Ki gaps. Entropy favours k = 0 except where escapes appear, which is also where
    zstd's Huffman stage stops tracking it (long flat tails): sparse chunks get k > 0, dense
    ones k = 0 (the fastest to code, and to decode: one cumsum)."""
    sample = gaps[:4096]
    if not sample.size or sample.mean() < 32:  # escapes (gaps >= 255) negligible; measured: k = 0 is
        return 0                              # then also smaller than the estimate's choice
    k0 = max(0, int(round(np.log2(max(0.69 * (sample.mean() + 1), 1.0)))))
    best, best_cost = 0, None
    for k in range(max(0, k0 - 3), k0 + 1):
        q = sample >> k
        c = np.bincount(np.minimum(q, _ESC))
        p = c[c > 0] / q.size
        cost = k * q.size - float((c[c > 0] * np.log2(p)).sum()) + 64 * int(c[_ESC:].sum())
        if best_cost is None or cost < best_cost:
            best, best_cost = k, cost
    return best


def encode_gaps(pos: np.ndarray | None, k: int, gaps: np.ndarray | None = None, alloc=fresh) -> tuple[bytes, bytes, bytes]:
    """-> (zstd'd high bytes, packed low bits, overflow high parts as <u8)."""
    g = gaps_of(pos) if gaps is None else gaps
    q = np.right_shift(g, k, out=alloc("gaps.q", g.size, g.dtype)) if k else g
    q8 = alloc("gaps.q8", q.size, np.uint8)
    if q.size and int(q.max()) >= _ESC:
        over = q[q >= _ESC].astype("<u8").tobytes()
        q8[...] = np.minimum(q, _ESC)
    else:
        over = b""
        q8[...] = q  # truncating: all < 255
    return zc(q8), _pack_low(g & ((1 << k) - 1), k) if k else b"", over


def decode_gaps(k: int, qz, low, over, m: int, count: int, what: str, alloc=fresh) -> np.ndarray:
    """-> m strictly increasing positions in [0, count), or DeltaError."""
    if not 0 <= k <= 32:
        raise DeltaError(f"{what}: bad Rice parameter {k}")
    if m and count * m >= 1 << 62:  # rules out int64 overflow in the sum below
        raise DeltaError(f"{what}: chunk of {count} elements with {m} changes is out of range")
    if not k and len(low):
        raise DeltaError(f"{what}: low-bit stream has {len(low)} bytes, expected 0")
    q8 = np.frombuffer(zd(qz, m, what + " gap stream"), np.uint8)
    ov = np.frombuffer(over, "<u8")
    if len(over) % 8:
        raise DeltaError(f"{what}: overflow stream does not match the gap stream")
    if not ov.size and not k:
        if m and int(q8.max()) == _ESC:
            raise DeltaError(f"{what}: overflow stream does not match the gap stream")
        if m > 1 and not int(q8[1:].min()):
            raise DeltaError(f"{what}: repeated position")
        pos = prefix_sum(q8, alloc("pos", m, np.int64))  # the dense fast path
    else:
        gaps = q8.astype(np.int64)
        if ov.size:
            esc = q8 == _ESC
            if ov.size != int(np.count_nonzero(esc)):
                raise DeltaError(f"{what}: overflow stream does not match the gap stream")
            if int(ov.max()) >= count:
                raise DeltaError(f"{what}: gap beyond the chunk")
            gaps[esc] = ov.astype(np.int64)
        elif m and int(q8.max()) == _ESC:
            raise DeltaError(f"{what}: overflow stream does not match the gap stream")
        if k:
            gaps <<= k
            gaps |= _unpack_low(low, k, m)
        if gaps.size and int(gaps.max()) >= count:
            raise DeltaError(f"{what}: gap beyond the chunk")
        if m > 1 and not int(gaps[1:].min()):
            raise DeltaError(f"{what}: repeated position")
        pos = np.cumsum(gaps, out=gaps)
    if pos.size and pos[-1] >= count:
        raise DeltaError(f"{what}: position {int(pos[-1])} beyond chunk of {count}")
    return pos


# --- chunks ----------------------------------------------------------------------------------

def value_order(base_at_pos: np.ndarray, shift: int | None) -> np.ndarray | None:
    """Permutation grouping changed values by the exponent of their base value: how many units an
    update moves depends on the exponent, so zstd's per-block Huffman tables fit each group
    (bits saved on AdamW updates: docs/benchmarks.md). The decoder has the base, so it is free."""
    if shift is None or base_at_pos.size < 2:
        return None
    exp = (base_at_pos >> base_at_pos.dtype.type(shift)).astype(np.uint8)  # exponent (+ sign): 8-bit radix sort
    return np.argsort(exp, kind="stable")


def encode_chunk(b: np.ndarray, n: np.ndarray, shift: int | None = None, alloc=fresh,
                 context: bool = True) -> tuple[list, int]:
    """-> (wire record, changed count). b, n: same-size signed-int views of base and new bits;
    shift: mantissa bits of a float dtype (value grouping and position context), None otherwise;
    alloc: where temporaries live (a Scratch reuses them across chunks); context: False codes
    positions without the base (format 2's chunk coding, kept for comparisons)."""
    count = b.size
    mask = np.not_equal(b, n, out=alloc("mask", count, bool))
    m = int(np.count_nonzero(mask))
    if m == 0:
        return [NONE, count, 0], 0
    p = m / count
    if p >= DENSE_FROM:
        return [DENSE, count, m, 0, encode_values(np.subtract(n, b, out=alloc("d", count, b.dtype)), alloc)[0]], m
    pos = positions(mask, m, alloc)
    if context and shift is not None and p < CONTEXT_BELOW and m >= ctx.MIN_CHANGES:
        rec = _encode_classed(b, n, pos, p, shift, alloc)
        if rec is not None:
            return rec, m
    old = np.take(b, pos, out=alloc("old", m, b.dtype))  # (take: faster than fancy indexing)
    d = np.take(n, pos, out=alloc("d", m, b.dtype))
    d -= old  # wraps at the element width: a bijection for any pair
    flags = 0
    if p < GROUP_BELOW and shift is not None and m > 1:
        d = np.take(d, value_order(old, shift), out=alloc("old", m, b.dtype))
        flags = GROUPED
    vals, vflags = encode_values(d, alloc, nonzero=True)
    flags |= vflags
    if p >= BITMAP_FROM:
        return [BITMAP, count, m, flags, vals, _bitmap(pos, count)], m
    g = gaps_of(pos, alloc)
    del pos
    k = rice_parameter(g)
    return [GAP, count, m, flags, vals, k, *encode_gaps(None, k, g, alloc)], m


def _encode_classed(b, n, pos, p: float, shift: int, alloc) -> list | None:
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


def _decode_classed(rec, m: int, count: int, what: str, base_all, shift: int | None, itemsize: int, alloc):
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


def _bitmap(pos: np.ndarray, count: int) -> bytes:
    mask = np.zeros(count, bool)
    mask[pos] = True
    return zc(np.packbits(mask))


def chunk_header(rec, what: str) -> tuple[int, int, int]:
    try:
        mode, count, m = int(rec[0]), int(rec[1]), int(rec[2])
    except (TypeError, ValueError, IndexError):
        raise DeltaError(f"{what}: malformed chunk record") from None
    if not 0 <= m <= count:
        raise DeltaError(f"{what}: {m} changes in a chunk of {count}")
    return mode, count, m


def decode_chunk(rec, itemsize: int, what: str, base_at=None, shift: int | None = None, alloc=fresh,
                 base_all=None):
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
            mask = np.unpackbits(np.frombuffer(zd(rec[5], (count + 7) // 8, what + " bitmap"), np.uint8))[:count]
            pos = np.flatnonzero(mask.view(bool))  # (bool nonzero: much faster than uint8's)
            if pos.size != m:
                raise DeltaError(f"{what}: bitmap has {pos.size} changes, header says {m}")
        elif mode == CLASSED:
            pos, old = _decode_classed(rec, m, count, what, base_all, shift, itemsize, alloc)
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
        if (perm := value_order(old, shift)) is not None:
            out = np.empty_like(d)
            out[perm] = d
            d = out
    return pos, d, count, old
