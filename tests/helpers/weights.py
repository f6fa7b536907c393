"""Weights test helpers: a trajectory of states, deltas between them, state equality, and polling
until a condition holds."""

from __future__ import annotations

import asyncio

import torch

import delta_codec
import policy
from tests.helpers.engine import perturb  # (a trainer step stand-in)

CFG = policy.ModelConfig.tiny(vocab_size=64, max_seq_len=64)


def trajectory(n: int, seed: int = 0) -> list[dict]:
    """bf16 states v0..v(n-1), as a trainer would publish them."""
    torch.manual_seed(seed)
    states = [policy.inference_state(policy.Transformer(CFG))]
    for v in range(1, n):
        states.append(perturb(states[-1], 0.01, 0.02, seed=seed * 1000 + v))
    return states


def delta(states, a: int, b: int) -> delta_codec.Delta:
    return delta_codec.encode_delta(states[a], states[b], from_version=a, to_version=b)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def until(cond, timeout: float = 30.0) -> None:
    """Poll `cond` (the feed runs concurrently); fail with a clear message if it never holds."""
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")
