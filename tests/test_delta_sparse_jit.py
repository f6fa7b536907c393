"""delta_codec.sparse_jit's kernels agree with the numpy code they replace: value grouping order,
Rice-coded gaps (every k, escapes, every refusal with the same message), the sparse write and the
encoder's diff pass;
encode/apply give the same bytes and state with them on and off."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delta_codec import Delta, apply_delta, encode_delta, values
from delta_codec.errors import DeltaError
from delta_codec.positions import gap_streams, gaps_from, gaps_of
from tests.helpers.delta import clone, float_update, same

pytest.importorskip("numba")
from delta_codec import sparse_jit as sj  # noqa: E402


def both(monkeypatch, fn):
    """fn() with the kernels on, then off: (result or the error's text) each."""
    out = []
    for on in (True, False):
        monkeypatch.setattr(sj, "enabled", on)
        try:
            out.append(fn())
        except DeltaError as e:
            out.append(f"DeltaError: {e}")
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=3000))
def test_group_order_is_the_stable_argsort(keys):
    k = np.array(keys, np.uint8)
    assert np.array_equal(sj.group_order(k), np.argsort(k, kind="stable"))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([np.int16, np.int32]),
    st.lists(st.integers(-(2**15), 2**15 - 1), min_size=2, max_size=500),
)
def test_value_order_same_with_and_without_the_kernel(dt, vals):
    old = np.array(vals, dt)
    sj.enabled = True
    try:
        a = values.value_order(old, 7)
    finally:
        sj.enabled = sj.available
    assert np.array_equal(a, np.argsort((old >> dt(7)).astype(np.uint8), kind="stable"))


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from([np.int8, np.int16, np.int32, np.int64]),
    st.integers(0, 700),
    st.floats(0, 1),
    st.randoms(use_true_random=False),
)
def test_diff_is_nonzero_and_two_gathers(dt, size, frac, rnd):
    """Every size around the 64-element words (the tail is a separate loop), every density from
    none to all changed, wrapping differences at the extremes of the dtype."""
    info = np.iinfo(dt)
    b = np.array([rnd.randint(info.min, info.max) for _ in range(size)], dt)
    n = b.copy()
    hit = [i for i in range(size) if rnd.random() < frac]
    n[hit] = [rnd.choice([info.min, info.max, rnd.randint(info.min, info.max)]) for _ in hit]
    pos, old, d = sj.diff(b, n, sj.fresh)
    want = np.flatnonzero(b != n)
    assert np.array_equal(pos, want)
    assert np.array_equal(old, b[want]) and old.dtype == b.dtype
    assert np.array_equal(d, (n[want] - b[want]).astype(dt)) and d.dtype == b.dtype


def rice(pos: np.ndarray, k: int):
    q8, low, over = gap_streams(k, gaps_of(pos))
    return q8.copy(), low, over


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 1 << 24), st.integers(1, 400), st.integers(0, 32), st.randoms(use_true_random=False))
def test_rice_gaps_decode_like_numpy_for_every_k(count, m, k, rnd):
    m = min(m, count)
    pos = np.sort(np.array(rnd.sample(range(count), m), np.int64))
    q8, low, over = rice(pos, k)
    for on in (True, False):
        sj.enabled = on
        try:
            got = gaps_from(k, q8, low, over, m, count, "t")
        finally:
            sj.enabled = sj.available
        assert np.array_equal(got, pos), (on, k)


CORRUPT = [
    "escape_without_overflow",
    "overflow_without_escape",
    "overflow_beyond",
    "repeat",
    "low_short",
    "gap_beyond",
    "last_beyond",
]


