"""delta_codec format 3's compiled (numba) rank/select agrees with the numpy path: the same
bytes from encode_delta, the same applied state from either decoder, the same ranks, positions
and class sizes per class; forged class records are refused by both with the state untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delta_codec import Delta, apply_delta, classed, encode_delta
from delta_codec import context as ctx
from delta_codec.compress import zc_blocks, zd
from delta_codec.modes import CLASSED
from delta_codec.positions import gap_streams, gaps_of
from tests.helpers.delta import adam_like, clone, first_classed, float_update, forge, modes, refused, same

pytest.importorskip("numba")
from delta_codec import context_jit as cj  # noqa: E402

INTS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
SHIFT = {1: 3, 2: 7, 4: 23, 8: 52}


@pytest.fixture(params=[True, False], ids=["numba", "numpy"])
def path(request, monkeypatch):
    monkeypatch.setattr(cj, "enabled", request.param)
    return request.param


def encoded(base, new, jit: bool, **kw) -> bytes:
    was = cj.enabled
    cj.enabled = jit
    try:
        return encode_delta(base, new, context=True, **kw).to_bytes()
    finally:
        cj.enabled = was


def applied(base, blob: bytes, jit: bool) -> dict:
    was = cj.enabled
    cj.enabled = jit
    try:
        state = clone(base)
        apply_delta(state, Delta.from_bytes(blob))
        return state
    finally:
        cj.enabled = was


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(float_update(), st.sampled_from([64, 1000, 1 << 22]))
def test_numba_and_numpy_paths_give_the_same_bytes_and_state(pair, chunk):
    base, new = pair
    blob = encoded(base, new, True, chunk=chunk)
    assert blob == encoded(base, new, False, chunk=chunk)
    assert same(applied(base, blob, True), new) and same(applied(base, blob, False), new)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 2**32 - 1), st.sampled_from([1e-5, 1e-4, 3e-4]), st.sampled_from([2048, 16384, 1 << 22])
)
def test_adam_like_updates_agree_and_are_classed(seed, lr, chunk):
    base, new = adam_like(30_000, lr, seed)
    blob = encoded(base, new, True, chunk=chunk)
    assert blob == encoded(base, new, False, chunk=chunk)
    assert same(applied(base, blob, True), new) and same(applied(base, blob, False), new)


def test_the_agreement_test_sees_classed_chunks():
    base, new = adam_like(40_000)
    assert CLASSED in modes(Delta.from_bytes(encoded(base, new, True, chunk=16384)))


def numpy_ranks(b, pos, shift, ts):
    """Reference: classes of the changes, stable-sorted by class, ranks by the numpy Classes."""
    key = ctx.exponents(b, shift)
    classes = ctx.Classes(key, ts)
    ci = ctx.class_of(key[pos], ts)
    order = np.argsort(ci, kind="stable")
    pos, ci = pos[order], ci[order]
    bounds = np.searchsorted(ci, np.arange(len(ts) + 2)).tolist()
    ranks = np.concatenate(
        [classes.rank(k, pos[lo:hi]) for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]
    )
    return classes, pos, ranks, bounds


BLOCK = cj.BLOCK_SB * cj.SB * 64  # elements per block of the decoder's select


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from([1, 2, 4, 8]),
    st.one_of(st.integers(0, 3000), st.sampled_from([BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 777])),
    st.integers(0, 2**32 - 1),
    st.floats(0, 1),
    st.data(),
)
def test_kernels_agree_with_the_numpy_classes(itemsize, n, seed, density, data):
    rng = np.random.default_rng(seed)
    info = np.iinfo(INTS[itemsize])
    b = rng.integers(info.min, info.max, n, dtype=INTS[itemsize], endpoint=True)
    shift = SHIFT[itemsize]
    top = ctx.max_threshold(itemsize, shift)
    ts = sorted(
        data.draw(st.lists(st.integers(1, top - 1), min_size=1, max_size=ctx.MAX_THRESHOLDS, unique=True)),
        reverse=True,
    )
    pos = np.flatnonzero(rng.random(n) < density).astype(np.int64)
    classes, ref_pos, ref_ranks, ref_bounds = numpy_ranks(b, pos, shift, ts)
    out_pos, ranks, bounds, sizes = cj.encode_ranks(b, pos, shift, ts)
    assert np.array_equal(out_pos, ref_pos) and np.array_equal(ranks, ref_ranks)
    assert bounds == ref_bounds and sizes == classes.sizes
    *_, old, d = cj.encode_ranks(b, pos, shift, ts, b[pos], ~b[pos])  # carried into class order too
    assert np.array_equal(old, b[ref_pos]) and np.array_equal(d, ~b[ref_pos])
    parts = [ranks[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    sel, old, found, sizes2 = cj.select(b, shift, ts, parts)
    assert np.array_equal(sel, out_pos) and found == [p.size for p in parts] and sizes2 == classes.sizes
    assert old.dtype == b.dtype and np.array_equal(old, b[sel])
    # every member of every class, across the select's block and word edges
    every = [np.arange(s, dtype=np.int64) for s in classes.sizes]
    sel, old, found, _ = cj.select(b, shift, ts, every)
    assert np.array_equal(sel, np.concatenate([classes.select(k, r) for k, r in enumerate(every)]))
    assert np.array_equal(old, b[sel]) and found == classes.sizes


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([0, 1, 63, 3000, 1 << 20, (1 << 20) + 777]),
    st.integers(0, 2**32 - 1),
    st.floats(0, 0.2),
)
def test_compiled_exponent_counts_are_the_numpy_ones(itemsize, n, seed, density):
    """Both sample regimes (every 32nd element; every 32nd run in large chunks) and the counts of
    the changed elements, for every float width."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(INTS[itemsize])
    b = rng.integers(info.min, info.max, n, dtype=INTS[itemsize], endpoint=True)
    pos = np.flatnonzero(rng.random(n) < density).astype(np.int64)
    ref, got = ctx.exponent_counts(b, b[pos], SHIFT[itemsize]), cj.exponent_counts(b, b[pos], SHIFT[itemsize])
    assert np.array_equal(ref[0], got[0]) and np.array_equal(ref[1], got[1]) and ref[2] == got[2]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**32 - 1), st.booleans())
