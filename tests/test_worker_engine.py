"""Torch engine: continuous batching and per-token hot-patching, checked against fresh models."""

from __future__ import annotations

import asyncio

import pytest
import torch

import delta_codec
import policy
from bus.events import SamplingParams
from rollout_worker.engine import StaleEpochError, VersionGapError
from rollout_worker.torch_engine import TorchEngine
from tests.helpers.engine import CFG, perturb, reference_logprobs
from tests.helpers.tolerance import forward_tol


def decode_tol(logprobs: torch.Tensor) -> dict:
    """why: the engine decodes token by token with its KV cache, the reference runs the whole sequence:
    the same layers in other matmul shapes (another reduction order), at the logprobs' size."""
    return forward_tol(CFG, scale=float(logprobs.abs().max()))


def initial_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return policy.inference_state(policy.Transformer(CFG))


async def _wait_tokens(engine: TorchEngine, n: int) -> None:
    while not any(len(s.tokens) >= n for s in engine.active.values()):
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("update_mode", ["swap", "inline"])
async def test_delta_mid_sequence_switches_weights_without_restart(update_mode):
    s0 = initial_state()
    s1 = perturb(s0, 0.3, 0.05, seed=1)
    delta = delta_codec.encode_delta(s0, s1, from_version=0, to_version=1)
    eng = TorchEngine(CFG, slots=2, max_len=128, seed=3, update_mode=update_mode)
    await eng.load_keyframe(s0, version=0, epoch=1)
    prompt = [1, 10, 11, 12, 13]
    gen_task = asyncio.create_task(eng.generate(prompt, SamplingParams(max_tokens=40), seed=0))
    await _wait_tokens(eng, 8)
    await eng.apply_delta(delta, epoch=1)  # returns once applied at a token boundary
    g = await gen_task
    await eng.close()

    k = g.token_versions.index(1)
    assert len(g.completion_ids) == 40 and g.finish_reason == "length"
    assert 8 <= k < 40 and g.token_versions == [0] * k + [1] * (40 - k)  # no restart, one switch
    assert eng.version == 1 and all(torch.equal(eng.state[n], s1[n]) for n in s1)
    behaviour = torch.tensor(g.logprobs)
    mixed = reference_logprobs({0: s0, 1: s1}, prompt, g.completion_ids, g.token_versions)
    torch.testing.assert_close(behaviour, mixed, **decode_tol(mixed))
    # the tokens after the switch really came from the new weights, not the old ones
    stale = reference_logprobs({0: s0}, prompt, g.completion_ids, [0] * 40)
    torch.testing.assert_close(behaviour[:k], stale[:k], **decode_tol(stale[:k]))
    assert (behaviour[k:] - stale[k:]).abs().max() > 1e-2
    st = eng.stats()
    assert st["updates"] == 2 and st["update_stall_ms_p99"] > 0  # keyframe (idle) + the delta (stalled)


@pytest.mark.parametrize("quant", [(), ("linear_act",)])
async def test_new_sequence_after_delta_matches_fresh_model_with_truncation(quant):
    s0 = initial_state()
    s1 = perturb(s0, 0.3, 0.05, seed=2)
    eng = TorchEngine(CFG, slots=2, max_len=128, seed=4, quant=policy.QuantConfig(sites=quant))
    await eng.load_keyframe(s0, 0, epoch=1)
    await eng.apply_delta(delta_codec.encode_delta(s0, s1, from_version=0, to_version=1), epoch=1)
    sp = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=20)
    prompt = [1, 20, 21, 22]
    g = await eng.generate(prompt, sp, seed=0)
    await eng.close()
    assert g.token_versions == [1] * len(g.completion_ids) and g.quant["sites"] == list(quant)
    mask = policy.SamplingMask.from_wire(g.sampling_mask)

    def replay(q: policy.QuantConfig) -> torch.Tensor:
        fresh = policy.Transformer(CFG, quant=q).eval()
        fresh.load_inference_state(s1)
        with torch.no_grad():
            return policy.sequence_logprobs(
                fresh, [prompt], [g.completion_ids], policy.SamplingConfig(0.8, 0.9, 20), masks=[mask]
            ).logprobs[0]

    behaviour = torch.tensor(g.logprobs)
    same_numerics = replay(policy.QuantConfig.from_wire(g.quant))  # what the trainer replays
    if not quant:
        torch.testing.assert_close(same_numerics, behaviour, **decode_tol(same_numerics))
    else:  # fp8 on every linear input: a 1-ulp matmul difference can flip a rounding (see policy tests)
        # why: a flipped e4m3 rounding moves an activation by 1/8 of itself, so no fp32 bound holds; the max
        # only rules out a wrong model (errors > 5e-2) and the mean must beat unquantised replay 5x
        err = (same_numerics - behaviour).abs()
        err_unquantised = (replay(policy.QuantConfig()) - behaviour).abs()
        assert err.max() < 5e-2 and err.mean() < 0.2 * err_unquantised.mean(), (err, err_unquantised)


