"""Device memory of the trainer's log-prob path at a 152 k vocabulary, chunked vs whole.

`python -m bench.gpu_logprob_memory --json` (bench.gpu runs it with `--logprob-memory`, in a
process of its own). `--dry-run`: the same code on the CPU at a tiny vocabulary, for the tests.

The path: policy.sequence_logprobs, as trainer.learner calls it, forward and backward (loss: the
mean completion logprob), on a one-layer model with Qwen2-7B's shapes (vocab 152064, hidden 3584,
GQA 28/4, SwiGLU 18944, q/k/v biases, untied head) in bf16, made on the device (1.32 B
parameters). The reference run projects every completion position at once (chunk_tokens 0: the
whole [tokens, vocab] fp32 logits live through the backward); each other run projects
`chunk_tokens` rows at a time under activation checkpointing: `--lp-chunks`, plus the trainer's own
rule (`[trainer.loss] logit_chunk_mb` = 64 MiB of fp32 logits: 110 rows at 152064).

Per run: `peak_bytes`, the device allocator's peak during forward + backward above what was
allocated before it (parameters, inputs; CUDA only), and its ratio to the reference; `saved_bytes`,
the distinct storages autograd holds for the backward once the forward is done (parameters
excluded; measured on any device, so the CPU tests see the difference too); the time; and the
check against the reference: `max_abs_diff` of the logprobs and `allclose` at the tolerance in
`tolerance` (rtol 0; atol 1/16 in bf16, where a 1-ulp difference of a logit near 4-8 from a GEMM
of another row count is 1/32; 1e-5 in fp32), plus `head_grad_rel_diff`, the relative difference of
the head's gradient (reported, not checked: chunks add their bf16 partial gradients in bf16).

Last line: one JSON object (also written to --out)."""

from __future__ import annotations

import argparse
import gc
import time

import torch

import policy
from trainer.loss import LossConfig

from .gpu import gpu_or_dry_run, run_reported, sync

ATOL = {torch.bfloat16: 1 / 16, torch.float32: 1e-5}


def qwen2_head_config(max_seq_len: int = 4096) -> policy.ModelConfig:
    """Qwen2-7B's shapes (its HF config.json), one layer: the vocabulary projection is what matters."""
    return policy.ModelConfig(
        vocab_size=152064,
        d_model=3584,
        n_layers=1,
        n_heads=28,
        n_kv_heads=4,
        head_dim=128,
        d_ff=18944,
        max_seq_len=max_seq_len,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
        tie_embeddings=False,
    )


def tiny_config(max_seq_len: int = 256) -> policy.ModelConfig:
    return policy.ModelConfig(
        vocab_size=1000,
        d_model=64,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        d_ff=128,
        max_seq_len=max_seq_len,
        qkv_bias=True,
    )


def trainer_chunk(cfg: policy.ModelConfig) -> int:
    """Rows per projection by the trainer's rule (trainer/factory.py build_learner)."""
    return max(1, int(LossConfig().logit_chunk_mb * 2**20 / (4 * cfg.vocab_size)))


def build_model(cfg: policy.ModelConfig, dev: torch.device, dtype: torch.dtype, seed: int):
    """Random weights made on the device, cast to `dtype` there; RoPE tables kept fp32 as in the
    trainer (FSDP2 casts parameters only)."""
    torch.manual_seed(seed)
    with torch.device(dev):
        model = policy.Transformer(cfg)
    model = model.to(dtype)
    model.reset_rope()
    return model


