"""Delta codec test helpers: float updates (hypothesis), Adam-like updates, forged and refused
payloads, CLASSED chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from delta_codec import Delta, DeltaError, apply_delta
from delta_codec.modes import CLASSED
from delta_codec.record import TensorRecord, chunks_of, pack_record

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn]
SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(SIGNED[t.element_size()]).numpy()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(bits(a[k]), bits(b[k])) for k in a)


def clone(s: dict) -> dict:
    return {k: v.clone() for k, v in s.items()}


def modes(d: Delta) -> set[int]:
    return {int(c[0]) for r in d.records for c in chunks_of(r)}


@st.composite
def float_update(draw):
    """Base N(0, scale) with a few special values; new = base moved by ~lr, so small magnitudes
    change most often (the case format 3 codes by class), plus some raw replacements."""
    dtype = draw(st.sampled_from(FLOATS))
    n = draw(st.integers(0, 6000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([0.02, 1.0, 300.0]))
    lr = draw(st.sampled_from([1e-4, 1e-3, 1e-2]))
    base = torch.from_numpy(rng.normal(0, scale, n)).to(dtype)
    if n:
        specials = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-30, -1e-30], dtype=torch.float64)
        idx = torch.from_numpy(rng.integers(0, n, min(n, 6)))
        base[idx] = specials[: idx.numel()].to(dtype)
    new = (base.double() + lr * scale * torch.from_numpy(rng.standard_normal(n))).to(dtype)
    raw = torch.from_numpy(rng.random(n) < draw(st.sampled_from([0.0, 0.002])))
    new_bits = bits(new).copy()
    new_bits[raw.numpy()] = rng.integers(-128, 127, int(raw.sum())).astype(new_bits.dtype)
    new = torch.from_numpy(new_bits).view(dtype)
    shape = (n,) if n % 3 else (n // 3, 3)
    return {"w": base.reshape(shape), "x": base[: n // 2].clone()}, {
        "w": new.reshape(shape),
        "x": base[: n // 2].clone(),
    }


def adam_like(n: int = 60_000, lr: float = 1e-4, seed: int = 0) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02
    step = lr * torch.randn(n, generator=g).sign() * 0.005  # ~1-2 % of the bf16 elements change
    return (
        {"a": w.to(torch.bfloat16), "b": (w[: n // 3] * 3).to(torch.float32)},
        {
            "a": (w + step).to(torch.bfloat16),
            "b": (w[: n // 3] * 3 + step[: n // 3] * 1e-3).to(torch.float32),
        },
    )


def refused(state: dict, blob, match: str) -> None:
    before = clone(state)
    with pytest.raises(DeltaError, match=match):
        apply_delta(state, Delta.from_bytes(blob) if isinstance(blob, (bytes, bytearray)) else blob)
    assert same(state, before), "a refused delta changed the state"


def forge(d: Delta, name: str, edit) -> bytes:
    """Re-pack one tensor's chunk records after edit(chunks) with valid checksums (a producer
    bug, not corruption): only the decoder's own checks can catch it."""
    recs = []
    for r in d.records:
        if r.name == name:
            chunks = chunks_of(r)
            edit(chunks)
            r = TensorRecord(r.name, r.dtype, r.shape, r.digest_a, r.digest_b, *pack_record(chunks))
        recs.append(r)
    return Delta(
        d.from_version, d.to_version, recs, base_digest=d.base_digest, new_digest=d.new_digest
    ).to_bytes()


def first_classed(chunks) -> list:
    return next(c for c in chunks if c[0] == CLASSED)
