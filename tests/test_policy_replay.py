"""Trainer-side replay: on identical weights, recomputed logprobs equal behaviour logprobs
when mask and quant are replayed, and measurably differ when either is not."""

import json

import numpy as np
import pytest
import torch

from policy import (
    CharTokenizer,
    ModelConfig,
    QuantConfig,
    SamplingConfig,
    Transformer,
    fake_quant,
    fp8_round,
    generate,
    inference_state,
    masked_is_weight,
    mismatch_metrics,
    sequence_logprobs,
    truncated_is_weight,
)
from tests.helpers.tolerance import elementwise_rtol, forward_tol, sum_rtol

TOK = CharTokenizer.default()
FP8 = QuantConfig(sites=("mla_rope_qk",))


def peaked_mla(seed=0):
    """A random MLA model with realistically peaked next-token distributions and large RoPE activations
    (so that the fp8 rounding of the RoPE part is visible in the logits)."""
    torch.manual_seed(seed)
    m = Transformer(
        ModelConfig.tiny(vocab_size=TOK.vocab_size, attn="mla", max_seq_len=128), quant=FP8
    ).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(60)
        for blk in m.layers:
            blk.attn.kv_a_proj.weight.mul_(8)
            blk.attn.q_proj.weight.mul_(8)
    return m


def rollouts(m, samplings, n_new=24):
    prompts = [TOK.encode(s, bos=True) for s in ("12+7=", "def f(x):", "hello", "3*4=")]
    outs = generate(m, prompts, samplings, n_new, [TOK.eos_id], torch.Generator().manual_seed(7))
    behaviour = torch.zeros(len(outs), max(len(o.ids) for o in outs))
    for i, o in enumerate(outs):
        behaviour[i, : len(o.ids)] = torch.tensor(o.logprobs)
    return prompts, outs, behaviour


def test_replay_recovers_behaviour_logprobs_and_omissions_do_not():
    m = peaked_mla()
    samplings = [
        SamplingConfig(1.0, 0.9, 0),
        SamplingConfig(0.8, 0.95, 20),
        SamplingConfig(1.0, 1.0, 0),
        SamplingConfig(0.0, 1.0, 0),
    ]
    prompts, outs, behaviour = rollouts(m, samplings)
    comp, masks = [o.ids for o in outs], [o.mask for o in outs]

    def k3(replay_mask, quant, use_masks=True):
        m.quant = quant
        r = sequence_logprobs(
            m, prompts, comp, samplings, masks if use_masks else None, replay_mask=replay_mask
        )
        m.quant = FP8
        return mismatch_metrics(behaviour, r.logprobs, r.valid)

    both = k3(True, FP8)
    assert both["k3_mean"] < 1e-9 and both["ratio_p99_abs_log"] < 1e-4 and both["frac_outside_C"] == 0
    no_mask, no_quant, none = k3(False, FP8), k3(True, QuantConfig()), k3(False, QuantConfig())
    assert no_mask["k3_mean"] > 1e3 * both["k3_mean"] and no_mask["k3_mean"] > 1e-4
    assert no_quant["k3_mean"] > 1e3 * max(both["k3_mean"], 1e-15)
    assert none["k3_mean"] > 1e3 * both["k3_mean"]
    # without shipped masks the kept set is re-derived from our logits: exact here (same weights)
    assert k3(True, FP8, use_masks=False)["k3_mean"] < 1e-9


