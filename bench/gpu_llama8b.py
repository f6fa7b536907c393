"""The trainer's step at Llama-3-8B's shapes on one GPU: tokens/s, model FLOPs and MFU.

`python -m bench.gpu_llama8b --json` (bench.gpu runs it with `--llama8b`, in a process of its own
so that it starts on an empty device). `--dry-run`: the same code on the CPU at `--llama-scale
tiny` (a 4-layer Llama-layout model), for the tests.

The model: policy.ModelConfig with Llama-3-8B's shapes (vocab 128256, hidden 4096, 32 layers, 32
query heads of 128 over 8 KV heads, SwiGLU 14336, RoPE theta 500000 without scaling, RMSNorm eps
1e-5, untied head): 8 030 261 248 parameters. Random weights, built directly on the device in
fp32 (`with torch.device(dev)`: the model's own init runs there, no host copy): the trainer's
master weights are fp32 and its AdamW updates them; FSDP2 gathers them as bf16 for compute.

The step: trainer.learner.Learner.step, exactly as bench.gpu's trainer section runs it: FSDP2 on a
world-1 group (trainer.fsdp.shard: bf16 parameters, fp32 gradient reduction), fused AdamW on the
fp32 master, activation checkpointing (trainer.fsdp.checkpoint_blocks), the vocabulary projected
`logit_chunk_tokens` rows at a time by the trainer's own rule (64 MiB of fp32 logits), the
forward and backward at the published bf16 point unless `--no-llama-published-point`. Batch:
`--llama-batch` sequences of `--llama-seq` tokens, `--llama-prompt` of them prompt (random ids);
behaviour logprobs -ln(vocab) (a random-init model is near uniform, so the IS weights stay ~1).

Memory (policy/memory.py `memory_estimate`). Bytes per parameter held through the step: fp32
master 4 + fp32 gradient 4 + AdamW's two fp32 moments 8 = 16, plus 4 for the published point's
copy of the master (trainer/published_point.py) = 20. At 8.03 B that is 128 GB (119.7 GiB) or
161 GB: all 32 layers do not fit an H200's ~140 GiB with the published point on. On top: the root
(embedding, head) gathered in bf16 through forward and backward, two blocks gathered and one
block's bf16 gradients, every block's checkpointed input (bf16 [tokens, hidden]), one block's
activations live twice over while it is recomputed and differentiated (34·hidden + 12·kv_dim +
8·mlp bytes per token, counted from policy/model.py's saved tensors in bf16), and a few fp32
[chunk, vocab] logits. Without `--llama-layers`, the run takes the most layers whose estimate fits
90 % of the device's free memory; on an out-of-memory it retries at 3/4 of the layers (twice at
most) and says so (`oom_at_layers`).

FLOPs. Model FLOPs per token (`model_flops_per_token`, PaLM's appendix B): 6·N + 12·L·H·d_h·seq,
N = the parameters that enter a matmul (all but the input embedding table, a lookup; norm weights
included, negligible), L layers, H·d_h = query heads × head size (4096 here, the hidden size),
seq = tokens per sequence; the attention term counts the whole score and value products (not
halved for the causal mask). The recomputation of activation checkpointing is not counted (model
FLOPs, not hardware FLOPs). The trainer projects only completion positions to the vocabulary, so a
step's model FLOPs are tokens·(6·N + 12·L·H·d_h·seq) − 6·vocab·hidden·prompt_tokens. MFU =
achieved FLOP/s ÷ the chip's dense bf16 peak (`PEAK_BF16_TFLOPS` by device name; `--peak-tflops`
for another chip, else MFU is null). With fewer layers the embedding and head weigh more, so MFU
moves a little with the layer count; `est_tokens_per_s_all_layers` scales tokens/s by the FLOPs per
token of 32 layers at the same achieved FLOP/s (an estimate, not a measurement).

Last line: one JSON object (also written to --out)."""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import time

import torch

import policy

