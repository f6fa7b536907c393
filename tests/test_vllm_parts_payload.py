"""rollout_worker/vllm_parts.py without vLLM (the default suite): what the vLLM engine does with a
version published from shards on each side of vLLM's RPC. The client applies the parts to its
shadow and builds the payload; the worker side applies that payload to HF-named tensors. Both
reach the full delta's state bit for bit; every bad input is a clear error with nothing written.
The same code inside real vLLM: tests/vllm/test_vllm_parts.py."""

from __future__ import annotations

import pytest
import torch

import delta_codec
from delta_codec.sharded import encode_part, make_manifest, shard_rows
from rollout_worker import vllm_parts

TO_HF = {
    "tok.weight": "model.embed_tokens.weight",
    "w.weight": "model.layers.0.mlp.down_proj.weight",
    "n.weight": "model.norm.weight",
}


def states():
    g = torch.Generator().manual_seed(0)
    old = {
        "tok.weight": torch.randn(9, 4, generator=g),
        "w.weight": torch.randn(6, 5, generator=g),
        "n.weight": torch.randn(7, generator=g),
    }
    old = {k: v.to(torch.bfloat16) for k, v in old.items()}
    new = {
        k: (v.float() + 0.1 * (torch.rand(v.shape, generator=g) < 0.4)).to(torch.bfloat16)
        for k, v in old.items()
    }
    new["n.weight"] = old["n.weight"].clone()  # one tensor unchanged: not reloaded
    return old, new


def parts_of(old, new, world=3, v=(4, 5)):
    blobs = []
    for r in range(world):
        rows = {n: shard_rows(t.shape[0], r, world) for n, t in old.items()}
        blobs.append(
            encode_part(
                {n: old[n][slice(*rows[n])] for n in old},
                {n: new[n][slice(*rows[n])] for n in old},
                rows,
                from_version=v[0],
                to_version=v[1],
            ).to_bytes()
        )
    return make_manifest(blobs, from_version=v[0], to_version=v[1]), dict(enumerate(blobs))


def clone(s):
    return {k: v.clone() for k, v in s.items()}


def same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_both_sides_reach_the_full_delta_state():
    old, new = states()
    manifest, parts = parts_of(old, new)
    full = clone(old)
    delta_codec.apply_delta(full, delta_codec.encode_delta(old, new, from_version=4, to_version=5))
    shadow = clone(old)
    changed, backup = vllm_parts.apply_to_shadow(shadow, manifest, parts)
    assert (
        same(shadow, full)
        and changed == ["tok.weight", "w.weight"]
        and same(backup, {k: old[k] for k in changed})
    )
    info = vllm_parts.payload(manifest, parts)
    assert vllm_parts.payload_bytes(info) == len(info["manifest"]) + sum(map(len, parts.values()))
    hf = {TO_HF[k]: v.clone() for k, v in old.items()}
    assert vllm_parts.apply_in_worker(info["manifest"], info["parts"], hf, TO_HF.__getitem__) == changed
    assert same(hf, {TO_HF[k]: v for k, v in full.items()})


def test_bad_parts_change_nothing_on_either_side():
    old, new = states()
    manifest, parts = parts_of(old, new)
    bad = bytearray(parts[2])
    bad[-3] ^= 0x40
    for broken, match in [
        ({0: parts[0], 1: parts[1], 2: bytes(bad)}, "digest"),
        ({0: parts[0], 2: parts[2]}, "missing"),
    ]:
        shadow = clone(old)
        with pytest.raises(delta_codec.DeltaError, match=match):
            vllm_parts.apply_to_shadow(shadow, manifest, broken)
        assert same(shadow, old)
    # a part made from another base: its rows' base digest fails after the others applied; undone
    other = clone(old)
    other["w.weight"] = other["w.weight"] + 1
    wrong = [*list(parts_of(old, new)[1].values())[:2], list(parts_of(other, new)[1].values())[2]]
    wm = make_manifest(wrong, from_version=4, to_version=5)
    shadow = clone(old)
    with pytest.raises(delta_codec.DeltaError, match="base"):
        vllm_parts.apply_to_shadow(shadow, wm, dict(enumerate(wrong)))
    assert same(shadow, old)
    info = vllm_parts.payload(wm, dict(enumerate(wrong)))
    hf = {TO_HF[k]: v.clone() for k, v in old.items()}
    with pytest.raises(delta_codec.DeltaError, match="base"):
        vllm_parts.apply_in_worker(info["manifest"], info["parts"], hf, TO_HF.__getitem__)
    assert same(hf, {TO_HF[k]: v for k, v in old.items()})


def test_worker_side_refuses_a_malformed_push():
    old, new = states()
    manifest, parts = parts_of(old, new)
    info = vllm_parts.payload(manifest, parts)
    hf = {TO_HF[k]: v.clone() for k, v in old.items()}
    with pytest.raises(ValueError, match="twice"):
        vllm_parts.apply_in_worker(
            info["manifest"], info["parts"] + [info["parts"][0]], hf, TO_HF.__getitem__
        )
    with pytest.raises(ValueError, match="not in the vLLM model"):
        vllm_parts.apply_in_worker(
            info["manifest"],
            info["parts"],
            {k: v for k, v in hf.items() if "norm" not in k},
            TO_HF.__getitem__,
        )
    with pytest.raises(delta_codec.DeltaError, match="missing"):
        vllm_parts.apply_in_worker(info["manifest"], info["parts"][:2], hf, TO_HF.__getitem__)
    with pytest.raises(delta_codec.DeltaError, match="magic"):
        vllm_parts.apply_in_worker(b"not a manifest", info["parts"], hf, TO_HF.__getitem__)
    assert same(hf, {TO_HF[k]: v for k, v in old.items()})
