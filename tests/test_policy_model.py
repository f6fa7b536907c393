"""Model, KV cache and inference state: incremental decoding must equal the full forward."""

import pytest
import torch

from policy import KVCache, ModelConfig, QuantConfig, Transformer, inference_state
from tests.helpers.tolerance import forward_tol

# why: cached/batched and full forwards run the same layers in other matmul shapes (another reduction
# order): forward_tol of the tiny model (~1.5e-4), its logits O(1)
ATOL = forward_tol(ModelConfig.tiny(vocab_size=97))["atol"]
# why: with fp8 activations a rounding-order difference can move an activation across an e4m3 rounding
# boundary (one step = eps 0.125 of it); two such flips through a d_model-wide matmul of ~1/sqrt(d) weights
ATOL_FP8_ACT = 2 * torch.finfo(torch.float8_e4m3fn).eps / ModelConfig.tiny(vocab_size=97).d_model ** 0.5


def make(attn, quant=(), **kw):
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=97, attn=attn, max_seq_len=64, **kw)
    return Transformer(cfg, quant=QuantConfig(sites=quant)).eval()


CASES = [
    ("gqa", (), {}),
    ("gqa", (), {"qkv_bias": True, "tie_embeddings": True}),
    ("mla", (), {}),
    ("mla", ("mla_rope_qk",), {}),
    ("mla", ("mla_rope_qk", "linear_act"), {"q_lora_rank": 32}),
    ("gqa", ("linear_act",), {}),
    ("gqa", ("linear_weight",), {}),
]


@pytest.mark.parametrize("attn,quant,kw", CASES)
def test_incremental_decode_matches_full_forward(attn, quant, kw):
    m = make(attn, quant, **kw)
    # per-token fp8 on every linear input: a 1-ulp fp32 difference between the one-token and the
    # all-token matmul can flip one fp8 rounding, and through the KV cache a flip reaches later
    # positions (seen: up to 8e-3 with MLA on one CPU, 1e-4 on another); a wrong cache is off by O(0.1)
    atol = ATOL_FP8_ACT if "linear_act" in quant else ATOL
    idx = torch.randint(3, 97, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(idx)
    cache = KVCache(m.cfg, slots=5, max_len=32)
    # three sequences in slots 4, 0, 2 with different prompt lengths: each decodes at its own length
    starts = {4: (0, 7), 0: (1, 3), 2: (2, 11)}
    for slot, (row, n) in starts.items():
        last = m.prefill(idx[row, :n], cache, slot)
        torch.testing.assert_close(last, full[row, n - 1], atol=atol, rtol=0)
    pos = {slot: n for slot, (row, n) in starts.items()}
    for step in range(10):
        slots = [s for s in (4, 0, 2) if step % 3 != 1 or s != 0]  # slot 0 skips some steps
        toks = [idx[starts[s][0], pos[s]] for s in slots]
        out = m.decode(torch.stack(toks), cache, slots)
        for r, s in enumerate(slots):
            torch.testing.assert_close(out[r], full[starts[s][0], pos[s]], atol=atol, rtol=0)
            pos[s] += 1
    assert cache.lengths.tolist() == [pos[0], 0, pos[2], 0, pos[4]]


@pytest.mark.parametrize("attn", ["gqa", "mla"])
def test_prefill_many_equals_one_by_one(attn):
    """The engine prefills a turn's admissions together (same-length prompts share a forward):
    logits and cache contents must match prefilling each prompt alone."""
    m = make(attn)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 97, (n,), generator=g) for n in (5, 9, 5, 5, 2)]
    slots = [3, 0, 5, 1, 4]
    one, many = KVCache(m.cfg, slots=6, max_len=16), KVCache(m.cfg, slots=6, max_len=16)
    alone = torch.stack([m.prefill(p, one, s) for p, s in zip(prompts, slots)])
    together = m.prefill_many(prompts, many, slots)
    torch.testing.assert_close(together, alone, atol=ATOL, rtol=0)
    assert many.lengths.tolist() == one.lengths.tolist() == [9, 5, 0, 5, 2, 5]
    for s, p in zip(slots, prompts):
        kv = (
            (slice(None), s, slice(None), slice(0, len(p)))
            if attn == "gqa"
            else (slice(None), s, slice(0, len(p)))
        )
        torch.testing.assert_close(many.a[kv], one.a[kv], atol=ATOL, rtol=0)
        torch.testing.assert_close(many.b[kv], one.b[kv], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="2 prompts for 1 slots"):
        m.prefill_many(prompts[:2], many, [0])
    with pytest.raises(ValueError, match="non-empty"):
        m.prefill_many([prompts[0], []], many, [0, 2])


