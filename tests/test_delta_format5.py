"""delta_codec format 5: a delta carries the two state digests (not two per tensor), apply
hashes only the result and, on a refusal, names the cause after rolling back: a wrong base
("not the delta's base version N") or a bad delta ("result digest mismatch ... rolled back").
The state digests the bus announces and checkpoints record are unchanged; format 4 blobs get the
clear refusal older formats get."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import delta_codec.apply
from delta_codec import CODEC, Delta, DeltaError, apply_delta, encode_delta, state_digest
from delta_codec.record import TensorRecord
from delta_codec.sharded import encode_part, parts_digest, shard_rows, sharded_digest
from tests.helpers.delta import adam_like, clone, float_update, refused, same

BASE_MSG = "^base digest mismatch: the state is not the delta's base version 4 \\(state unchanged\\)$"
BAD_MSG = "^result digest mismatch after apply \\(corrupted delta\\); state rolled back$"

# A delta a format-4 build wrote (encode_delta of a 16-element bf16 tensor, two changes, v4 -> v5).
FORMAT_4_BLOB = bytes.fromhex(
    "41444c54040001008600000028b52ffd207de9030084ac66726f6d5f76657273696f6e04aa746f5f76657273696f6e05a5636f"
    "646563b66374782d726963652d7a69677a61672d7a7374642f34a774656e736f72739197a177a862666c6f617431369110c410"
    "2c167ad576e5313ec2612196e59ae6f8c410d23087ca9817f1ee0037e16f915600322fcfe7d6741d3885ce89f07be4182a67cc"
    "1113000000919901100200d4010d00d4010bd40100d4010028b52ffd200421000060a001fc28b52ffd20021100000308"
)


def states(seed: int = 0) -> tuple[dict, dict, dict]:
    """base -> new -> newer: an Adam-like bf16 update (CLASSED and grouped chunks), an fp32
    tensor that changes densely, one that does not change, a scalar."""
    base, new = adam_like(40_000, seed=seed)
    _, newer = adam_like(40_000, seed=seed + 1)
    newer = {k: (new[k].float() + (newer[k].float() - base[k].float())).to(new[k].dtype) for k in new}
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(64, 33, generator=g)
    for s, k in ((base, 0.0), (new, 1.0), (newer, 2.0)):
        s["dense"] = dense + k
        s["same"] = torch.arange(100, dtype=torch.int32)
        s["step"] = torch.tensor(int(k))
    return base, new, newer


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("context", [False, True])
def test_a_delta_on_the_wrong_base_is_refused_naming_the_base_and_the_state_is_untouched(threads, context):
    base, new, newer = states()
    d = Delta.from_bytes(encode_delta(new, newer, from_version=4, to_version=5, context=context).to_bytes())
    for wrong in (base, {**new, "step": torch.tensor(7)}, {**new, "dense": new["dense"] + 1e-3}):
        state = clone(wrong)
        with pytest.raises(DeltaError, match=BASE_MSG):
            apply_delta(state, d, threads=threads)
        assert same(state, wrong)
    state = clone(new)
    apply_delta(state, d, threads=threads)
    assert same(state, newer)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(float_update(), st.integers(0, 2**32 - 1), st.booleans())
def test_any_one_bit_off_the_base_is_refused_naming_the_base(pair, seed, context):
    base, new = pair
    if not base["w"].numel():
        return
    d = Delta.from_bytes(
        encode_delta(base, new, from_version=4, to_version=5, chunk=1024, context=context).to_bytes()
    )
    rng = np.random.default_rng(seed)
    wrong = clone(base)
    flat = (
        wrong["w"]
        .view(-1)
        .view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[wrong["w"].element_size()])
    )
    flat[int(rng.integers(flat.numel()))] ^= 1 << int(rng.integers(8 * wrong["w"].element_size() - 1))
    state = clone(wrong)
    with pytest.raises(DeltaError, match=BASE_MSG):
        apply_delta(state, d)
    assert same(state, wrong)


def _swap(good: Delta, other: Delta, name: str) -> Delta:
    """`good` with tensor `name`'s record taken from `other` (valid framing and checksums: a
    producer bug or a corruption the checksum missed), keeping good's state digests."""
    o = next(r for r in other.records if r.name == name)
    recs = [
        r if r.name != name else TensorRecord(r.name, r.dtype, r.shape, None, None, o.head, o.body)
        for r in good.records
    ]
    return Delta(
        good.from_version, good.to_version, recs, base_digest=good.base_digest, new_digest=good.new_digest
    )


