"""Mismatch replay benchmark.

An MLA engine samples >= 4,096 tokens (top-p 0.9, temperature 1.0, fp8 on the RoPE part of q/k)
with its KV cache from the published bf16 state; a trainer model loaded from the same state
recomputes the logprobs teacher-forced four ways: no replay, mask replay only, quant replay
only, both. Reports per-token importance-ratio statistics for each.

    python -m bench.mismatch --json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from policy import (
    ModelConfig,
    QuantConfig,
    SamplingConfig,
    Transformer,
    generate,
    inference_state,
    mismatch_metrics,
    sequence_logprobs,
)

FP8_ROPE = QuantConfig(sites=("mla_rope_qk",))
WAYS = {"none": (False, False), "mask": (True, False), "quant": (False, True), "both": (True, True)}


def peaked(model: Transformer, logit_scale: float) -> Transformer:
    """A random init has near-uniform next-token distributions, unlike a trained LM; scaling the
    output head gives LM-like entropies (reported) so top-p truncation keeps a realistic nucleus."""
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


def trainer_logprobs(model, prompts, completions, sampling, masks, replay_mask, chunk):
    out = []
    with torch.no_grad():
        for i in range(0, len(prompts), chunk):
            s = slice(i, i + chunk)
            r = sequence_logprobs(
                model,
                prompts[s],
                completions[s],
                [sampling] * len(prompts[s]),
                masks[s],
                replay_mask=replay_mask,
            )
            out.append((r.logprobs, r.entropy, r.valid))
    return [torch.cat(t) for t in zip(*out)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", help="tiny | small | base50m | base100m (attn=mla)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--logit-scale", type=float, default=40.0)
    ap.add_argument("--chunk", type=int, default=16, help="sequences per trainer forward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (shared boxes: 1)")
    ap.add_argument("--json", action="store_true", help="print only the JSON result line")
    a = ap.parse_args(argv)
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    torch.manual_seed(a.seed)
    cfg = ModelConfig.preset(a.preset, vocab_size=a.vocab, attn="mla", max_seq_len=a.prompt_len + a.tokens)
    state = inference_state(peaked(Transformer(cfg), a.logit_scale))  # what the trainer publishes
    engine = Transformer(cfg, quant=FP8_ROPE).to(a.device).eval()
    engine.load_inference_state(state)
    trainer = Transformer(cfg).to(a.device).eval()
    trainer.load_inference_state(state)  # identical weights

    sampling = SamplingConfig(a.temperature, a.top_p, 0)
    g = torch.Generator(device=a.device).manual_seed(a.seed)
    per_seq = math.ceil(a.tokens / a.batch)
    prompts = torch.randint(
        3, a.vocab, (a.batch, a.prompt_len), generator=torch.Generator().manual_seed(a.seed)
    ).tolist()
    t_gen = time.perf_counter()
    outs = generate(engine, prompts, sampling, per_seq, stop_ids=(), generator=g)
    t_gen = time.perf_counter() - t_gen
    completions, masks = [o.ids for o in outs], [o.mask for o in outs]
    behaviour = torch.tensor([o.logprobs for o in outs], device=a.device)

    results, t_rep = {}, time.perf_counter()
    for name, (replay_mask, replay_quant) in WAYS.items():
        trainer.quant = FP8_ROPE if replay_quant else QuantConfig()
        lp, ent, valid = trainer_logprobs(
            trainer, prompts, completions, sampling, masks, replay_mask, a.chunk
        )
        m = mismatch_metrics(behaviour.cpu(), lp.cpu(), valid.cpu(), C=2.0)
        results[name] = {
            "k3_mean": m["k3_mean"],
            "ratio_mean": m["ratio_mean"],
            "ratio_p99_abs_log": m["ratio_p99_abs_log"],
            "frac_outside_2": m["frac_outside_C"],
        }
        if name == "none":
            full_entropy = float(ent[valid].mean())
    t_rep = time.perf_counter() - t_rep
    both, none = results["both"]["k3_mean"], results["none"]["k3_mean"]
    reduction = none / both if both > 0 else None  # None: replay was bit-exact (k3 == 0)
    out = {
        "bench": "mismatch",
        "preset": a.preset,
        "attn": "mla",
        "params_m": round(engine.num_params() / 1e6, 2),
        "vocab": a.vocab,
        "device": a.device,
        "tokens": int(behaviour.numel()),
        "sequences": a.batch,
        "top_p": a.top_p,
        "temperature": a.temperature,
        "quant": FP8_ROPE.to_wire(),
        "mean_entropy_nats": round(full_entropy, 3),
        "mean_kept": float(sum((m.counts.clip(min=0)).sum() for m in masks) / behaviour.numel()),
        "results": results,
        "k3_reduction_none_over_both": reduction,
        "targets_met": bool(both <= 1e-6 and (reduction is None or reduction >= 100)),
        "generate_s": round(t_gen, 2),
        "replay_s": round(t_rep, 2),
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    if not a.json:
        print(f"{'replay':>6} {'k3_mean':>11} {'ratio_mean':>11} {'p99|log r|':>11} {'frac_out_2':>11}")
        for k, v in results.items():
            print(
                f"{k:>6} {v['k3_mean']:11.3e} {v['ratio_mean']:11.6f} {v['ratio_p99_abs_log']:11.3e} "
                f"{v['frac_outside_2']:11.3e}"
            )
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