def test_compiled_split_cuts_where_the_numpy_one_does(e, seed, ties):
    """Same cut points on any costs, ties included (small integer costs tie often: both take the
    first minimum)."""
    rng = np.random.default_rng(seed)
    cost = np.full((e + 1, e + 1), np.inf)
    i, j = np.triu_indices(e + 1, 1)
    cost[i, j] = rng.integers(0, 4, i.size) if ties else rng.random(i.size) * 1000
    assert cj.split(cost, e) == ctx.split(cost, e)


def test_select_reports_ranks_beyond_the_class():
    b = np.random.default_rng(3).integers(-(2**15), 2**15, 1000).astype(np.int16)
    ts = [120]
    _, _, _, sizes = cj.encode_ranks(b, np.zeros(0, np.int64), 7, ts)
    parts = [np.array([0, sizes[0]]), np.array([sizes[1] - 1])]
    _, _, found, _ = cj.select(b, 7, ts, parts)
    assert found == [1, 1]


def set_class(c, k, ranks: np.ndarray, size_bits: int | None = None):
    """Class k's record replaced by these ranks (GAP), or by a bitmap of size_bits bits; the
    other classes re-coded as they were (their streams share one frame)."""
    entries, most = classed._class_entries(c[6], c[1], "t")
    old = classed._decode_classes(entries, zd(bytes(c[7]), most, "t", exact=False), c[1], "t")
    streams, out = [], []
    for i, ((r, nb), e) in enumerate(zip(old, c[6])):
        bits_ = size_bits if i == k else 8 * nb if nb is not None else None
        r = ranks if i == k else r
        if not r.size:
            out.append([0])
        elif bits_ is None:
            rk = 0 if i == k else int(e[1])
            streams.extend(gap_streams(rk, gaps_of(r)))
            out.append([int(r.size), rk])
        else:
            mask = np.zeros(bits_, bool)
            mask[r] = True
            streams.append(np.packbits(mask))
            out.append([int(r.size), -1, int(streams[-1].size)])
    c[6], c[7] = out, zc_blocks(streams)


def test_forged_rank_beyond_its_class_is_refused(classed_blob, path):
    base, d = classed_blob

    def edit(chunks):
        c = first_classed(chunks)
        k = next(i for i, f in enumerate(c[6]) if f[0])
        size = sizes_of(base, c)[k]
        old_m = c[6][k][0]
        ranks = np.arange(size - old_m + 1, size + 1)  # the last one is one past the class
        set_class(c, k, ranks)

    refused(clone(base), forge(d, "a", edit), "beyond")


def test_forged_bitmap_of_the_wrong_length_is_refused(classed_blob, path):
    base, d = classed_blob

    def edit(chunks):
        c = first_classed(chunks)
        k = next(i for i, f in enumerate(c[6]) if f[0])
        size = sizes_of(base, c)[k]
        ranks = np.arange(c[6][k][0], dtype=np.int64)
        set_class(c, k, ranks, size_bits=size + 64)  # 8 bytes too many, no bit set past the class

    refused(clone(base), forge(d, "a", edit), "bitmap of|decompressed .* bytes, expected")


@pytest.fixture(scope="module")
def classed_blob():
    base, new = adam_like(40_000)
    d = Delta.from_bytes(encoded(base, new, True, chunk=16384))
    assert CLASSED in modes(d)
    return base, d


def sizes_of(base, c) -> list[int]:
    b = base["a"].reshape(-1).view(torch.int16).numpy()[: c[1]]  # the first CLASSED chunk is chunk 0
    return cj.encode_ranks(b, np.zeros(0, np.int64), 7, [int(t) for t in c[5]])[3]


def test_first_classed_chunk_is_chunk_0(classed_blob):
    from delta_codec.record import chunks_of

    _, d = classed_blob
    rec = next(r for r in d.records if r.name == "a")
    assert chunks_of(rec)[0][0] == CLASSED


@pytest.fixture(scope="module")
def selects():
    import numba

    swar = numba.njit(cj._sel_swar)
    used = numba.njit(lambda x, j: cj._sel(x, j, cj._SEL8))
    return swar, used


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(x=st.integers(1, 2**64 - 1), data=st.data())
def test_both_in_word_selects_find_the_jth_set_bit(selects, x, data):
    """The SWAR select (CPUs without a fast pdep) and the compiled one in use agree with the
    definition, so the kernels' choice between them cannot change a position."""
    swar, used = selects
    bits = [i for i in range(64) if x >> i & 1]
    j = data.draw(st.integers(0, len(bits) - 1))
    assert swar(np.uint64(x), j, cj._SEL8) == bits[j] == used(np.uint64(x), j)