@pytest.mark.parametrize("context", [False, True])
def test_a_corrupted_value_or_position_is_refused_as_corruption_and_the_state_is_untouched(context):
    base, new, _ = states()
    good = Delta.from_bytes(encode_delta(base, new, from_version=4, to_version=5, context=context).to_bytes())
    w = new["a"].clone()
    changed = np.flatnonzero((w.view(torch.int16) != base["a"].view(torch.int16)).numpy())
    value = clone(new)
    value["a"] = w.clone()
    value["a"].view(torch.int16)[changed[len(changed) // 2]] += 1  # same positions, one value off
    position = clone(new)
    position["a"] = w.clone()
    i, j = changed[3], changed[3] + 1 if changed[3] + 1 not in changed else changed[3] - 1
    position["a"][j], position["a"][i] = w[i], base["a"][i]  # one change one element over
    for other in (value, position, {**new, "dense": new["dense"] * 2}):
        name = next(k for k in new if not torch.equal(other[k], new[k]))
        forged = _swap(good, encode_delta(base, other, context=context), name)
        for d in (forged, Delta.from_bytes(forged.to_bytes())):
            state = clone(base)
            with pytest.raises(DeltaError, match=BAD_MSG):
                apply_delta(state, d, threads=2)
            assert same(state, base)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(float_update(), st.integers(0, 2**32 - 1), st.booleans())
def test_a_bit_flip_the_checksum_missed_is_refused_as_the_delta_s_fault_or_harmless(pair, seed, context):
    """Any bit of any record body flipped, checksums recomputed (the 32-bit record checksum
    missed it): apply either refuses without blaming the base, state untouched, or (a bit no
    decoder reads, e.g. padding) gives the exact result."""
    base, new = pair
    d = encode_delta(base, new, from_version=4, to_version=5, chunk=1024, context=context)
    recs = [r for r in d.records if r.nbytes]
    if not recs:
        return
    rng = np.random.default_rng(seed)
    r = recs[rng.integers(len(recs))]
    body = bytearray(r.body)
    body[rng.integers(len(body))] ^= 1 << int(rng.integers(8))
    forged = Delta.from_bytes(
        Delta(
            4,
            5,
            [
                x if x is not r else TensorRecord(r.name, r.dtype, r.shape, None, None, r.head, bytes(body))
                for x in d.records
            ],
            base_digest=d.base_digest,
            new_digest=d.new_digest,
        ).to_bytes()
    )
    state = clone(base)
    try:
        apply_delta(state, forged)
    except DeltaError as e:
        assert "base version" not in str(e)
        assert same(state, base)
    else:
        assert same(state, new)


def test_a_format_4_blob_is_refused_with_the_clear_error():
    assert CODEC == "ctx-rice-zigzag-zstd/5"  # the bus refuses a format-4 producer's events by this
    w = torch.arange(16, dtype=torch.float32).to(torch.bfloat16)
    refused(
        {"w": w},
        FORMAT_4_BLOB,
        "^unsupported delta format version 4 \\(older than this build's 5: "
        "encode with a matching build, or resync from a keyframe\\)$",
    )


def test_state_digests_are_the_state_digest_of_base_and_result():
    base, new, newer = states()
    for a, b in ((base, new), (new, newer), (base, base)):
        d = encode_delta(a, b, from_version=4, to_version=5, context=True)
        p = Delta.from_bytes(d.to_bytes())
        assert d.base_digest == p.base_digest == state_digest(a)
        assert d.new_digest == p.new_digest == state_digest(b)
        assert p.records[0].digest_a is None  # only the state digests travel
        state = clone(a)
        apply_delta(state, p)
        assert state_digest(state) == p.new_digest
    # sharded publication: each part's new digest is its rows' state digest; combined, the
    # checkpointed digest a full-state holder recomputes
    world, parts = 3, []
    two_d = {k: v for k, v in new.items() if v.dim() == 2 or k == "a"}
    for rank in range(world):
        rows = {n: shard_rows(t.shape[0], rank, world) for n, t in two_d.items()}
        part = encode_part(
            {n: base[n][slice(*rows[n])] for n in two_d},
            {n: two_d[n][slice(*rows[n])] for n in two_d},
            rows,
            from_version=4,
            to_version=5,
        )
        parts.append(Delta.from_bytes(part.to_bytes()).new_digest)
    assert parts_digest(parts) == sharded_digest(two_d, world)


def test_apply_hashes_each_tensor_once(monkeypatch):
    """The base is not hashed on the way in: one digest per tensor on a good apply (format 4's
    apply hashed base and result)."""
    base, new, _ = states()
    d = Delta.from_bytes(encode_delta(base, new, context=True).to_bytes())
    hashed = []
    real = delta_codec.apply.tensor_digest
    monkeypatch.setattr(delta_codec.apply, "tensor_digest", lambda t: hashed.append(t.numel()) or real(t))
    state = clone(base)
    apply_delta(state, d, threads=2)
    assert same(state, new) and sorted(hashed) == sorted(t.numel() for t in base.values())


def test_fixed_cost_per_unchanged_tensor():
    """An update that touches one tensor of many: each other tensor costs a few bytes (its name,
    its empty chunk list and checksum, in the zstd'd header; format 4: about 31, mostly its
    16-byte digest (base and result are equal, so zstd keeps one) and an 8-byte checksum)."""
    g = torch.Generator().manual_seed(0)
    base = {
        f"layers.{i}.mlp.weight": (torch.randn(32, 32, generator=g) * 0.02).to(torch.bfloat16)
        for i in range(200)
    }
    new = {**base, "layers.0.mlp.weight": base["layers.0.mlp.weight"] + 0.01}
    one = encode_delta(
        {"layers.0.mlp.weight": base["layers.0.mlp.weight"]},
        {"layers.0.mlp.weight": new["layers.0.mlp.weight"]},
    ).nbytes
    per_tensor = (encode_delta(base, new).nbytes - one) / 199
    assert per_tensor < 8, per_tensor


def test_a_parsed_delta_rewrapped_keeps_its_state_digests_only_when_given():
    """A parsed delta's records carry no tensor digests: re-wrapping them (new extra fields, as
    the bus's publisher does) needs the state digests passed on, else a clear error."""
    base, new, _ = states()
    p = Delta.from_bytes(encode_delta(base, new, from_version=4, to_version=5).to_bytes())
    with pytest.raises(DeltaError, match="no tensor digests: give the new state digest"):
        Delta(4, 5, p.records, extra={"epoch": 2}).new_digest  # noqa: B018  (the access must raise)
    again = Delta.from_bytes(
        Delta(
            4, 5, p.records, extra={"epoch": 2}, base_digest=p.base_digest, new_digest=p.new_digest
        ).to_bytes()
    )
    assert (again.base_digest, again.new_digest, again.extra) == (
        state_digest(base),
        state_digest(new),
        {"epoch": 2},
    )
    state = clone(base)
    apply_delta(state, again)
    assert same(state, new)


@pytest.mark.parametrize("context", [False, True])
def test_the_device_path_undo_restores_a_wrong_base_exactly(context):
    """On device tensors a wrong base is now found after writing (no base digest up front), so
    the device path's undo must restore whatever state it wrote to: its torch-ops twin on CPU
    tensors, applied to the wrong base and undone."""
    from delta_codec.apply import decode_record
    from delta_codec.triton_apply import apply_on_device

    base, new, newer = states()
    d = encode_delta(new, newer, chunk=4096, context=context)
    state = clone(base)
    undo: list = []
    for r in d.records:
        try:
            decoded = decode_record(r, state[r.name])
        except DeltaError:  # (a CLASSED chunk may not decode on the wrong base: nothing written)
            continue
        apply_on_device(state[r.name], decoded, undo)
    assert undo and not same(state, base)
    for restore in reversed(undo):
        restore()
    assert same(state, base)
