"""Format 3's position coding against the bound it aims at: on an AdamW update of N(0, 0.02)
weights at ~1 % and ~2.5 % changed, the bits spent on positions (everything but the value
streams) are within half a bit per change of the change mask's entropy conditioned on each
element's base exponent."""

from __future__ import annotations

import pytest
import torch

from bench.delta import conditional_position_entropy, rl_update, value_bytes
from delta_codec import Delta, apply_delta, encode_delta
from delta_codec.modes import CLASSED
from delta_codec.record import chunks_of


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(2048, 1024, generator=g) * 0.02}


@pytest.mark.parametrize("lr", [3e-7, 1e-6])
def test_position_bits_are_within_half_a_bit_of_the_conditional_bound(weights, lr):
    before, after = rl_update(weights, lr, 2, 0)
    blob = encode_delta(before, after, context=True).to_bytes()
    d = Delta.from_bytes(blob)
    m = d.stats.changed
    assert 0.005 < m / d.stats.total < 0.05  # (the regime format 3 codes by class)
    position_bits = 8 * (len(blob) - value_bytes(d)) / m
    bound = conditional_position_entropy(before, after) / m
    assert bound <= position_bits <= bound + 0.5
    state = {k: v.clone() for k, v in before.items()}
    apply_delta(state, d)
    assert torch.equal(state["w"].view(torch.int16), after["w"].view(torch.int16))


@pytest.mark.parametrize("n,lr,seed", [(16384, 1e-6, 1), (32768, 3e-7, 0)])
def test_a_small_classed_chunk_costs_little_beyond_the_bound(n, lr, seed):
    """A small, sparse tensor (300-400 changes, one CLASSED chunk): its record's position bytes
    (all but the value streams) stay within 140 bytes of the conditional bound, i.e. the fixed
    cost of a classed chunk (header, one frame for all class streams) is small. A frame and three
    fields per class (format 3) cost 166-196 bytes here."""
    g = torch.Generator().manual_seed(seed)
    before, after = rl_update({"w": torch.randn(n, generator=g) * 0.02}, lr, 2, 0)
    d = Delta.from_bytes(encode_delta(before, after, context=True).to_bytes())
    assert [int(c[0]) for c in chunks_of(d.records[0])] == [CLASSED]
    assert 256 <= d.stats.changed <= 512
    position_bytes = d.records[0].nbytes - value_bytes(d)
    assert position_bytes <= conditional_position_entropy(before, after) / 8 + 140
    state = {k: v.clone() for k, v in before.items()}
    apply_delta(state, d)
    assert torch.equal(state["w"].view(torch.int16), after["w"].view(torch.int16))
