"""delta_codec format 3: positions coded in the context of the base (CLASSED chunks). Random
float states and AdamW-like masks round-trip bit-exact; every truncation or bit flip, and every
forged class record, is refused with the state untouched; rank/select agree with flatnonzero."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delta_codec import Delta, DeltaError, Keyframe, apply_delta, encode_delta, make_keyframe
from delta_codec import context as ctx
from delta_codec.bits import exponent_shift
from delta_codec.codec import decode_chunk, encode_chunk
from delta_codec.compress import zc_blocks, zd
from delta_codec.modes import CLASSED
from tests.helpers.delta import (
    adam_like,
    bits,
    clone,
    first_classed,
    float_update,
    forge,
    modes,
    refused,
    same,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(float_update(), st.sampled_from([64, 1000, 1 << 22]))
def test_round_trip_bit_exact(pair, chunk):
    base, new = pair
    d = encode_delta(base, new, from_version=1, to_version=2, chunk=chunk, context=True)
    state = clone(base)
    apply_delta(state, Delta.from_bytes(d.to_bytes()), expect_from=1)
    assert same(state, new)
    assert d.stats.changed == int((bits(base["w"]) != bits(new["w"])).sum())
    # format 2's coding of the same update (no context) decodes to the same state
    state = clone(base)
    apply_delta(state, Delta.from_bytes(encode_delta(base, new, chunk=chunk, context=False).to_bytes()))
    assert same(state, new)


def test_adam_like_update_is_classed_and_smaller_than_format_2():
    base, new = adam_like()
    d3, d2 = encode_delta(base, new, context=True), encode_delta(base, new)
    assert CLASSED in modes(d3) and CLASSED not in modes(d2)
    assert d3.nbytes < 0.97 * d2.nbytes
    state = clone(base)
    apply_delta(state, Delta.from_bytes(d3.to_bytes()))
    assert same(state, new)


@pytest.fixture(scope="module")
def classed():
    base, new = adam_like(40_000)
    d = encode_delta(base, new, chunk=16384, context=True)
    assert CLASSED in modes(d)
    return base, new, d.to_bytes()


def test_every_truncation_is_refused(classed):
    base, _, blob = classed
    state = clone(base)
    for cut in range(0, len(blob), max(1, len(blob) // 300)):
        refused(state, blob[:cut], "truncated|trailing|magic")


def test_every_bit_flip_is_refused(classed):
    base, _, blob = classed
    state = clone(base)
    rng = np.random.default_rng(0)
    for pos in range(len(blob)):
        if pos % 7 and pos > 64:  # every byte of the prefix and header, every 7th byte after it
            continue
        bad = bytearray(blob)
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        refused(state, bytes(bad), "checksum|magic|format|kind|flags|truncated|trailing|parse")


def _streams(c) -> bytes:
    """A CLASSED record's class streams, decompressed."""
    return zd(bytes(c[7]), 1 << 24, "t", exact=False)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda c: c.__setitem__(5, [c[5][0], c[5][0]]), "bad class thresholds"),
        (lambda c: c.__setitem__(5, [1, 2]), "bad class thresholds"),
        (lambda c: c.__setitem__(5, [0, *c[5][1:]]), "bad class thresholds"),
        (lambda c: c.__setitem__(5, [1 << 20]), "bad class thresholds"),
        (lambda c: c.__setitem__(5, "x"), "malformed"),
        (lambda c: c.__setitem__(6, c[6][:-1]), "class records"),
        (lambda c: c[6].__setitem__(0, [c[6][0][0] + 1, *c[6][0][1:]]), "class 0|header says"),
        (lambda c: c[6].__setitem__(0, [10**9, *c[6][0][1:]]), "changes in a class"),
        (lambda c: c[6].__setitem__(0, [c[6][0][0], 99, *c[6][0][2:]]), "malformed class record"),
        (lambda c: c.__setitem__(7, zc_blocks([_streams(c), b"\0"])), "beyond the class streams"),
        (lambda c: c.__setitem__(7, zc_blocks([_streams(c)[:-1]])), "end early|bitmap|low-bit"),
        (lambda c: c.__setitem__(7, b""), "zstd|class streams"),
        (lambda c: c.__setitem__(7, [c[7]]), "malformed"),
        (lambda c: c.__setitem__(2, c[2] + 1), "header says|values"),
        (lambda c: c.__setitem__(5, [c[5][0] + 1, *c[5][1:]]), "digest mismatch|class|beyond|values"),
    ],
)
def test_forged_class_records_are_refused(classed, edit, match):
    base, _, blob = classed
    d = Delta.from_bytes(blob)
    refused(clone(base), forge(d, "a", lambda chunks: edit(first_classed(chunks))), match)


