"""bench.gpu_llama8b: the 8 B config, its parameter count and FLOPs from the config alone (nothing
allocated), the peak table, the memory fit, and the section itself on the CPU at a tiny size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import policy
from bench import gpu_llama8b as L

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30


def meta_count(cfg: policy.ModelConfig) -> int:
    with torch.device("meta"):
        return policy.Transformer(cfg).num_params()


def test_llama8b_config_is_8b_parameters():
    cfg = L.llama8b_config()
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (4096, 32, 32, 8, 128)
    assert (cfg.d_ff, cfg.vocab_size, cfg.tie_embeddings, cfg.attn) == (14336, 128256, False, "gqa")
    assert L.param_count(cfg) == 8_030_261_248  # Llama-3-8B's published count
    assert L.param_count(cfg) == meta_count(cfg)  # the model built from the config agrees


def test_param_count_matches_the_model():
    for cfg in (
        L.tiny_config(),
        L.tiny_config(n_layers=1),
        policy.ModelConfig.tiny(vocab_size=99, qkv_bias=True),
        policy.ModelConfig.tiny(vocab_size=99, tie_embeddings=True),
    ):
        assert L.param_count(cfg) == meta_count(cfg) == policy.Transformer(cfg).num_params()


def test_flops_formula_on_a_known_shape():
    # hidden 8, 1 layer, heads 2 x 4 over 1 KV head, MLP 16, vocab 10, untied
    cfg = policy.ModelConfig(vocab_size=10, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16)
    # block: q 64 + k 32 + v 32 + o 64 + MLP 384 + norms 16 = 592; embedding 80, head 80, norm 8
    assert L.block_params(cfg) == 592 and L.param_count(cfg) == 760
    assert L.matmul_params(cfg) == 680  # all but the input embedding table
    # 6 * 680 + 12 * L(1) * H*d_h(8) * seq(16)
    assert L.model_flops_per_token(cfg, 16) == 4080 + 1536 == 5616
    # 3 sequences of 16 tokens, 4 of them prompt: the head does not run on prompt positions
    assert L.step_model_flops(cfg, 16, 3, 4) == 48 * 5616 - 6 * 10 * 8 * 3 * 4
    tied = policy.ModelConfig(
        vocab_size=10, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16, tie_embeddings=True
    )
    assert L.matmul_params(tied) == L.param_count(tied) == 680  # the table counts once, as the head
    big = L.llama8b_config()
    assert L.model_flops_per_token(big, 2048) == 6 * (8_030_261_248 - 128256 * 4096) + 12 * 32 * 4096 * 2048


def test_peak_table_by_device_name_and_flag():
    assert L.peak_tflops("NVIDIA H200", None) == (989.0, "table: H200")
    assert L.peak_tflops("NVIDIA H100 80GB HBM3", None) == (989.0, "table: H100")
    assert L.peak_tflops("NVIDIA H100 PCIe", None) == (756.0, "table: H100 PCIe")
    assert L.peak_tflops("NVIDIA H200 NVL", None) == (None, None)  # known, figure not in the table
    assert L.peak_tflops("Some Future GPU", None) == (None, None)
    assert L.peak_tflops(None, None) == (None, None)
    assert L.peak_tflops("Some Future GPU", 500.0) == (500.0, "--peak-tflops")
    assert L.peak_tflops("NVIDIA H200", 900.0) == (900.0, "--peak-tflops")  # the flag wins


def test_memory_fit_on_a_139_gib_device():
    cfg, tokens, free = L.llama8b_config(), 4 * 2048, 139 * GiB
    on = L.fit_layers(cfg, free, tokens, published_point=True)
    off = L.fit_layers(cfg, free, tokens, published_point=False)
    # 20 B a parameter (with the published point's copy) cannot hold 8 B in 139 GiB; 16 B nearly can
    assert 16 <= on < off <= 32
    est = L.memory_estimate(cfg, on, tokens, True)
    assert est["bytes_per_param"] == 20 and est["total"] <= L.HEADROOM * free
    assert L.memory_estimate(cfg, on + 1, tokens, True)["total"] > L.HEADROOM * free
    assert L.memory_estimate(cfg, 32, tokens, False)["parts"]["states"] == 16 * 8_030_261_248
    assert L.fit_layers(cfg, 10 * GiB, tokens, True) == 0  # not one layer: the run says so
    assert L.fit_layers(cfg, 1000 * GiB, tokens, True) == 32  # never more than the model has


def test_dry_run_steps_the_tiny_model_on_cpu(tmp_path):
    out = tmp_path / "l.json"
    p = subprocess.run(
        [sys.executable, "-m", "bench.gpu_llama8b", "--dry-run", "--json", "--out", str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res == json.loads(out.read_text())
    assert res["ok"] and res["device"] == "cpu" and res["scale"] == "tiny"
    assert res["layers"] == res["layers_all"] == 4 and res["params"] == res["params_from_config"]
    assert res["params_all_layers"] == L.param_count(L.tiny_config())
    assert len(res["steps"]) == 2 and all(s["grad_norm"] > 0 and "skipped" not in s for s in res["steps"])
    assert res["tokens_per_step"] == 2 * 32 and res["tokens_per_s"] > 0 and res["step_s_mean"] > 0
    cfg = L.tiny_config()
    assert res["model_flops_per_token"] == L.model_flops_per_token(cfg, 32)
    assert res["step_model_flops"] == L.step_model_flops(cfg, 32, 2, 4)
    assert res["achieved_tflops"] > 0
    # the CPU has no entry in the peak table: MFU is null, never a made-up figure
    assert res["gpu"] is None and res["peak_tflops"] is None and res["mfu"] is None
    assert res["peak_mem_gib"] is None and res["oom_at_layers"] == []
    assert res["published_point"] and res["activation_checkpointing"]