# the estimate lives in policy (asyncrl config check uses it for a [layout]'s trainer share)
from policy.memory import (  # noqa: F401  (block_params, outer_params: this module's API, tested)
    HEADROOM,
    block_params,
    fit_layers,
    logit_chunk_rows,
    memory_estimate,
    outer_params,
    param_count,
)
from trainer.fsdp import checkpoint_blocks, shard
from trainer.learner import Learner, PackedSample
from trainer.loss import LossConfig

from .gpu import gpu_or_dry_run, run_reported, sync, world_one

# dense bf16 tensor-core peak, TFLOP/s, by a substring of torch.cuda.get_device_name; first match
# wins; None: a known name whose figure is not in this table (MFU needs --peak-tflops)
PEAK_BF16_TFLOPS: tuple[tuple[str, float | None], ...] = (
    ("H200 NVL", None),
    ("H100 NVL", None),
    ("H100 PCIe", 756.0),
    ("H200", 989.0),  # SXM
    ("H100", 989.0),  # SXM (HBM3)
    ("A100", 312.0),
)


def llama8b_config(n_layers: int = 32, max_seq_len: int = 8192) -> policy.ModelConfig:
    """Llama-3-8B's shapes (its HF config.json) as a policy.ModelConfig."""
    return policy.ModelConfig(
        vocab_size=128256,
        d_model=4096,
        n_layers=n_layers,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=14336,
        attn="gqa",
        max_seq_len=max_seq_len,
        rope_theta=500000.0,
        rope_scaling=None,
        norm_eps=1e-5,
        qkv_bias=False,
        tie_embeddings=False,
    )


def tiny_config(n_layers: int = 4, max_seq_len: int = 256) -> policy.ModelConfig:
    """The same layout at CPU-test size (GQA 4/2, untied head)."""
    return policy.ModelConfig(
        vocab_size=256,
        d_model=64,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        d_ff=128,
        max_seq_len=max_seq_len,
        rope_theta=500000.0,
        norm_eps=1e-5,
    )


def matmul_params(cfg: policy.ModelConfig) -> int:
    """N of the FLOPs formula: every parameter but the input embedding table (a tied table counts
    once, as the head)."""
    return param_count(cfg) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)


def model_flops_per_token(cfg: policy.ModelConfig, seq: int) -> int:
    """6·N + 12·L·H·d_h·seq: forward and backward matmuls, and attention over `seq` tokens."""
    return 6 * matmul_params(cfg) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq


def step_model_flops(cfg: policy.ModelConfig, seq: int, sequences: int, prompt: int) -> int:
    """A trainer step's model FLOPs: the head runs on completion positions only."""
    tokens = sequences * seq
    return tokens * model_flops_per_token(cfg, seq) - 6 * cfg.vocab_size * cfg.d_model * sequences * prompt


def peak_tflops(name: str | None, flag: float | None) -> tuple[float | None, str | None]:
    """(dense bf16 peak TFLOP/s, where it came from): --peak-tflops, else the table, else None."""
    if flag:
        return flag, "--peak-tflops"
    for key, value in PEAK_BF16_TFLOPS:
        if name and key in name:
            return value, (f"table: {key}" if value else None)
    return None, None


def build_model(cfg: policy.ModelConfig, dev: torch.device, seed: int) -> policy.Transformer:
    """Random fp32 weights made on the device itself (the init runs there; no host copy)."""
    torch.manual_seed(seed)
    with torch.device(dev):
        return policy.Transformer(cfg)


