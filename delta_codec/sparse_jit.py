"""Compiled (numba) kernels for the per-change work of a sparse chunk, each with the result of
the numpy code it replaces (positions.py, values.py, apply.py stay the reference and the
fallback without numba):
  - group_order / ungroup: the stable argsort of the changed values' base exponents (value grouping),
    as a counting sort over 256 keys (numpy's stable sort of uint8 is a radix sort too, but a
    general one), and the decoder's inverse of it without the permutation;
  - nibbles: nibble-pair coded values -> signed values and the escapes' places, one pass;
  - rice_gaps: Rice-coded gaps (high bytes with escapes, packed low bits, overflow) -> positions
    in one pass, with the statistics the decoder checks (escapes seen, largest gap, smallest
    gap after the first), so the checks cost no extra passes;
  - set_at: view[pos] = old + d, wrapping, without the GIL (numpy's fancy assignment holds it,
    so two apply threads serialise on it);
  - diff: the encoder's first pass, base and new bits -> changed positions, base bits there and
    differences, in one read of both (numpy: a compare pass, a count, a nonzero and two gathers;
    the 64-lane compare is context_jit's vector-compare idea for !=, then one step per change).
All nogil and cache=True, like context_jit."""

from __future__ import annotations

import numpy as np

from .bits import fresh

try:
    import numba
    from numba import types
    from numba.extending import intrinsic

    from .jit_cache import use_environment_cache
    from .llvmlite_guard import guard_llvmlite_lib

    guard_llvmlite_lib()
    use_environment_cache(numba)
except ImportError:
    numba = None

available = numba is not None
enabled = available  # (tests switch it off to compare with the numpy paths)

_ESC = 255  # (positions.ESC: a high part >= 255 is in the overflow stream)


def _group_order(keys, out):
    counts = np.zeros(257, np.int64)
    for i in range(keys.size):
        counts[keys[i] + 1] += 1
    for k in range(256):
        counts[k + 1] += counts[k]
    for i in range(keys.size):
        k = keys[i]
        out[counts[k]] = i
        counts[k] += 1


def _ungroup(old, shift, d, out):
    """out[perm[j]] = d[j], perm = the stable order of the keys (old >> shift) & 0xFF, without
    the permutation: element i takes the next value of its key's run."""
    counts = np.zeros(257, np.int64)
    for i in range(old.size):
        counts[((old[i] >> shift) & 0xFF) + 1] += 1
    for k in range(256):
        counts[k + 1] += counts[k]
    for i in range(old.size):
        k = (old[i] >> shift) & 0xFF
        out[i] = d[counts[k]]
        counts[k] += 1


def _nibbles(packed, out, esc):
    """Nibble-pair codes (code 2i low, 2i+1 high nibble of byte i) -> out: the signed values
    (unzigzag), 0 where the code is 0 (an escape: its value is in the overflow stream);
    esc: the escapes' indices. -> how many."""
    n = 0
    for i in range(out.size):
        c = (packed[i >> 1] >> ((i & 1) * 4)) & 0xF
        out[i] = (c >> 1) ^ -(c & 1)
        esc[n] = i
        n += c == 0
    return n