def test_sequence_logprobs_is_batched_padded_and_differentiable():
    m = peaked_mla(1)
    samplings = [SamplingConfig(1.0, 0.9, 0)] * 4
    prompts, outs, behaviour = rollouts(m, samplings, n_new=12)
    comp = [o.ids[:n] for o, n in zip(outs, (12, 3, 7, 1))]
    masks = [o.mask[:n] for o, n in zip(outs, (12, 3, 7, 1))]
    r = sequence_logprobs(m, prompts, comp, samplings, masks)
    assert r.logprobs.shape == r.entropy.shape == r.valid.shape == (4, 12)
    assert r.valid.sum(1).tolist() == [12, 3, 7, 1]
    assert torch.all(r.logprobs[~r.valid] == 0) and torch.all(r.entropy[r.valid] >= 0)
    # one sequence alone gives the same numbers as inside the padded batch
    alone = sequence_logprobs(m, prompts[1:2], comp[1:2], samplings[1:2], masks[1:2])
    # why: the padded batch runs other matmul shapes (another reduction order): forward_tol of the model,
    # scaled by the logprobs' size (the head is scaled up 60x here)
    tol = forward_tol(m.cfg, scale=float(r.logprobs[1, :3].detach().abs().max()))
    torch.testing.assert_close(alone.logprobs[0, :3], r.logprobs[1, :3], **tol)
    # entropy of the truncated distribution is below that of the full one
    full = sequence_logprobs(m, prompts, comp, samplings, masks, replay_mask=False)
    # why: an inequality between two fp32 entropies (sums over the vocabulary of O(1) terms)
    assert torch.all(r.entropy[r.valid] <= full.entropy[r.valid] + sum_rtol(m.cfg.vocab_size))
    # gradients flow through logprobs and entropy (straight-through the fp8 sites) into every block
    m.zero_grad()
    (r.logprobs[r.valid].sum() + r.entropy[r.valid].sum()).backward()
    qgrad = m.layers[0].attn.q_proj.weight.grad
    assert qgrad is not None and qgrad.abs().sum() > 0 and torch.isfinite(qgrad).all()


def test_fake_quant_is_position_local_and_straight_through():
    x = torch.randn(2, 9, 4, 16) * torch.logspace(-3, 3, 9)[None, :, None, None]
    q = fp8_round(x)
    for t in range(9):  # quantising one position alone == quantising all of them
        assert torch.equal(
            fp8_round(x[:, t : t + 1]), q[:, t : t + 1]
        )  # why equal: a max and a rounding, no sum
    assert torch.equal(fp8_round(x, block=8)[..., :8], fp8_round(x[..., :8]))
    rel = ((q - x).abs() / x.abs().amax(-1, keepdim=True)).max()
    assert 0 < rel < 2**-4  # e4m3: 3 mantissa bits
    assert torch.equal(fp8_round(q), q)  # idempotent
    xr = x.clone().requires_grad_()
    fake_quant(xr).mul(torch.arange(16.0)).sum().backward()
    assert torch.equal(xr.grad, torch.arange(16.0).expand_as(x))  # identity gradient
    with pytest.raises(ValueError, match="block"):
        fp8_round(x, block=5)


def test_bad_replay_inputs_refused():
    m = peaked_mla(2)
    s = [SamplingConfig(1.0, 0.5, 0)] * 2
    prompts, outs, _ = rollouts(m, s * 2, n_new=6)
    prompts, outs = prompts[:2], outs[:2]
    comp, masks = [o.ids for o in outs], [o.mask for o in outs]
    with pytest.raises(ValueError, match="mask has"):
        sequence_logprobs(m, prompts, comp, s, [masks[0][:-1], masks[1]])
    with pytest.raises(ValueError, match="outside its shipped kept set"):
        sequence_logprobs(
            m,
            prompts,
            comp,
            s,
            [masks[1][: len(comp[0])], masks[0][: len(comp[1])]]
            if len(comp[0]) == len(comp[1])
            else [masks[0], masks[1]][::-1],
        )
    with pytest.raises(ValueError, match="at least one token"):
        sequence_logprobs(m, [[], prompts[1]], comp, s, masks)
    with pytest.raises(ValueError, match="one sampling config"):
        sequence_logprobs(m, prompts, comp, s[:1], masks)