def make_samples(cfg: policy.ModelConfig, batch: int, seq: int, prompt: int, seed: int) -> list:
    """Random sequences as the trainer receives them: full sampling masks, one group."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    behav = -math.log(cfg.vocab_size)
    out = []
    for i in range(batch):
        ids = torch.randint(3, cfg.vocab_size, (seq,), generator=g).tolist()
        comp = ids[prompt:]
        out.append(
            PackedSample(
                f"r{i}",
                0,
                rng.random(),
                1.0,
                0,
                ids[:prompt],
                comp,
                [behav] * len(comp),
                {"temperature": 1.0, "top_p": 1.0, "top_k": 0},
                {"format": "full", "rows": len(comp)},
                {},
            )
        )
    return out


def attempt(args, cfg: policy.ModelConfig, dev: torch.device) -> dict:
    """Build, shard and step at cfg's layer count; the step records."""
    model = build_model(cfg, dev, args.seed)
    checkpoint_blocks(model)
    shard(model, dev, mixed_precision=dev.type == "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    loss = LossConfig()  # the trainer's defaults: micro-batches of 32 sequences, 16384 tokens
    learner = Learner(
        model,
        opt,
        loss,
        micro_batch=loss.micro_batch,
        micro_batch_tokens=loss.micro_batch_tokens,
        logit_chunk_tokens=logit_chunk_rows(cfg),
        published_point=args.llama_published_point,
    )
    batch = make_samples(cfg, args.llama_batch, args.llama_seq, args.llama_prompt, args.seed)
    steps = []
    for i in range(args.llama_steps):
        sync(dev)
        t0 = time.perf_counter()
        st = learner.step(batch)
        sync(dev)
        row = {
            "step": i,
            "step_s": time.perf_counter() - t0,
            "loss": st["loss"],
            "grad_norm": st["grad_norm"],
        }
        if "skipped" in st:
            row["skipped"] = st["skipped"]
        steps.append(row)
    return {"steps": steps, "params": sum(p.numel() for p in model.parameters())}


def run(args) -> dict:
    dev = gpu_or_dry_run(args.dry_run, "bench.gpu_llama8b")
    full = llama8b_config() if args.llama_scale == "8b" else tiny_config()
    if args.llama_seq > full.max_seq_len or not 0 < args.llama_prompt < args.llama_seq:
        raise SystemExit(f"need 0 < --llama-prompt < --llama-seq <= {full.max_seq_len}")
    tokens = args.llama_batch * args.llama_seq
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    out: dict = {
        "bench": "gpu_llama8b",
        "dry_run": args.dry_run,
        "device": str(dev),
        "gpu": gpu,
        "torch": torch.__version__,
        "scale": args.llama_scale,
        "params_all_layers": param_count(full),
        "layers_all": full.n_layers,
        "published_point": args.llama_published_point,
        "activation_checkpointing": True,
        "logit_chunk_tokens": logit_chunk_rows(full),
        "precision": (
            "fsdp2 bf16 params, fp32 reduce; fp32 master, fused AdamW"
            if dev.type == "cuda"
            else "fsdp2 fp32 (gloo); fused AdamW"
        ),
        "batch": args.llama_batch,
        "seq": args.llama_seq,
        "prompt_len": args.llama_prompt,
        "tokens_per_step": tokens,
        # the estimate of all layers, published point on and off (see memory_estimate)
        "all_layers_est_bytes": {
            pp: memory_estimate(full, full.n_layers, tokens, pp == "on")["total"] for pp in ("on", "off")
        },
        "fits_all_layers_est": None,  # CUDA: whether each fits HEADROOM of the free memory
        "oom_at_layers": [],
    }
    world_one(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        out.update(device_free_bytes=free, device_total_bytes=total)
        out["fits_all_layers_est"] = {k: v <= HEADROOM * free for k, v in out["all_layers_est_bytes"].items()}
    if args.llama_layers:
        plan, out["layers_from"] = [min(args.llama_layers, full.n_layers)], "--llama-layers"
    elif dev.type == "cuda":
        n = fit_layers(full, out["device_free_bytes"], tokens, args.llama_published_point)
        if n == 0:
            raise RuntimeError("not even one layer fits the free device memory by the estimate")
        plan = list(dict.fromkeys([n, max(1, n * 3 // 4), max(1, n * 9 // 16)]))
        out["layers_from"] = "estimate"
    else:
        plan, out["layers_from"] = [full.n_layers], "all (CPU)"
    res = None
    for layers in plan:
        cfg = llama8b_config(layers) if args.llama_scale == "8b" else tiny_config(layers)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            res = attempt(args, cfg, dev)
            break
        except torch.cuda.OutOfMemoryError as e:  # the estimate was short: fewer layers (a fresh start)
            out["oom_at_layers"].append(layers)
            out.setdefault("oom_errors", []).append(str(e).splitlines()[0][:300])
        gc.collect()
        torch.cuda.empty_cache()
    if res is None:
        raise RuntimeError(f"out of memory at every layer count tried: {out['oom_at_layers']}")
    warm = res["steps"][1:] or res["steps"]
    step_s = sum(s["step_s"] for s in warm) / len(warm)
    flops = step_model_flops(cfg, args.llama_seq, args.llama_batch, args.llama_prompt)
    achieved = flops / step_s / 1e12
    peak, peak_from = peak_tflops(gpu, args.peak_tflops)
    out.update(
        config=cfg.to_dict(),
        layers=cfg.n_layers,
        params=res["params"],
        params_from_config=param_count(cfg),
        memory_estimate=memory_estimate(cfg, cfg.n_layers, tokens, args.llama_published_point),
        steps=res["steps"],
        step_s_mean=step_s,
        tokens_per_s=tokens / step_s,
        model_flops_per_token=model_flops_per_token(cfg, args.llama_seq),
        step_model_flops=flops,
        achieved_tflops=achieved,
        peak_tflops=peak,
        peak_tflops_from=peak_from,
        mfu=achieved / peak if peak else None,
        est_tokens_per_s_all_layers=tokens
        / step_s
        * model_flops_per_token(cfg, args.llama_seq)
        / model_flops_per_token(full, args.llama_seq),
    )
    if dev.type == "cuda":
        out.update(
            peak_allocated_bytes=torch.cuda.max_memory_allocated(dev),
            peak_reserved_bytes=torch.cuda.max_memory_reserved(dev),
            peak_mem_gib=torch.cuda.max_memory_allocated(dev) / 2**30,
        )
    else:
        out.update(peak_allocated_bytes=None, peak_reserved_bytes=None, peak_mem_gib=None)
    out["ok"] = not any("skipped" in s for s in out["steps"])
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--llama-scale", choices=("8b", "tiny"), default=None, help="default: 8b, tiny on --dry-run"
    )
    ap.add_argument("--llama-layers", type=int, default=0, help="layers to run (0: the most that fit)")
    ap.add_argument("--llama-steps", type=int, default=None, help="steps (the first is not timed)")
    ap.add_argument("--llama-batch", type=int, default=None, help="sequences per step")
    ap.add_argument("--llama-seq", type=int, default=None, help="tokens per sequence")
    ap.add_argument("--llama-prompt", type=int, default=None, help="prompt tokens of each sequence")
    ap.add_argument(
        "--llama-published-point",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="forward/backward at the bf16 published point (the trainer's default; +4 bytes a parameter)",
    )
    ap.add_argument("--peak-tflops", type=float, default=None, help="the chip's dense bf16 peak, TFLOP/s")


def main(argv=None) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print only the JSON result line")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny Llama-layout model, same code path")
    ap.add_argument("--out", default=None, help="write the JSON here as well")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    add_args(ap)
    args = ap.parse_args(argv)
    small = args.dry_run or args.llama_scale == "tiny"
    sizes = {"llama_steps": 2, "llama_batch": 2, "llama_seq": 32, "llama_prompt": 4}
    if not small:
        sizes = {"llama_steps": 4, "llama_batch": 4, "llama_seq": 2048, "llama_prompt": 128}
    for k, v in sizes.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.llama_scale is None:
        args.llama_scale = "tiny" if args.dry_run else "8b"
    res = run_reported("gpu_llama8b", args, run)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