def test_cache_reset_reuses_slot():
    m = make("mla", ("mla_rope_qk",))
    cache = KVCache(m.cfg, slots=2, max_len=16)
    a, b = torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10])
    m.prefill(a, cache, 1)
    cache.reset(1)
    last = m.prefill(b, cache, 1)
    with torch.no_grad():
        torch.testing.assert_close(last, m(b[None])[0, -1], atol=ATOL, rtol=0)


def test_bad_inputs_raise_clearly():
    m = make("gqa")
    cache = KVCache(m.cfg, slots=2, max_len=4)
    with pytest.raises(ValueError, match="non-empty"):
        m.prefill([], cache, 0)
    with pytest.raises(ValueError, match="token id out of range"):
        m.prefill([5, 200], cache, 0)
    assert cache.lengths.tolist() == [0, 0]  # nothing written by refused calls
    m.prefill([5, 6, 7], cache, 0)
    m.prefill([5], cache, 1)
    with pytest.raises(ValueError, match="duplicate slots"):
        m.decode([3, 4], cache, [0, 0])
    with pytest.raises(ValueError, match="2 slots|tokens for"):
        m.decode([3], cache, [0, 1])
    m.decode([3], cache, [0])
    with pytest.raises(ValueError, match="KV cache full"):
        m.decode([3, 4], cache, [0, 1])
    assert cache.lengths.tolist() == [4, 1]
    with pytest.raises(ValueError, match="max_len"):
        KVCache(m.cfg, slots=1, max_len=10_000)
    with pytest.raises(ValueError, match="mla_rope_qk"):
        m.quant = QuantConfig(sites=("mla_rope_qk",))
    with pytest.raises(ValueError, match=r"QuantConfig: sites\[0\]: Input should be .*\(got 'everything'\)"):
        QuantConfig(sites=("everything",))


def test_config_round_trip_and_presets():
    cfg = ModelConfig.small(vocab_size=99, attn="mla")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown ModelConfig keys"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_layer": 3})
    with pytest.raises(ValueError, match="attn"):
        ModelConfig(attn="mha")
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3)
    expected = {"tiny": (0.5, 1.5), "small": (8, 13), "base50m": (40, 60), "base100m": (85, 115)}
    for name, (lo, hi) in expected.items():
        for attn in ("gqa", "mla"):
            with torch.device("meta"):  # count only: no memory, no init
                n = Transformer(ModelConfig.preset(name, vocab_size=128, attn=attn)).num_params() / 1e6
            assert lo < n < hi, (name, attn, n)


def test_inference_state_round_trip_is_bf16_exact():
    src, dst = make("mla"), make("mla")
    torch.manual_seed(5)
    src = Transformer(src.cfg)
    state = inference_state(src)
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    dst.load_inference_state(state)
    for n, p in dst.named_parameters():
        assert p.dtype == torch.float32
        # why equal: a bf16 cast and back is exact (bf16 values are fp32 values); no arithmetic
        assert torch.equal(p.to(torch.bfloat16), state[n]) and torch.equal(p, state[n].float())
    # a state that does not fit is refused whole: nothing is copied
    before = {n: p.clone() for n, p in dst.named_parameters()}
    bad = {**inference_state(src)}
    bad["norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    bad["layers.0.attn_norm.weight"] = torch.zeros_like(bad["layers.0.attn_norm.weight"])
    with pytest.raises(ValueError, match="wrong shape"):
        dst.load_inference_state(bad)
    with pytest.raises(ValueError, match="missing"):
        dst.load_inference_state({k: v for k, v in state.items() if k != "tok_emb.weight"})
    assert all(torch.equal(p, before[n]) for n, p in dst.named_parameters())  # why equal: nothing written


def test_linear_weight_site_equals_prerounded_weights():
    from policy import fp8_round
    from policy.model import QLinear

    m, ref = make("gqa", ("linear_weight",)), make("gqa")
    with torch.no_grad():
        for mod in ref.modules():
            if isinstance(mod, QLinear):
                mod.weight.copy_(fp8_round(mod.weight))  # per output channel scales
        idx = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
        q, plain = m(idx), make("gqa")(idx)
        # why: x + (fp8(x) - x) is exactly fp8(x) (Sterbenz: |fp8(x) - x| <= x/16), then the same kernels on
        # the same shapes: exact in fact; atol 1e-6 only keeps the check 100x below the site's effect
        torch.testing.assert_close(q, ref(idx), atol=1e-6, rtol=0)
        assert (q - plain).abs().max() > 1e-4  # the site really changes the numerics
