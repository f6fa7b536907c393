"""Coding of changed positions within a chunk: the positions of a bool mask (fast at low
density), gaps between them Rice-coded (k raw low bits + the high part as bytes, zstd'd; k = 0
up to a mean gap of 32: the gaps themselves as bytes, zstd's Huffman stage codes them near their
entropy, and decoding is one zstd call and one cumsum), or one bit per element (a bitmap)."""

from __future__ import annotations

import numpy as np

from . import sparse_jit
from .bits import fresh
from .compress import zc, zd
from .errors import DeltaError

ESC = 255  # high part of a gap >= 255 is stored in the overflow stream


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


def low_len(k: int, m: int) -> int:
    return 0 if k == 0 else (m + low_len(k - 8, m) if k > 8 else -(-m // 8) * k)


def _unpack_check(buf, k: int, m: int) -> None:
    if len(buf) != low_len(k, m):
        raise DeltaError(f"low-bit stream has {len(buf)} bytes, expected {low_len(k, m)}")


def _unpack_low(buf, k: int, m: int) -> np.ndarray:
    _unpack_check(buf, k, m)
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
        return 0  # then also smaller than the estimate's choice
    k0 = max(0, int(round(np.log2(max(0.69 * (sample.mean() + 1), 1.0)))))
    best, best_cost = 0, None
    for k in range(max(0, k0 - 3), k0 + 1):
        q = sample >> k
        c = np.bincount(np.minimum(q, ESC))
        p = c[c > 0] / q.size
        cost = k * q.size - float((c[c > 0] * np.log2(p)).sum()) + 64 * int(c[ESC:].sum())
        if best_cost is None or cost < best_cost:
            best, best_cost = k, cost
    return best


def gap_streams(k: int, g: np.ndarray, alloc=fresh) -> tuple[np.ndarray, bytes, bytes]:
    """Gaps -> (high parts as bytes, 255 = escape (uncompressed), packed low bits, overflow high
    parts as <u8)."""
    q = np.right_shift(g, k, out=alloc("gaps.q", g.size, g.dtype)) if k else g
    q8 = alloc("gaps.q8", q.size, np.uint8)
    if q.size and int(q.max()) >= ESC:
        over = q[q >= ESC].astype("<u8").tobytes()
        q8[...] = np.minimum(q, ESC)
    else:
        over = b""
        q8[...] = q  # truncating: all < 255
    return q8, _pack_low(g & ((1 << k) - 1), k) if k else b"", over


def encode_gaps(
    pos: np.ndarray | None, k: int, gaps: np.ndarray | None = None, alloc=fresh
) -> tuple[bytes, bytes, bytes]:
    """-> (zstd'd high bytes, packed low bits, overflow high parts as <u8)."""
    q8, low, over = gap_streams(k, gaps_of(pos) if gaps is None else gaps, alloc)
    return zc(q8), low, over


def decode_gaps(k: int, qz, low, over, m: int, count: int, what: str, alloc=fresh) -> np.ndarray:
    """-> m strictly increasing positions in [0, count), or DeltaError."""
    check_gap_header(k, m, count, what)
    return gaps_from(
        k, np.frombuffer(zd(qz, m, what + " gap stream"), np.uint8), low, over, m, count, what, alloc
    )


def check_gap_header(k: int, m: int, count: int, what: str) -> None:
    if not 0 <= k <= 32:
        raise DeltaError(f"{what}: bad Rice parameter {k}")
    if m and count * m >= 1 << 62:  # rules out int64 overflow in the sum below
        raise DeltaError(f"{what}: chunk of {count} elements with {m} changes is out of range")


def gaps_from(k: int, q8: np.ndarray, low, over, m: int, count: int, what: str, alloc=fresh) -> np.ndarray:
    """decode_gaps on the decompressed high bytes (m of them; k and m checked by check_gap_header)."""
    if not k and len(low):
        raise DeltaError(f"{what}: low-bit stream has {len(low)} bytes, expected 0")
    ov = np.frombuffer(over, "<u8")
    if len(over) % 8:
        raise DeltaError(f"{what}: overflow stream does not match the gap stream")
    if not ov.size and not k:
        if m and int(q8.max()) == ESC:
            raise DeltaError(f"{what}: overflow stream does not match the gap stream")
        if m > 1 and not int(q8[1:].min()):
            raise DeltaError(f"{what}: repeated position")
        pos = prefix_sum(q8, alloc("pos", m, np.int64))  # the dense fast path
    else:
        esc = q8 == ESC
        if ov.size != int(np.count_nonzero(esc)):
            raise DeltaError(f"{what}: overflow stream does not match the gap stream")
        if ov.size and int(ov.max()) >= count:
            raise DeltaError(f"{what}: gap beyond the chunk")
        _unpack_check(low, k, m)
        pos = alloc("pos", m, np.int64)
        if sparse_jit.enabled:  # one compiled pass: positions and the gaps' statistics
            _, big, small = sparse_jit.rice_gaps(q8, low, k, ov, pos)
        else:
            gaps = pos
            gaps[...] = q8
            gaps[esc] = ov.astype(np.int64)
            if k:
                gaps <<= k
                gaps |= _unpack_low(low, k, m)
            big, small = (int(gaps.max()) if m else 0), (int(gaps[1:].min()) if m > 1 else 1)
            np.cumsum(gaps, out=pos)
        if big >= count:
            raise DeltaError(f"{what}: gap beyond the chunk")
        if m > 1 and not small:
            raise DeltaError(f"{what}: repeated position")
    if pos.size and pos[-1] >= count:
        raise DeltaError(f"{what}: position {int(pos[-1])} beyond chunk of {count}")
    return pos


def encode_bitmap(pos: np.ndarray, count: int) -> bytes:
    mask = np.zeros(count, bool)
    mask[pos] = True
    return zc(np.packbits(mask))
