"""Sharded publication (delta_codec/sharded.py, trainer/publish_shards.py): the parts two FSDP2
ranks encode from their own rows, with one signed manifest, applied in any order reproduce the
gathered bf16 state bit-exactly; a missing, corrupt or inapplicable part refuses the whole
version and leaves the state untouched."""

from __future__ import annotations

import pytest
import torch

from delta_codec import DeltaError, apply_delta, encode_delta, signing
from delta_codec.sharded import Manifest, apply_parts, make_manifest, shard_rows
from policy import inference_state
from tests.helpers.fsdp import cfg_dict, make_samples, torchrun
from trainer.config import TrainerConfig
from trainer.factory import build_model


def clone(state):
    return {k: v.clone() for k, v in state.items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def two_rank_parts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parts")
    samples = make_samples(seed=2)
    torch.save(samples, tmp / "samples.pt")
    cfg = cfg_dict(tmp, loss={"kl_coef": 0.0})
    res = torchrun(tmp, {"cfg": cfg, "samples": str(tmp / "samples.pt"), "steps": 1, "parts": True})
    base = inference_state(build_model(TrainerConfig(**cfg))[0])
    return base, res["state"], res["parts"]


def test_shard_rows_tile_like_fsdp2():
    for n in (0, 1, 5, 8, 33):
        for ws in (1, 2, 3):
            spans = [shard_rows(n, r, ws) for r in range(ws)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert [r1 - r0 for r0, r1 in spans] == [len(c) for c in torch.arange(n).chunk(ws)] + [0] * (
                ws - len(torch.arange(n).chunk(ws))
            )


def test_parts_in_any_order_equal_the_full_delta(two_rank_parts):
    base, new, parts = two_rank_parts
    assert len(parts) == 2 and not same(base, new)
    sk, pk = signing.generate_keypair()
    manifest = make_manifest(parts, from_version=0, to_version=1).to_bytes(sk)
    full = clone(base)
    apply_delta(full, encode_delta(base, new, from_version=0, to_version=1))
    for order in ([0, 1], [1, 0]):
        st = clone(base)
        apply_parts(st, manifest, dict(enumerate(parts)), public_key=pk, expect_from=0, order=order)
        assert same(st, new) and same(st, full)


def test_bad_parts_refuse_the_whole_version(two_rank_parts):
    base, new, parts = two_rank_parts
    sk, pk = signing.generate_keypair()
    manifest = make_manifest(parts, from_version=0, to_version=1).to_bytes(sk)
    st = clone(base)
    with pytest.raises(DeltaError, match="missing"):
        apply_parts(st, manifest, {0: parts[0]}, public_key=pk)
    bad = bytearray(parts[1])
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(DeltaError, match="manifest digest"):
        apply_parts(st, manifest, {0: parts[0], 1: bytes(bad)}, public_key=pk)
    with pytest.raises(DeltaError, match="signature"):
        apply_parts(st, manifest, dict(enumerate(parts)), public_key=signing.generate_keypair()[1])
    with pytest.raises(DeltaError, match="unsigned"):
        apply_parts(
            st,
            make_manifest(parts, from_version=0, to_version=1).to_bytes(),
            dict(enumerate(parts)),
            public_key=pk,
        )
    lone = make_manifest(parts[:1], from_version=0, to_version=1).to_bytes(sk)  # a consistent but partial set
    with pytest.raises(DeltaError, match="cover"):
        apply_parts(st, lone, {0: parts[0]}, public_key=pk)
    tampered = bytearray(manifest)
    tampered[20] ^= 0x01
    with pytest.raises(DeltaError):
        apply_parts(st, bytes(tampered), dict(enumerate(parts)), public_key=pk)
    assert same(st, base)
    # part 0 applies, then part 1 meets a row that is not its base: part 0 is rolled back too
    name = next(
        n
        for n, t in base.items()
        if t.dim() == 2 and shard_rows(t.shape[0], 1, 2)[1] > shard_rows(t.shape[0], 1, 2)[0]
    )
    st = clone(base)
    st[name][-1, 0] = st[name][-1, 0] + 1
    before = clone(st)
    with pytest.raises(DeltaError, match="base digest"):
        apply_parts(st, manifest, dict(enumerate(parts)), public_key=pk, order=[0, 1])
    assert same(st, before)


def test_manifest_round_trip_is_canonical():
    m = make_manifest([b"a", b"bc"], from_version=3, to_version=4, extra={"epoch": 2})
    sk, pk = signing.generate_keypair()
    back = Manifest.from_bytes(m.to_bytes(sk))
    back.verify_signature(pk)
    assert (back.from_version, back.to_version, back.parts, back.extra) == (3, 4, m.parts, {"epoch": 2})
    with pytest.raises(DeltaError, match="magic"):
        Manifest.from_bytes(b"nope" * 4)