@pytest.mark.parametrize("how", CORRUPT)
@pytest.mark.parametrize("k", [0, 4, 9])
def test_rice_gaps_refuse_like_numpy(monkeypatch, how, k):
    rng = np.random.default_rng(k)
    gaps = rng.integers(1, 2 << k, 300)
    gaps[5] = 300 << k  # one escape (a high part >= 255)
    pos = np.cumsum(gaps).astype(np.int64)
    count = int(pos[-1]) + 100
    q8, low, over = rice(pos, k)
    m = pos.size
    if how == "escape_without_overflow":
        over = b""
    elif how == "overflow_without_escape":
        over = over + np.array([3], "<u8").tobytes()  # one more than the escapes
    elif how == "overflow_beyond":
        over = np.array([count], "<u8").tobytes()
    elif how == "repeat":
        q8[1], low = 0, bytes(len(low))  # (the first gap that may not be 0)
    elif how == "low_short":
        low = low[:-1] if low else b"\0"
    elif how == "gap_beyond":
        q8[3] = 254
        count = 254 << k
    elif how == "last_beyond":
        count = int(pos[-1])
    a, b = both(monkeypatch, lambda: gaps_from(k, q8, low, over, m, count, "t"))
    assert isinstance(a, str) and a.startswith("DeltaError"), a
    assert a == b


def test_set_at_writes_and_refuses_an_out_of_range_position_before_writing():
    view = np.zeros(10, np.int16)
    assert sj.set_at(view, np.array([1, 9]), np.array([5, 7], np.int16), np.array([1, -1], np.int16)) == -1
    assert view.tolist() == [0, 6, 0, 0, 0, 0, 0, 0, 0, 6]
    assert sj.set_at(view, np.array([2, 10]), np.array([1, 1], np.int16), np.array([1, 1], np.int16)) == 1
    assert sj.set_at(view, np.array([-1]), np.array([1], np.int16), np.array([1], np.int16)) == 0
    assert view.tolist() == [0, 6, 0, 0, 0, 0, 0, 0, 0, 6]
    w = np.array([32767], np.int16)  # wraps at the width, like numpy
    sj.set_at(w, np.array([0]), w.copy(), np.array([1], np.int16))
    assert w[0] == -32768


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(float_update(), st.booleans())
def test_encode_and_apply_same_bytes_and_state_with_and_without_the_kernels(pair, context):
    base, new = pair
    blobs, states = [], []
    for on in (True, False):
        sj.enabled = on
        try:
            blob = encode_delta(base, new, context=context).to_bytes()
            state = clone(base)
            apply_delta(state, Delta.from_bytes(blob))
        finally:
            sj.enabled = sj.available
        blobs.append(blob)
        states.append(state)
    assert blobs[0] == blobs[1]
    assert same(states[0], new) and same(states[1], new)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([(np.int8, 3), (np.int16, 7), (np.int32, 23), (np.int64, 52)]), st.data())
def test_ungroup_inverts_value_order(dt_shift, data):
    dt, shift = dt_shift
    info = np.iinfo(dt)
    old = np.array(data.draw(st.lists(st.integers(info.min, info.max), min_size=2, max_size=400)), dt)
    d = np.arange(old.size).astype(dt)
    perm = np.argsort((old >> dt(shift)).astype(np.uint8), kind="stable")
    want = np.empty_like(d)
    want[perm] = d
    assert np.array_equal(sj.ungroup(old, shift, d), want)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([np.int8, np.int16, np.int32, np.int64]), st.data())
def test_nibble_values_decode_like_numpy(dt, data):
    info = np.iinfo(dt)
    small = st.integers(-7, 8).filter(bool)
    vals = data.draw(
        st.lists(
            st.one_of(small, small, small, st.integers(info.min, info.max).filter(bool)),
            min_size=1,
            max_size=300,
        )
    )
    d = np.array(vals, dt)
    field, flags = values.encode_values(d, nonzero=True)
    got = []
    for on in (True, False):
        sj.enabled = on
        try:
            got.append(values.decode_values(field, d.itemsize, d.size, "t", flags=flags).copy())
        finally:
            sj.enabled = sj.available
    assert np.array_equal(got[0], d) and np.array_equal(got[1], d)


def test_nibble_overflow_stream_without_escapes_is_refused_by_both(monkeypatch):
    d = np.array([1, -1, 2, 3], np.int16)
    field, flags = values.encode_values(d, nonzero=True)
    assert flags and not len(field[1])
    forged = [field[0], np.zeros(2, np.uint8).tobytes()]
    a, b = both(monkeypatch, lambda: values.decode_values(forged, 2, 4, "t", flags=flags))
    assert a == b and "overflow stream without escapes" in a