def _rice_gaps(q8, low, k, ov, out):
    """out[i] = sum of gaps 0..i, gap = (high << k) | low bits, high from q8 or, for q8 = 255,
    the next overflow entry. -> (escapes in q8, largest gap, smallest gap after the first).
    Reads ov only while escapes <= ov.size (the caller compares the counts)."""
    m = q8.size
    # low bits: while k > 8, a plane of m bytes per 8 bits; then groups of 8 values in k bytes
    planes = max(k - 1, 0) // 8
    kt = k - 8 * planes
    tail = planes * m
    mask = np.uint64((1 << kt) - 1)
    n_esc = 0
    big = np.int64(0)
    small = np.int64(1 << 62)
    acc = np.int64(0)
    for i in range(m):
        h = np.int64(q8[i])
        if h == _ESC:
            h = np.int64(ov[n_esc]) if n_esc < ov.size else np.int64(0)
            n_esc += 1
        g = h
        if k:
            lo = np.int64(0)
            for p in range(planes):
                lo |= np.int64(low[p * m + i]) << np.int64(8 * p)
            # value i of its group of 8: bits [kt * (i % 8), +kt) of the group's k bytes
            b0 = tail + (i // 8) * kt
            bit = (i % 8) * kt
            w = np.uint64(0)
            for j in range(bit // 8, min((bit + kt + 7) // 8, kt)):
                w |= np.uint64(low[b0 + j]) << np.uint64(8 * j)
            lo |= np.int64((w >> np.uint64(bit)) & mask) << np.int64(8 * planes)
            g = (h << np.int64(k)) | lo
        if g > big:
            big = g
        if i and g < small:
            small = g
        acc += g
        out[i] = acc
    return n_esc, big, small


if numba is not None:
    from llvmlite import ir

    @intrinsic
    def _ne64(typingctx, a, b, start):
        """Bit i: a[start + i] != b[start + i], for i < 64 (both must hold start + 64 elements):
        one 64-lane vector compare, its lane bits as the word."""

        def codegen(context, builder, signature, args):
            vty = ir.VectorType(context.get_value_type(signature.args[0].dtype), 64)

            def lanes(arrty, arr):
                data = context.make_array(arrty)(context, builder, arr).data
                return builder.load(builder.bitcast(builder.gep(data, [args[2]]), vty.as_pointer()), align=1)

            ne = builder.icmp_unsigned(
                "!=", lanes(signature.args[0], args[0]), lanes(signature.args[1], args[1])
            )
            return builder.bitcast(ne, ir.IntType(64))

        return types.uint64(a, b, types.intp), codegen

    from .context_jit import cttz as _tz


def _diff(b, n, pos, old, d):
    """Changed positions of b vs n into pos, b there into old, n - b (wrapping) into d; -> how
    many. A word of 64 compares at a time, then one step per set bit (~1 % changed: most words
    have none)."""
    size = b.size
    full = size - size % 64
    m = 0
    for w in range(0, full, 64):
        x = _ne64(b, n, w)
        while x:
            i = w + np.int64(_tz(x))
            o = b[i]
            pos[m] = i
            old[m] = o
            d[m] = n[i] - o
            m += 1
            x &= x - np.uint64(1)
    for i in range(full, size):
        if b[i] != n[i]:
            pos[m] = i
            old[m] = b[i]
            d[m] = n[i] - b[i]
            m += 1
    return m


def _set_at(view, pos, old, d):
    for i in range(pos.size):  # (checked first: nothing is written unless every position is in range)
        if pos[i] < 0 or pos[i] >= view.size:
            return i
    for i in range(pos.size):
        view[pos[i]] = old[i] + d[i]
    return -1


if available:
    _jit = numba.njit(nogil=True, cache=True)
    _group_order, _ungroup, _nibbles, _rice_gaps, _set_at, _diff = (
        _jit(_group_order),
        _jit(_ungroup),
        _jit(_nibbles),
        _jit(_rice_gaps),
        _jit(_set_at),
        _jit(_diff),
    )


def group_order(keys: np.ndarray) -> np.ndarray:
    """np.argsort(keys, kind="stable") for uint8 keys."""
    out = np.empty(keys.size, np.int64)
    _group_order(keys, out)
    return out


def ungroup(old: np.ndarray, shift: int, d: np.ndarray) -> np.ndarray:
    """d (in value_order(old, shift)'s order) back in the positions' order."""
    out = np.empty_like(d)
    _ungroup(old, old.dtype.type(shift), d, out)
    return out


def nibbles(packed: np.ndarray, out: np.ndarray, esc: np.ndarray) -> int:
    """values._decode_nibbles' expansion: codes -> signed values in out (escapes 0), escape
    indices in esc (>= out.size entries). -> the number of escapes."""
    return _nibbles(packed, out, esc)


def rice_gaps(q8: np.ndarray, low, k: int, ov: np.ndarray, out: np.ndarray) -> tuple[int, int, int]:
    """Positions into out (m = q8.size of them); -> (escapes, largest gap, smallest gap after
    the first). low: the packed low bits (length checked by the caller)."""
    return _rice_gaps(q8, np.frombuffer(low, np.uint8), k, ov, out)


def set_at(view: np.ndarray, pos: np.ndarray, old: np.ndarray, d: np.ndarray) -> int:
    """view[pos] = old + d (distinct positions; wraps at the element width). -> -1, or the index
    of the first position outside view (then nothing was written)."""
    return _set_at(view, pos, old.view(view.dtype), d.view(view.dtype))


def diff(b: np.ndarray, n: np.ndarray, alloc) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (positions where b != n, b there, n - b there, wrapping): np.flatnonzero(b != n) and
    two gathers in one pass. b, n: same-size signed-int views; the results live in `alloc`'s
    buffers (sized for every element changed; only the changed part is touched)."""
    pos = alloc("diff.pos", b.size, np.int64)
    old, d = alloc("diff.old", b.size, b.dtype), alloc("diff.d", b.size, b.dtype)
    m = _diff(b, n, pos, old, d)
    return pos[:m], old[:m], d[:m]


def warm() -> None:
    """Compile (or load from the cache) outside any timed region."""
    if not available:
        return
    group_order(np.arange(4, dtype=np.uint8))
    for dt in (np.int8, np.int16, np.int32, np.int64):
        ungroup(
            np.arange(4, dtype=dt), {1: 3, 2: 7, 4: 23, 8: 52}[np.dtype(dt).itemsize], np.arange(4, dtype=dt)
        )
    for dt in (np.int8, np.int16, np.int32, np.int64):
        nibbles(np.arange(2, dtype=np.uint8), np.empty(4, dt), np.empty(4, np.int64))
    for k in (0, 3, 11):
        rice_gaps(np.ones(3, np.uint8), bytes(_low_len(k, 3)), k, np.zeros(0, "<u8"), np.empty(3, np.int64))
    for dt in (np.int8, np.int16, np.int32, np.int64):
        set_at(np.zeros(4, dt), np.arange(2), np.ones(2, dt), np.ones(2, dt))
        diff(np.zeros(70, dt), np.ones(70, dt), fresh)


def _low_len(k: int, m: int) -> int:
    return 0 if k == 0 else (m + _low_len(k - 8, m) if k > 8 else -(-m // 8) * k)
