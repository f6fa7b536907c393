"""bench.gpu_logprob_memory on the CPU at a small vocabulary: chunked logprobs equal the whole
projection's, chunking holds less for the backward, and the section reports its fields."""

from __future__ import annotations

import argparse

import torch

import policy
from bench import gpu_logprob_memory as M


def args(**kw) -> argparse.Namespace:
    base = dict(
        dry_run=True,
        seed=0,
        lp_scale="tiny",
        lp_batch=2,
        lp_prompt=4,
        lp_completion=60,
        lp_chunks=[32, 8],
    )
    return argparse.Namespace(**{**base, **kw})


def test_chunked_logprobs_equal_the_whole_projection_at_a_small_vocab():
    res = M.run(args())
    assert res["ok"] and res["device"] == "cpu" and res["dtype"] == "float32" and res["vocab"] == 1000
    assert res["tolerance"] == {"atol": 1e-5, "rtol": 0.0, "on": "logprobs of the completion tokens"}
    ref, *chunked = res["runs"]
    assert ref["reference"] and ref["chunk_tokens"] == 0 and ref["chunks"] == 1
    # the trainer's rule gives more rows than the 120 completion tokens here: not a chunked run
    assert res["trainer_chunk_tokens"] == int(64 * 2**20 / (4 * 1000))
    assert [r["chunk_tokens"] for r in chunked] == [32, 8] and [r["chunks"] for r in chunked] == [4, 15]
    for r in chunked:
        assert r["allclose"] and r["max_abs_diff"] <= 1e-5
        assert r["head_grad_rel_diff"] < 1e-5  # fp32: the same gradient
        # the whole fp32 [tokens, vocab] logits are held for the backward only without chunks
        assert r["saved_bytes"] < ref["saved_bytes"] - res["logits_fp32_bytes"]
        assert r["peak_bytes"] is None and r["peak_ratio"] is None  # no allocator peak on a CPU
    assert res["completion_tokens"] == 120 and res["logits_fp32_bytes"] == 120 * 1000 * 4


def test_the_model_is_the_shape_asked_for():
    cfg = M.qwen2_head_config()
    assert (cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff) == (
        152064,
        3584,
        28,
        4,
        18944,
    )
    assert cfg.qkv_bias and not cfg.tie_embeddings and cfg.n_layers == 1
    assert M.trainer_chunk(cfg) == 110  # 64 MiB of fp32 logits at 152064
    model = M.build_model(M.tiny_config(), torch.device("cpu"), torch.bfloat16, 0)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.rope_cos.dtype == torch.float32  # RoPE tables stay fp32 as in the trainer
    assert isinstance(model, policy.Transformer)