async def test_bad_updates_are_refused_and_leave_the_engine_generating():
    s0 = initial_state()
    s1, s2 = perturb(s0, 0.01, 0.02, seed=5), perturb(s0, 0.01, 0.02, seed=6)
    eng = TorchEngine(CFG, slots=2, max_len=64)
    await eng.load_keyframe(s0, 0, epoch=2)
    with pytest.raises(StaleEpochError):
        await eng.apply_delta(delta_codec.encode_delta(s0, s1, from_version=0, to_version=1), epoch=1)
    with pytest.raises(VersionGapError):
        await eng.apply_delta(delta_codec.encode_delta(s1, s2, from_version=1, to_version=2), epoch=2)
    with pytest.raises(delta_codec.DeltaError, match="base digest"):  # right version number, wrong base bits
        await eng.apply_delta(delta_codec.encode_delta(s1, s2, from_version=0, to_version=1), epoch=2)
    assert (eng.version, eng.epoch) == (0, 2) and all(torch.equal(eng.state[n], s0[n]) for n in s0)
    assert eng.stats()["updates_refused"] == 3
    g = await eng.generate([1, 5], SamplingParams(max_tokens=5))
    assert g.token_versions == [0] * 5
    with pytest.raises(ValueError, match="does not match the model"):
        await eng.load_keyframe({k: v for k, v in list(s0.items())[1:]}, 3, epoch=2)
    await eng.close()


async def test_bad_requests_get_clear_errors():
    eng = TorchEngine(CFG, slots=1, max_len=32)
    with pytest.raises(RuntimeError, match="no weights"):
        await eng.generate([1, 2], SamplingParams(max_tokens=4))
    await eng.load_keyframe(initial_state(), 0, 0)
    with pytest.raises(ValueError, match="exceeds"):
        await eng.generate([1] * 30, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="out of range"):
        await eng.generate([1, 64], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        await eng.generate([], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="top_p"):
        await eng.generate([1], SamplingParams(max_tokens=4, top_p=0.0))
    assert (await eng.generate([1], SamplingParams(max_tokens=3))).finish_reason == "length"
    await eng.close()


async def test_continuous_batching_refills_slots_at_once():
    eng = TorchEngine(CFG, slots=2, max_len=64)
    await eng.load_keyframe(initial_state(), 0, 0)
    lengths = [40] + [5] * 8
    gens = await asyncio.gather(*(eng.generate([1, 3], SamplingParams(max_tokens=n)) for n in lengths))
    await eng.close()
    assert [len(g.completion_ids) for g in gens] == lengths
    # static batches of 2 would take 39 + 4*4 + 4 = 59 decode steps; refilling keeps it near 40
    steps = len(eng.metrics.step_ms)
    assert steps <= 42, steps
    assert eng.stats()["slot_occupancy"] > 0.95


async def test_decoding_goes_on_while_the_event_loop_is_busy():
    """The decode loop has its own thread: a coroutine hogging the event loop (publishing, a
    slow handler) must not stop tokens, and the result still arrives on the loop afterwards."""
    import time

    eng = TorchEngine(CFG, slots=2, max_len=128, seed=5)
    await eng.load_keyframe(initial_state(), version=0, epoch=1)
    gen = asyncio.create_task(eng.generate([1, 10, 11], SamplingParams(max_tokens=100), seed=0))
    await _wait_tokens(eng, 2)
    before = eng.metrics.tokens
    time.sleep(0.3)  # blocks the event loop, not the engine
    during = eng.metrics.tokens - before
    g = await gen
    await eng.close()
    assert during >= 20, f"only {during} tokens while the loop was blocked"
    assert len(g.completion_ids) == 100 and g.token_versions == [0] * 100


def test_engine_device_is_checked_and_used():
    """`device` puts weights and KV cache there; a worker config names only cpu or cuda[:N]."""
    from rollout_worker.config import WorkerConfig

    eng = TorchEngine(CFG, slots=1, max_len=16, device="cpu")
    assert eng.device.type == "cpu" and eng.cache.lengths.device.type == "cpu"
    assert all(p.device.type == "cpu" for p in eng.model.parameters())
    assert WorkerConfig(engine={"device": "cuda:1"}).engine.device == "cuda:1"
    for bad in ("gpu", "cuda:x", "meta"):
        with pytest.raises(ValueError, match=r"\[worker.engine\] device: String should match pattern"):
            WorkerConfig(engine={"device": bad})