def test_classed_chunk_needs_the_base():
    base, new = adam_like(40_000)
    b, n = bits(base["a"]), bits(new["a"])
    rec, m = encode_chunk(b, n, exponent_shift(torch.bfloat16))
    assert rec[0] == CLASSED
    with pytest.raises(DeltaError, match="no base"):
        decode_chunk(rec, 2, "t", lambda p: b[p], 7)
    with pytest.raises(DeltaError, match="base chunk"):
        decode_chunk(rec, 2, "t", lambda p: b[p], 7, base_all=lambda: b[:-1])
    pos, d, count, old = decode_chunk(rec, 2, "t", lambda p: b[p], 7, base_all=lambda: b)
    out = b.copy()
    out[pos] = old + d
    assert np.array_equal(out, n) and count == b.size and pos.size == m


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5000),
    st.lists(st.integers(1, 255), min_size=1, max_size=3, unique=True),
    st.integers(0, 2**32 - 1),
)
def test_rank_and_select_agree_with_flatnonzero(n, ts, seed):
    ts = sorted(ts, reverse=True)
    rng = np.random.default_rng(seed)
    b = rng.integers(-(2**15), 2**15, n).astype(np.int16)
    key = ctx.exponents(b, 7)
    classes = ctx.Classes(key, ts)
    ci = ctx.class_of(key, ts)
    for k in range(len(ts) + 1):
        members = np.flatnonzero(ci == k)
        assert classes.sizes[k] == members.size
        assert np.array_equal(classes.select(k, np.arange(members.size)), members)
        assert np.array_equal(classes.rank(k, members), np.arange(members.size))


def test_format_2_blob_is_refused_with_the_clear_error(classed):
    base, _, blob = classed
    old = bytearray(blob)
    old[4] = 2
    refused(
        clone(base),
        bytes(old),
        "unsupported delta format version 2 \\(older than this build's 5: "
        "encode with a matching build, or resync from a keyframe\\)",
    )


def test_extra_header_fields_round_trip_and_are_signed():
    from delta_codec.signing import generate_keypair

    base, new = adam_like(2000)
    sk, pk = generate_keypair()
    d = encode_delta(base, new, from_version=3, to_version=4, context=True)
    d.extra = {"epoch": 7, "run": "r1"}
    blob = d.to_bytes(signing_key=sk)
    back = Delta.from_bytes(blob)
    assert back.extra == {"epoch": 7, "run": "r1"} and back.from_version == 3
    back.verify_signature(pk)
    assert Delta.from_bytes(encode_delta(base, new).to_bytes()).extra == {}
    kf = Keyframe.from_bytes(Keyframe(5, make_keyframe(base, 5).records, {"epoch": 2}).to_bytes())
    assert kf.extra == {"epoch": 2} and kf.version == 5
    with pytest.raises(DeltaError, match="extra"):
        Delta(0, 1, [], extra=["not", "a", "dict"])


def test_rank_and_select_across_cache_blocks():
    # a chunk longer than the class pass's cache block, not a multiple of 64
    n = ctx.BLOCK * 2 + 77
    b = np.random.default_rng(1).integers(-(2**15), 2**15, n).astype(np.int16)
    ts = [130, 120]
    key = ctx.exponents(b, 7)
    classes, ci = ctx.Classes(key, ts), ctx.class_of(key, ts)
    for k in range(len(ts) + 1):
        members = np.flatnonzero(ci == k)
        assert classes.sizes[k] == members.size
        assert np.array_equal(classes.select(k, np.arange(members.size)), members)
        assert np.array_equal(classes.rank(k, members), np.arange(members.size))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.bfloat16])
def test_exponents_match_the_magnitude_definition(dtype):
    # |bits| < t << mantissa exactly when the exponent is < t (the wire's class definition)
    from delta_codec.bits import exponent_shift, np_bits

    t = (
        torch.randn(5000, dtype=torch.float64)
        .mul(torch.logspace(-30, 30, 5000, dtype=torch.float64))
        .to(dtype)
    )
    b = np_bits(t)
    shift = exponent_shift(dtype)
    key = ctx.exponents(b, shift)
    mag = b.view(f"u{b.itemsize}").astype(np.uint64) & np.uint64((1 << (8 * b.itemsize - 1)) - 1)
    for thr in np.unique(key)[:: max(1, np.unique(key).size // 20)]:
        assert np.array_equal(key < thr, mag < np.uint64(int(thr) << shift))
