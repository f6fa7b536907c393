"""Delta codec on RL-realistic updates: `python -m bench.delta --json`.

Weights: a transformer-shaped parameter dict of our own (default ~69 M params: weights
N(0, 0.02), output projections scaled by 1/sqrt(2*layers) as in GPT-2, norms 1 + N(0, 0.02)),
or with `--weights PATH` the floating-point tensors of a safetensors file or of every
*.safetensors file in a folder (e.g. a Hugging Face checkpoint). They are held as fp32 master
weights and stepped with torch.optim.AdamW (betas 0.9/0.999, wd 0.01). Gradients are random
normal per step (Adam normalises per element, so what matters for bit flips is the update size
~lr, not the gradient scale). After warm-up steps, one step is measured per lr: the bf16 cast
before vs after the step is the delta a trainer publishes.

With `--states DIR` nothing is stepped here: DIR holds real before/after states as
`bench.realmodel --out DIR` saves them (base.safetensors and one lr<lr>.safetensors per lr, the
state after that run's RL steps from the base), and each lr's row is the delta base -> that
state (the cumulative change of the run's steps, what a worker that missed them fetches).

Reports per lr, for the codec (format 3, positions coded in the context of the base) and for
format 2's coding of the same update (`encode_delta`'s default, context=False: the same chunk
records a format-2 build wrote; format 3 here is `context=True`): changed_frac, bits_per_changed,
ratio (encoded / full bf16 bytes); for format 3 also position_bits_per_changed (everything but the
value streams) next to two bounds, the i.i.d. position entropy H(p)/p and the entropy of the change
mask conditioned on each element's base exponent (per tensor), position_entropy_cond_bits;
encode_gb_s and apply_gb_s (and per CPU-second) of format 3, and the same for format 2 under
`format2` (GB of bf16 weights per second, median of --reps, both in this process; the codec's
default threads, ASYNCRL_DELTA_THREADS overrides); and the ratio of baselines computed on the same
update, with our margin over the fair one (uint16 gaps + int16 raw-bit difference + zstd);
format3_kernels: "numba" or "numpy" (format 3's rank/select; numba's compile is warmed first).
Last line: one JSON object {"runs": [...], "baselines": {...}, "weights": ...}.
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

from delta_codec import Delta, apply_delta, context_jit, encode_delta, sparse_jit
from delta_codec.bits import exponent_shift, int_view
from delta_codec.modes import NONE
from delta_codec.record import chunks_of
from delta_codec.tasks import default_threads


def transformer_params(
    d_model: int, layers: int, vocab: int, ff_mult: int, seed: int
) -> dict[str, torch.Tensor]:
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


def load_weights(path: str) -> dict[str, torch.Tensor]:
    """Floating-point tensors of a safetensors file, or of every *.safetensors file in a folder,
    as fp32 (the master weights of the bench's AdamW step)."""
    from pathlib import Path

    from safetensors.torch import load_file

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files:
        raise SystemExit(f"no *.safetensors under {path}")
    out = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            if v.dtype.is_floating_point:
                out[k] = v.float()
    return out


def load_states(folder: str) -> tuple[dict[str, torch.Tensor], list[tuple[float, dict[str, torch.Tensor]]]]:
    """-> (base state, [(lr, state after that lr's run)] by lr) from a `bench.realmodel --out`
    folder: base.safetensors and lr<lr>.safetensors."""
    from pathlib import Path

    from safetensors.torch import load_file

    p = Path(folder)
    if not (p / "base.safetensors").is_file():
        raise SystemExit(
            f"{folder}: no base.safetensors (save states with `python -m bench.realmodel --out DIR`)"
        )
    base = load_file(str(p / "base.safetensors"))
    runs = []
    for f in p.glob("lr*.safetensors"):
        try:
            lr = float(f.name[2 : -len(".safetensors")])
        except ValueError:
            continue
        after = load_file(str(f))
        if after.keys() != base.keys() or any(
            after[k].dtype != base[k].dtype or after[k].shape != base[k].shape for k in base
        ):
            raise SystemExit(f"{f}: tensor names, dtypes or shapes differ from base.safetensors")
        runs.append((lr, after))
    if not runs:
        raise SystemExit(f"{folder}: no lr<lr>.safetensors next to base.safetensors")
    return base, sorted(runs, key=lambda r: r[0])


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
    """uint16_gap_int16_diff_zstd is the fair competitor: the same gap stream, but each changed
    element's int16 raw-bit difference (what our codec codes) instead of its new bf16 value."""
    full = sum(t.numel() * 2 for t in after.values())
    cz = zstandard.ZstdCompressor(level=3, threads=-1)
    zstd_full = idx_val = gap_zstd = gap_diff_zstd = 0
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
        at = np.minimum(pos[reps] - (fill[reps] - (np.arange(reps.size) - first[reps])) * 65535, n.size - 1)
        vals = n[at]
        gap_zstd += len(cz.compress(g16.tobytes() + vals.astype(np.uint16).tobytes()))
        diff = (n[at].view(np.int16) - b[at].view(np.int16)).astype(np.int16)  # wrapping; 0 at fillers
        gap_diff_zstd += len(cz.compress(g16.tobytes() + diff.tobytes()))
    return {
        "full_bf16": 1.0,
        "zstd_full_bf16": zstd_full / full,
        "int32_index_bf16_value": idx_val / full,
        "uint16_gap_bf16_value_zstd": gap_zstd / full,
        "uint16_gap_int16_diff_zstd": gap_diff_zstd / full,
    }


def _entropy(c: np.ndarray, n: np.ndarray) -> float:
    """sum of n * H(c / n) over the cells, in bits."""
    ok = (c > 0) & (c < n)
    p = c[ok] / n[ok]
    return float(-(n[ok] * (p * np.log2(p) + (1 - p) * np.log2(1 - p))).sum())


def conditional_position_entropy(before, after) -> float:
    """Bits to code which elements changed, knowing each element's base exponent, per tensor
    (the entropy of the change mask conditioned on the exponent): the bound format 3 aims at.
    Float tensors of any width (the exponent of |bits|); other dtypes by the i.i.d. entropy."""
    total = 0.0
    for k in after:
        bt, nt = before[k].reshape(-1), after[k].reshape(-1)
        w = bt.element_size()
        b = int_view(bt).numpy().view(f"u{w}")
        ch = b != int_view(nt).numpy().view(f"u{w}")
        shift = exponent_shift(bt.dtype)
        if shift is None:
            total += _entropy(np.array([ch.sum()]), np.array([float(ch.size)]))
            continue
        e = ((b & b.dtype.type((1 << (8 * w - 1)) - 1)) >> b.dtype.type(shift)).astype(np.int64)
        total += _entropy(np.bincount(e, weights=ch), np.bincount(e).astype(float))
    return total


def value_bytes(d: Delta) -> int:
    """Bytes of a delta's value streams (all of a chunk record's field 4)."""

    def size(f) -> int:
        return sum(size(x) for x in f) if isinstance(f, list) else len(f)

    return sum(size(c[4]) for r in d.records for c in chunks_of(r) if int(c[0]) != NONE)


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
    return measure(before, after, lr, args)


def measure(before, after, lr: float, args) -> dict:
    """One row: format 3 and format 2 on the update before -> after (same names and dtypes)."""
    full = sum(t.numel() * t.element_size() for t in after.values())
    d = encode_delta(before, after, from_version=0, to_version=1, context=True)
    blob = d.to_bytes()
    st = d.stats
    # exactness check on the measured pair: the bench reports nothing for a lossy codec
    state = {k: v.clone() for k, v in before.items()}
    apply_delta(state, Delta.from_bytes(blob))
    assert all(torch.equal(int_view(state[k]), int_view(after[k])) for k in after)
    blob2 = encode_delta(before, after).to_bytes()
    fresh_state = lambda: {k: v.clone() for k, v in before.items()}  # noqa: E731
    enc_s, enc_cpu = median_time(lambda _: encode_delta(before, after, context=True).to_bytes(), args.reps)
    app_s, app_cpu = median_time(
        lambda s: apply_delta(s, Delta.from_bytes(blob)), args.reps, setup=fresh_state
    )
    # format 2's coding of the same update, timed in the same process (the default encode)
    enc2_s, enc2_cpu = median_time(lambda _: encode_delta(before, after).to_bytes(), args.reps)
    app2_s, app2_cpu = median_time(
        lambda s: apply_delta(s, Delta.from_bytes(blob2)), args.reps, setup=fresh_state
    )
    p = st.changed / st.total
    m = max(st.changed, 1)
    entropy_pos = (-(p * math.log2(p) + (1 - p) * math.log2(1 - p)) / p) if 0 < p < 1 else 0.0
    cond = conditional_position_entropy(before, after) / m
    pos_bits = 8 * (len(blob) - value_bytes(Delta.from_bytes(blob))) / m
    base = baselines(before, after) if all(t.element_size() == 2 for t in after.values()) else {}
    return {
        "lr": lr,
        "params": st.total,
        "full_bytes": full,
        "changed": st.changed,
        "changed_frac": p,
        "encoded_bytes": len(blob),
        "bits_per_changed": 8 * len(blob) / m,
        "position_entropy_bits": entropy_pos,
        "position_entropy_cond_bits": cond,
        "position_bits_per_changed": pos_bits,
        "position_bits_over_cond_bound": pos_bits - cond,
        "ratio": len(blob) / full,
        "format2": {
            "encoded_bytes": len(blob2),
            "bits_per_changed": 8 * len(blob2) / m,
            "ratio": len(blob2) / full,
            "encode_gb_s": full / enc2_s / 1e9,
            "apply_gb_s": full / app2_s / 1e9,
            "encode_gb_cpu_s": full / enc2_cpu / 1e9,
            "apply_gb_cpu_s": full / app2_cpu / 1e9,
        },
        "margin_over_fair_baseline": (base["uint16_gap_int16_diff_zstd"] / (len(blob) / full))
        if base
        else None,
        "encode_gb_s": full / enc_s / 1e9,
        "apply_gb_s": full / app_s / 1e9,
        # per CPU-second: what one core does, robust to other load on a shared machine
        "encode_gb_cpu_s": full / enc_cpu / 1e9,
        "apply_gb_cpu_s": full / app_cpu / 1e9,
        "format3_kernels": "numba" if context_jit.enabled else "numpy",
        "load_avg_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "threads": default_threads(),
        "baselines": base,
    }


def main(argv=None) -> None:
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
    ap.add_argument("--weights", help="safetensors file or folder of them (real weights; default: synthetic)")
    ap.add_argument(
        "--states",
        help="folder of real before/after states from `bench.realmodel --out` (no AdamW "
        "step here; --lrs, --weights and the model sizes are ignored)",
    )
    args = ap.parse_args(argv)
    context_jit.warm()  # compile (or load the cached kernels) before anything is timed
    sparse_jit.warm()
    if args.states:
        base, pairs = load_states(args.states)
        rows = ((lr, lambda after=after, lr=lr: measure(base, after, lr, args)) for lr, after in pairs)
    else:
        init = (
            load_weights(args.weights)
            if args.weights
            else transformer_params(args.d_model, args.layers, args.vocab, args.ff_mult, args.seed)
        )
        rows = ((lr, lambda lr=lr: run_lr(init, lr, args)) for lr in args.lrs)
    runs = []
    for lr, row in rows:
        r = row()
        runs.append(r)
        if not args.json:
            b = r["baselines"]
            print(
                f"lr={lr:g} params={r['params'] / 1e6:.1f}M changed={r['changed_frac']:.3%} "
                f"bits/changed={r['bits_per_changed']:.2f} "
                f"(format 2: {r['format2']['bits_per_changed']:.2f}; "
                f"positions {r['position_bits_per_changed']:.2f}, conditional bound "
                f"{r['position_entropy_cond_bits']:.2f}, i.i.d. {r['position_entropy_bits']:.2f}) "
                + (f"margin over fair baseline {r['margin_over_fair_baseline']:.2f}x " if b else "")
                + f"ratio={r['ratio']:.4%} encode={r['encode_gb_s']:.2f} GB/s "
                f"({r['encode_gb_cpu_s']:.2f}/cpu-s) "
                f"apply={r['apply_gb_s']:.2f} GB/s ({r['apply_gb_cpu_s']:.2f}/cpu-s) threads={r['threads']} "
                f"load={r['load_avg_1m']:.1f} | " + " ".join(f"{k}={v:.4%}" for k, v in b.items()),
                flush=True,
            )
    print(
        json.dumps(
            {
                "runs": runs,
                "baselines": {str(r["lr"]): r["baselines"] for r in runs},
                "weights": args.states or args.weights or "synthetic",
                "source": "states" if args.states else "adamw_step",
            }
        )
    )


if __name__ == "__main__":
    main()
