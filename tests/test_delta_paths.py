"""delta_codec format 2 internals: the fast paths (word-level nonzero, k=0 byte gaps, low-byte
values with wide fix-ups, per-worker scratch buffers, chunk-level threads) agree with the
plain computations, and every rollback path restores the state exactly."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from delta_codec import Delta, DeltaError, apply_delta, encode_delta
from delta_codec.bits import Scratch, fresh, planes, zigzag
from delta_codec.codec import decode_chunk, encode_chunk
from delta_codec.compress import zc
from delta_codec.modes import BITMAP, DENSE, GAP, GROUPED, NIBBLES, NONE
from delta_codec.positions import decode_gaps, encode_gaps, positions
from delta_codec.record import TensorRecord, pack_record
from delta_codec.record import chunks_of as _chunks
from delta_codec.values import decode_values, encode_values

INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def bits(t: torch.Tensor) -> np.ndarray:
    return (
        t.reshape(-1)
        .view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        .numpy()
    )


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(bits(a[k]), bits(b[k])) for k in a)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 4096 + 5, (1 << 20) + 13])
@pytest.mark.parametrize("p", [0.0, 0.001, 0.05, 0.09, 0.2, 1.0])
def test_positions_match_flatnonzero(n, p):
    mask = np.random.default_rng(n).random(n) < p
    for alloc in (fresh, Scratch()):
        assert np.array_equal(positions(mask, int(mask.sum()), alloc), np.flatnonzero(mask))


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("wide", [0.0, 0.01, 0.2, 0.5])
@pytest.mark.parametrize("nonzero", [False, True])
def test_values_round_trip_with_wide_codes(itemsize, wide, nonzero):
    """Byte planes (low-byte fast path, sparse wide fix-ups, full planes) and nibble codes with
    and without overflow, or planes again when too many codes overflow."""
    rng = np.random.default_rng(itemsize)
    dt = INT[itemsize]
    d = rng.integers(-3, 4, 5001).astype(dt)
    big = rng.random(d.size) < wide
    d[big] = rng.integers(np.iinfo(dt).min, np.iinfo(dt).max, int(big.sum()), dtype=dt, endpoint=True)
    if nonzero:
        d[d == 0] = 1
    s = Scratch()
    for alloc in (fresh, s, s):  # twice through the same scratch: no stale bytes
        field, flags = encode_values(d, alloc, nonzero)
        assert bool(flags & NIBBLES) == (nonzero and wide <= 0.2)
        assert np.array_equal(decode_values(field, itemsize, d.size, "t", alloc, flags), d)
    if nonzero and wide == 0.01:
        with pytest.raises(DeltaError, match="overflow"):
            decode_values([field[0], field[1][:-1]], itemsize, d.size, "t", s, flags)
        with pytest.raises(DeltaError, match="malformed"):
            decode_values(field[0], itemsize, d.size, "t", s, flags)


def test_gap_stream_refuses_repeated_positions_and_escapes_without_overflow():
    pos = np.array([0, 3, 3, 9])  # a repeated position: an encoder never writes it
    qz, low, over = encode_gaps(pos, 0)
    with pytest.raises(DeltaError, match="repeated"):
        decode_gaps(0, qz, low, over, pos.size, 100, "t")
    esc = zc(np.array([5, 255], np.uint8))
    with pytest.raises(DeltaError, match="overflow"):
        decode_gaps(0, esc, b"", b"", 2, 10_000, "t")
    with pytest.raises(DeltaError, match="low-bit"):
        decode_gaps(0, encode_gaps(np.array([1, 2]), 0)[0], b"\0", b"", 2, 10, "t")


def chunk_of(mode: int, grouped: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """bf16-like base/new bits whose chunk codes as `mode`."""
    rng = np.random.default_rng(mode)
    b = (torch.randn(50_000, generator=torch.Generator().manual_seed(mode)) * 0.02).to(torch.bfloat16)
    b = bits(b).copy()
    density = {NONE: 0.0, GAP: 0.02 if grouped else 0.15, BITMAP: 0.5, DENSE: 0.9}[mode]
    n = b.copy()
    m = rng.random(b.size) < density
    n[m] = n[m] + rng.choice(np.array([-2, -1, 1, 2, 300], np.int16), int(m.sum()))
    return b, n


@pytest.mark.parametrize(
    "mode,grouped", [(NONE, False), (GAP, True), (GAP, False), (BITMAP, False), (DENSE, False)]
)
def test_chunk_modes_decode_to_the_changes(mode, grouped):
    b, n = chunk_of(mode, grouped)
    s = Scratch()
    rec, m = encode_chunk(b, n, 7, s)
    assert rec[0] == mode and m == int((b != n).sum())
    if mode in (GAP, BITMAP):
        assert bool(rec[3] & GROUPED) == grouped
    rec = msgpack.unpackb(msgpack.packb(rec, use_bin_type=True))
    for alloc in (fresh, s):
        pos, d, count, _ = decode_chunk(rec, 2, "t", lambda p: b[p], 7, alloc)
        out = b.copy()
        if pos is None:
            out += d
        else:
            out[pos] += d
        assert count == b.size and np.array_equal(out, n)
    if grouped:
        with pytest.raises(DeltaError, match="grouped"):
            decode_chunk(rec, 2, "t")  # no base: the order of the values is unknown
        with pytest.raises(DeltaError, match="grouped"):
            decode_chunk(rec, 2, "t", lambda p: b[p], None)
    if mode != NONE:
        bad = list(rec)
        bad[3] = 4
        with pytest.raises(DeltaError, match="flags"):
            decode_chunk(bad, 2, "t", lambda p: b[p], 7)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rollback_restores_every_chunk_mode(threads):
    """A delta whose first tensors (one chunk mode each) apply fine and whose last tensor's result
    digest fails: every mode's undo (kept old bits for grouped chunks, re-decoded inverse for
    the others) restores the base exactly, whichever thread applied it."""
    base, new = {}, {}
    for mode, grouped in ((GAP, True), (GAP, False), (BITMAP, False), (DENSE, False), (NONE, False)):
        b, n = chunk_of(mode, grouped)
        name = f"m{mode}{'g' if grouped else ''}"
        base[name] = torch.from_numpy(b).view(torch.bfloat16)
        new[name] = torch.from_numpy(n).view(torch.bfloat16)
    base["z_last"] = torch.zeros(1000, dtype=torch.float32)
    new["z_last"] = torch.ones(1000, dtype=torch.float32)
    good = encode_delta(base, new, chunk=4096, threads=threads)
    other = encode_delta(base, {**new, "z_last": torch.full((1000,), 2.0)}, chunk=4096)
    o = next(o for o in other.records if o.name == "z_last")
    forged = Delta(
        0,
        1,
        [
            r
            if r.name != "z_last"
            else TensorRecord(r.name, r.dtype, r.shape, r.digest_a, r.digest_b, o.head, o.body)
            for r in good.records
        ],
    )
    state = {k: v.clone() for k, v in base.items()}
    with pytest.raises(DeltaError, match="^result digest mismatch after apply"):
        apply_delta(state, Delta.from_bytes(forged.to_bytes()), threads=threads)
    assert same(state, base)
    apply_delta(state, Delta.from_bytes(good.to_bytes()), threads=threads)
    assert same(state, new)


def test_a_bad_chunk_midway_rolls_back_with_threads():
    """A chunk that fails to decode (after others were written, on other threads): nothing stays."""
    g = torch.Generator().manual_seed(0)
    base = {f"t{i}": (torch.randn(20_000, generator=g) * 0.02).to(torch.bfloat16) for i in range(6)}
    new = {k: (v.float() * 1.01).to(torch.bfloat16) for k, v in base.items()}
    d = encode_delta(base, new, chunk=2048)
    r = d.records[3]
    chunks = _chunks(r)
    chunks[-1][4] = b"not zstd"
    d.records[3] = TensorRecord(r.name, r.dtype, r.shape, r.digest_a, r.digest_b, *pack_record(chunks))
    state = {k: v.clone() for k, v in base.items()}
    with pytest.raises(DeltaError, match="tensor 't3' chunk 9.*zstd"):
        apply_delta(state, Delta.from_bytes(d.to_bytes()), threads=3)
    assert same(state, base)


def test_threads_and_scratch_give_identical_blobs():
    g = torch.Generator().manual_seed(1)
    base = {f"t{i}": (torch.randn(30_000 + i, generator=g) * 0.02).to(torch.bfloat16) for i in range(5)}
    new = {
        k: (v.float() * (1 + 0.003 * torch.randn(v.shape, generator=g))).to(torch.bfloat16)
        for k, v in base.items()
    }
    blobs = {t: encode_delta(base, new, chunk=4096, threads=t).to_bytes() for t in (1, 2, 4)}
    assert blobs[1] == blobs[2] == blobs[4]
    assert planes(zigzag(np.array([-1, 1, 300], np.int16))).tolist() == [1, 2, 88, 0, 0, 2]


def test_default_threads_env(monkeypatch):
    from delta_codec.tasks import default_threads

    monkeypatch.setenv("ASYNCRL_DELTA_THREADS", "3")
    assert default_threads() == 3
    monkeypatch.delenv("ASYNCRL_DELTA_THREADS")
    assert 1 <= default_threads() <= 8


def kf_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": (torch.randn(5000, 7, generator=g) * 0.02).to(torch.bfloat16),
        "w32": torch.randn(3001, generator=g),
        "f64": torch.randn(17, generator=g, dtype=torch.float64),
        "i8": torch.randint(-128, 127, (999,), generator=g, dtype=torch.int8),
        "flag": torch.rand(33, generator=g) < 0.5,
        "empty": torch.zeros(0, 4),
    }


@pytest.mark.parametrize("threads", [1, 3])
def test_keyframe_chunked_round_trip(threads):
    from delta_codec import Keyframe, load_keyframe, make_keyframe

    s = kf_state()
    blob = make_keyframe(s, version=3, chunk=1024, threads=threads).to_bytes()
    assert blob == make_keyframe(s, version=3, chunk=1024, threads=1).to_bytes()
    kf = Keyframe.from_bytes(blob)
    out = load_keyframe(kf, threads=threads)
    assert list(out) == list(s) and same(out, s) and all(out[k].shape == s[k].shape for k in s)
    target = {k: torch.zeros_like(v) for k, v in s.items()}
    ids = {k: id(v) for k, v in target.items()}
    assert load_keyframe(blob, into=target, threads=threads) is target
    assert same(target, s) and all(id(target[k]) == ids[k] for k in target)


def test_keyframe_with_a_wrong_digest_leaves_into_unchanged():
    """Checksums pass (a producer bug, not corruption): every tensor is verified before any write."""
    from delta_codec import load_keyframe, make_keyframe
    from delta_codec.keyframe import Keyframe

    s = kf_state()
    kf = make_keyframe(s, version=1, chunk=1024)
    other = make_keyframe({**s, "w32": s["w32"] + 1}, version=1, chunk=1024)
    o = next(o for o in other.records if o.name == "w32")
    forged = Keyframe(
        1,
        [
            r
            if r.name != "w32"
            else TensorRecord(r.name, r.dtype, r.shape, r.digest_a, r.digest_b, o.head, o.body)
            for r in kf.records
        ],
    )
    target = {k: torch.zeros_like(v) for k, v in s.items()}
    for threads in (1, 2):
        with pytest.raises(DeltaError, match="'w32': keyframe digest mismatch"):
            load_keyframe(Keyframe.from_bytes(forged.to_bytes()), into=target, threads=threads)
        assert same(target, {k: torch.zeros_like(v) for k, v in s.items()})
        with pytest.raises(DeltaError, match="'w32': keyframe digest mismatch"):
            load_keyframe(forged.to_bytes(), threads=threads)
    bad = _chunks(kf.records[0], 2)
    bad[0][0] += 1  # chunks no longer cover the tensor
    broken = Keyframe(
        1,
        [
            TensorRecord(
                kf.records[0].name,
                kf.records[0].dtype,
                kf.records[0].shape,
                kf.records[0].digest_a,
                kf.records[0].digest_b,
                *pack_record(bad),
            ),
            *kf.records[1:],
        ],
    )
    with pytest.raises(DeltaError, match="'emb': chunks cover"):
        load_keyframe(broken.to_bytes(), into=target)


def test_malformed_record_framing_is_refused():
    """Records with valid checksums but broken framing (a producer bug): DeltaError naming the
    tensor, state unchanged; sent (heads in the header, body lengths from them) or handed over
    in memory (head and body that disagree)."""
    import re

    import msgpack

    g = torch.Generator().manual_seed(3)
    base = {
        "a": (torch.randn(5000, generator=g) * 0.02).to(torch.bfloat16),
        "b": (torch.randn(5000, generator=g) * 0.02).to(torch.bfloat16),
    }
    new = {k: (v.float() * 1.01).to(torch.bfloat16) for k, v in base.items()}
    d = encode_delta(base, new, chunk=1024)
    r = d.records[1]
    head, body = r.head, bytes(r.body)
    cases = {  # match: (head, body, sent as a blob)
        "beyond its fields": (head, body + b"x", False),
        "beyond the record": (head, body[:10], False),
        # a byte field's placeholder (msgpack fixext 1-8, type 1) with an unknown type
        "does not parse.*unknown field type 2": (
            re.sub(rb"([\xd4-\xd7])\x01", lambda f: f[1] + b"\x02", head, count=1),
            body,
            True,
        ),
        "does not parse": (head[:-1], body, True),
        "not a list of chunks": (msgpack.packb([[0, 5000]]), b"", True),
    }
    for match, (h, b, sent) in cases.items():
        forged = Delta(
            0, 1, [d.records[0], TensorRecord(r.name, r.dtype, r.shape, r.digest_a, r.digest_b, h, b)]
        )
        state = {k: v.clone() for k, v in base.items()}
        with pytest.raises(DeltaError, match=f"tensor 'b'.*{match}"):
            apply_delta(state, Delta.from_bytes(forged.to_bytes()) if sent else forged)
        assert same(state, base)
