"""Delta codec on RL-realistic updates: `python -m bench.delta --json`.

A transformer-shaped parameter dict of our own (default ~69 M params: weights N(0, 0.02),
output projections scaled by 1/sqrt(2*layers) as in GPT-2, norms 1 + N(0, 0.02)) is held as fp32
master weights and stepped with torch.optim.AdamW (betas 0.9/0.999, wd 0.01). Gradients are
random normal per step (Adam normalises per element, so what matters for bit flips is the update
size ~lr, not the gradient scale). After warm-up steps, one step is measured per lr: the bf16
cast before vs after the step is the delta a trainer publishes.

Reports per lr: changed_frac, bits_per_changed, ratio (encoded / full bf16 bytes), encode_gb_s
and apply_gb_s (GB of bf16 weights per second, median of --reps; the codec's default threads,
ASYNCRL_DELTA_THREADS overrides), and the ratio of baselines computed on the same update. Last line: one JSON object {"runs": [...], "baselines": {...}}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import numpy as np
import torch
import zstandard

from delta_codec import Delta, apply_delta, encode_delta
from delta_codec.tasks import default_threads


def transformer_params(d_model: int, layers: int, vocab: int, ff_mult: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std
    ff, out_std = ff_mult * d_model, 0.02 / math.sqrt(2 * layers)
    p = {"tok_emb": normal(vocab, d_model)}
    for i in range(layers):
        p[f"h{i}.ln1"] = 1 + normal(d_model)
        p[f"h{i}.attn.qkv"] = normal(3 * d_model, d_model)
        p[f"h{i}.attn.out"] = normal(d_model, d_model, std=out_std)
        p[f"h{i}.ln2"] = 1 + normal(d_model)
        p[f"h{i}.mlp.gate"] = normal(ff, d_model)
        p[f"h{i}.mlp.up"] = normal(ff, d_model)
        p[f"h{i}.mlp.down"] = normal(d_model, ff, std=out_std)
    p["ln_f"] = 1 + normal(d_model)
    return p


def bf16(params) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16) for k, v in params.items()}


def rl_update(init: dict[str, torch.Tensor], lr: float, warmup: int, seed: int):
    """-> (bf16 before, bf16 after) of one AdamW step following `warmup` steps."""
    master = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt = torch.optim.AdamW(master.values(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    before = None
    for step in range(warmup + 1):
        if step == warmup:
            before = bf16(master)
        for p in master.values():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return before, bf16(master)


def bits_u16(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.int16).numpy().view(np.uint16)


def baselines(before, after) -> dict[str, float]:
    full = sum(t.numel() * 2 for t in after.values())
    cz = zstandard.ZstdCompressor(level=3, threads=-1)
    zstd_full = idx_val = gap_zstd = 0
    for k in after:
        b, n = bits_u16(before[k]), bits_u16(after[k])
        zstd_full += len(cz.compress(n.tobytes()))
        pos = np.flatnonzero(b != n)
        idx_val += pos.size * (4 + 2)
        # uint16 gaps; a gap >= 65535 is split with filler entries that rewrite an unchanged value
        gaps = np.diff(pos, prepend=0)
        fill = gaps // 65535
        reps = np.repeat(np.arange(pos.size), fill + 1)
        first = np.r_[0, np.cumsum(fill + 1)[:-1]]
        g16 = np.full(reps.size, 65535, np.uint16)
        g16[first + fill] = (gaps % 65535).astype(np.uint16)
        vals = n[np.minimum(pos[reps] - (fill[reps] - (np.arange(reps.size) - first[reps])) * 65535, n.size - 1)]
        gap_zstd += len(cz.compress(g16.tobytes() + vals.astype(np.uint16).tobytes()))
    return {"full_bf16": 1.0, "zstd_full_bf16": zstd_full / full, "int32_index_bf16_value": idx_val / full,
            "uint16_gap_bf16_value_zstd": gap_zstd / full}


def median_time(fn, reps: int, setup=None) -> tuple[float, float]:
    """-> (median wall seconds, median process CPU seconds, all threads summed)."""
    wall, cpu = [], []
    for _ in range(reps):
        arg = setup() if setup else None
        t0, c0 = time.perf_counter(), time.process_time()
        fn(arg)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def run_lr(init, lr: float, args) -> dict:
    before, after = rl_update(init, lr, args.warmup, args.seed)
    full = sum(t.numel() * 2 for t in after.values())
    d = encode_delta(before, after, from_version=args.warmup, to_version=args.warmup + 1)
    blob = d.to_bytes()
    st = d.stats
    # exactness check on the measured pair: the bench reports nothing for a lossy codec
    state = {k: v.clone() for k, v in before.items()}
    apply_delta(state, Delta.from_bytes(blob))
    assert all(torch.equal(state[k].view(torch.int16), after[k].view(torch.int16)) for k in after)
    enc_s, enc_cpu = median_time(lambda _: encode_delta(before, after).to_bytes(), args.reps)
    app_s, app_cpu = median_time(lambda s: apply_delta(s, Delta.from_bytes(blob)), args.reps,
                                 setup=lambda: {k: v.clone() for k, v in before.items()})
    p = st.changed / st.total
    entropy_pos = (-(p * math.log2(p) + (1 - p) * math.log2(1 - p)) / p) if 0 < p < 1 else 0.0
    return {"lr": lr, "params": st.total, "full_bytes": full, "changed": st.changed, "changed_frac": p,
            "encoded_bytes": len(blob), "bits_per_changed": 8 * len(blob) / max(st.changed, 1),
            "position_entropy_bits": entropy_pos, "ratio": len(blob) / full,
            "encode_gb_s": full / enc_s / 1e9, "apply_gb_s": full / app_s / 1e9,
            # per CPU-second: what one core does, robust to other load on a shared machine
            "encode_gb_cpu_s": full / enc_cpu / 1e9, "apply_gb_cpu_s": full / app_cpu / 1e9,
            "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count(), "threads": default_threads(),
            "baselines": baselines(before, after)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print only the JSON result line")
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--ff-mult", type=int, default=4)
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-7, 1e-6, 3e-6, 1e-5])
    ap.add_argument("--warmup", type=int, default=3, help="AdamW steps before the measured one")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    init = transformer_params(args.d_model, args.layers, args.vocab, args.ff_mult, args.seed)
    runs = []
    for lr in args.lrs:
        r = run_lr(init, lr, args)
        runs.append(r)
        if not args.json:
            b = r["baselines"]
            print(f"lr={lr:g} params={r['params'] / 1e6:.1f}M changed={r['changed_frac']:.3%} "
                  f"bits/changed={r['bits_per_changed']:.2f} (position entropy {r['position_entropy_bits']:.2f}) "
                  f"ratio={r['ratio']:.4%} encode={r['encode_gb_s']:.2f} GB/s ({r['encode_gb_cpu_s']:.2f}/cpu-s) "
                  f"apply={r['apply_gb_s']:.2f} GB/s ({r['apply_gb_cpu_s']:.2f}/cpu-s) threads={r['threads']} "
                  f"load={r['load_avg_1m']:.1f} | "
                  + " ".join(f"{k}={v:.4%}" for k, v in b.items()), flush=True)
    print(json.dumps({"runs": runs, "baselines": {str(r["lr"]): r["baselines"] for r in runs}}))


if __name__ == "__main__":
    main()