def test_mismatch_metrics_and_is_weights_on_known_values():
    b = torch.log(torch.tensor([[0.5, 0.5, 0.2, 0.1]]))
    t = torch.log(torch.tensor([[0.5, 0.2, 0.6, 0.1]]))
    valid = torch.tensor([[True, True, True, False]])
    r = np.array([1.0, 0.4, 3.0])
    got = mismatch_metrics(b, t, valid, C=2.0)
    # why: the inputs are fp32 logs (2 roundings on |log| <= 2.3) then float64; k3 = r - 1 - log r
    # amplifies them by up to 3x more (its smallest nonzero value 0.32 against terms ~1)
    rel = elementwise_rtol(2, cond=2.3 * 3)
    assert got["k3_mean"] == pytest.approx(np.mean(r - 1 - np.log(r)), rel=rel)
    assert got["ratio_mean"] == pytest.approx(r.mean(), rel=rel)
    assert got["frac_outside_C"] == pytest.approx(2 / 3)  # 0.4 < 1/2 and 3.0 > 2 (why: a count, exact)
    assert got["ratio_p99_abs_log"] == pytest.approx(np.quantile(np.abs(np.log(r)), 0.99), rel=rel)
    lr = torch.log(torch.tensor(r, dtype=torch.float32)).requires_grad_()
    # why: exp(log r) in fp32: 2 roundings, exp amplifying the log's by |log r| <= 1.1
    ew = elementwise_rtol(2, cond=1.1)
    assert torch.allclose(truncated_is_weight(lr, 2.0), torch.tensor([1.0, 0.4, 2.0]), rtol=ew, atol=0)
    assert torch.allclose(masked_is_weight(lr, 2.0), torch.tensor([1.0, 0.0, 0.0]), rtol=ew, atol=0)
    assert not truncated_is_weight(lr).requires_grad
    with pytest.raises(ValueError, match="shape mismatch"):
        mismatch_metrics(b, t[:, :2], valid)
    with pytest.raises(ValueError, match="at least one valid"):
        mismatch_metrics(b, t, torch.zeros_like(valid))


def test_worker_side_bf16_state_gives_same_numerics():
    """Worker holds the published bf16 state; a trainer model loaded from the same state replays it."""
    trainer = peaked_mla(3)
    worker = Transformer(trainer.cfg, quant=FP8).eval()
    state = inference_state(trainer)
    worker.load_inference_state(state)
    trainer.load_inference_state(state)
    samplings = [SamplingConfig(1.0, 0.9, 0)] * 4
    prompts, outs, behaviour = rollouts(worker, samplings, n_new=10)
    r = sequence_logprobs(trainer, prompts, [o.ids for o in outs], samplings, [o.mask for o in outs])
    assert mismatch_metrics(behaviour, r.logprobs, r.valid)["k3_mean"] < 1e-9


def test_mismatch_bench_runs_and_meets_targets_at_tiny_size(capsys):
    from bench.mismatch import main

    out = main(["--preset", "tiny", "--vocab", "256", "--tokens", "96", "--batch", "8", "--json"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(out))
    assert out["tokens"] == 96 and set(out["results"]) == {"none", "mask", "quant", "both"}
    assert out["targets_met"] and out["results"]["both"]["k3_mean"] < out["results"]["mask"]["k3_mean"]


def test_greedy_generate_follows_full_forward_and_stops():
    m = peaked_mla(4)
    prompts = [TOK.encode("x=", bos=True), TOK.encode("abc", bos=True)]
    outs = generate(m, prompts, SamplingConfig(0.0), 8)
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            assert o.finish_reason == "length" and len(o.ids) == 8 and o.logprobs == [0.0] * 8
            assert list(o.mask.counts) == [1] * 8 and list(o.mask.ids) == o.ids
            logits = m(torch.tensor([p + o.ids]))[0, len(p) - 1 : -1]
            assert logits.argmax(-1).tolist() == o.ids
    stop = outs[0].ids[3]
    first = outs[0].ids.index(stop)
    again = generate(m, prompts, SamplingConfig(0.0), 8, stop_ids=[stop])
    assert again[0].ids == outs[0].ids[: first + 1] and again[0].finish_reason == "stop"
    assert len(again[0].mask) == first + 1
    cut = outs[1].ids.index(stop) + 1 if stop in outs[1].ids else 8
    assert again[1].ids == outs[1].ids[:cut]


def test_generate_stop_fn_ends_each_sequence_where_it_first_holds():
    """stop_fn (e.g. "the bash block is closed") ends a sequence with the id that made it true,
    the others run on: the held-out eval of episodes stops a turn where the workers stop it."""
    m = peaked_mla(4)
    prompts = [TOK.encode("x=", bos=True), TOK.encode("abc", bos=True)]
    outs = generate(m, prompts, SamplingConfig(0.0), 8)
    want = outs[0].ids[:3]
    again = generate(m, prompts, SamplingConfig(0.0), 8, stop_fn=lambda ids: ids[:3] == want)
    assert again[0].ids == want and again[0].finish_reason == "stop_fn" and len(again[0].mask) == 3
    if outs[1].ids[:3] != want:
        assert again[1].ids == outs[1].ids and again[1].finish_reason == "length"