def one_run(model, prompts, comps, chunk: int, dev: torch.device) -> dict:
    """Forward + backward of sequence_logprobs at `chunk`; memory, time, logprobs, head gradient."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    sync(dev)
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        res = policy.sequence_logprobs(
            model, prompts, comps, policy.SamplingConfig(temperature=1.0), None, chunk_tokens=chunk
        )
    saved_bytes = sum(saved.values())
    loss = -(res.logprobs * res.valid).sum() / res.valid.sum()
    loss.backward()
    sync(dev)
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else None
    head = model.lm_head.weight.grad.detach().float()
    return {
        "chunk_tokens": chunk,
        "peak_bytes": peak,
        "saved_bytes": saved_bytes,
        "s": wall,
        "_logprobs": res.logprobs.detach()[res.valid].float(),
        "_head_grad": head,
    }


def run(args) -> dict:
    dev = gpu_or_dry_run(args.dry_run, "bench.gpu_logprob_memory")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    seq = args.lp_prompt + args.lp_completion
    cfg = tiny_config(max(256, seq)) if args.lp_scale == "tiny" else qwen2_head_config(max(4096, seq))
    model = build_model(cfg, dev, dtype, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    ids = [torch.randint(3, cfg.vocab_size, (seq,), generator=g).tolist() for _ in range(args.lp_batch)]
    prompts, comps = [x[: args.lp_prompt] for x in ids], [x[args.lp_prompt :] for x in ids]
    n = args.lp_batch * args.lp_completion
    chunks = [c for c in dict.fromkeys([*args.lp_chunks, trainer_chunk(cfg)]) if 0 < c < n]
    ref = one_run(model, prompts, comps, 0, dev)
    atol = ATOL[dtype]
    rows = [ref]
    for c in chunks:
        r = one_run(model, prompts, comps, c, dev)
        d = (r["_logprobs"] - ref["_logprobs"]).abs()
        r.update(
            chunks=-(-n // c),
            max_abs_diff=float(d.max()),
            mean_abs_diff=float(d.mean()),
            allclose=bool(torch.allclose(r["_logprobs"], ref["_logprobs"], rtol=0.0, atol=atol)),
            head_grad_rel_diff=float((r["_head_grad"] - ref["_head_grad"]).norm() / ref["_head_grad"].norm()),
            peak_ratio=r["peak_bytes"] / ref["peak_bytes"] if ref["peak_bytes"] else None,
            saved_ratio=r["saved_bytes"] / ref["saved_bytes"] if ref["saved_bytes"] else None,
        )
        del r["_head_grad"], r["_logprobs"]  # on the device: keep only the figures
        rows.append(r)
    del ref["_head_grad"], ref["_logprobs"]
    ref.update(chunks=1, reference=True)
    return {
        "bench": "gpu_logprob_memory",
        "dry_run": args.dry_run,
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "torch": torch.__version__,
        "scale": args.lp_scale,
        "dtype": str(dtype).removeprefix("torch."),
        "vocab": cfg.vocab_size,
        "hidden": cfg.d_model,
        "params": model.num_params(),
        "batch": args.lp_batch,
        "prompt_len": args.lp_prompt,
        "completion_len": args.lp_completion,
        "completion_tokens": n,
        "logits_fp32_bytes": n * cfg.vocab_size * 4,  # one whole [tokens, vocab] fp32 copy
        "trainer_chunk_tokens": trainer_chunk(cfg),
        "tolerance": {"atol": atol, "rtol": 0.0, "on": "logprobs of the completion tokens"},
        "runs": rows,
        "ok": all(r.get("allclose", True) for r in rows),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print only the JSON result line")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny vocabulary, same code path")
    ap.add_argument("--out", default=None, help="write the JSON here as well")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--lp-scale", choices=("qwen2", "tiny"), default=None, help="default: qwen2, tiny on --dry-run"
    )
    ap.add_argument("--lp-batch", type=int, default=None, help="sequences")
    ap.add_argument("--lp-prompt", type=int, default=None, help="prompt tokens of each sequence")
    ap.add_argument("--lp-completion", type=int, default=None, help="completion tokens of each sequence")
    ap.add_argument(
        "--lp-chunks", type=int, nargs="+", default=None, help="chunk sizes besides the trainer's rule"
    )
    args = ap.parse_args(argv)
    if args.lp_scale is None:
        args.lp_scale = "tiny" if args.dry_run else "qwen2"
    small = args.lp_scale == "tiny"
    sizes = (
        {"lp_batch": 2, "lp_prompt": 4, "lp_completion": 60, "lp_chunks": [32, 8]}
        if small
        else {"lp_batch": 4, "lp_prompt": 64, "lp_completion": 1984, "lp_chunks": [2048, 512]}
    )
    for k, v in sizes.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    res = run_reported("gpu_logprob_memory", args, run)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
