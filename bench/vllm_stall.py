"""Update stall of the vLLM engine: the compressed delta into vLLM's worker vs whole layers.

    python -m bench.vllm_stall --json          # needs the vllm venv; last stdout line: one JSON object

One `VLLMEngine` on a random Qwen2 (or, --arch llama, Llama) checkpoint (transformers), `slots`
requests kept running;
`updates` deltas that each change `frac` of the elements of every tensor (so every layer is
touched), applied while generating. The transport alternates update by update between
"delta" (the compressed container goes into vLLM's worker, which decodes it into its copy and
re-packs the touched layers) and "layers" (the touched layers re-sent whole over vLLM's RPC),
so both see the same load on a shared machine.

start_s                    engine start + first keyframe (includes the codec's warm-up in
                           vLLM's worker process, worker_codec_warm_s)
step_gap_ms_p50            median gap between two tokens of one request (includes the stalls:
                           the median is the decode step without updates)
transport_delta / _layers  per transport:
  first_apply_ms           the transport's first update, pause -> push (anything
  first_stall_ms / _steps  compiled or loaded on first use inside vLLM's worker shows here)
  stall_ms_p50 / p99       later updates: a request's last token before the update -> its first after
  stall_steps_p50 / p99    stall / step_gap_ms_p50 (the stall in decode steps)
  apply_ms_p50             later updates: pause -> push (vLLM paused), as the client sees it
ratio_stall_p50            layers / delta (later updates)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import numpy as np
import torch

from .stats import pct


def make_checkpoint(
    folder, hidden: int, layers: int, vocab: int, arch: str = "qwen2"
) -> dict[str, torch.Tensor]:
    import transformers

    heads = max(2, hidden // 64)
    Config, Model = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[arch]
    cfg = Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.08,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Model(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(state: dict, frac: float, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        hit = torch.rand(t.shape, generator=g) < frac
        out[k] = torch.where(hit, (t.float() * (1 + 0.01 * torch.randn(t.shape, generator=g))).to(t.dtype), t)
    return out


async def run(a) -> dict:
    import delta_codec
    from bus.events import SamplingParams
    from rollout_worker.sections import EngineSection
    from rollout_worker.vllm_engine import VLLMEngine

    tmp = tempfile.TemporaryDirectory(prefix="bench-vllm-")
    state = make_checkpoint(tmp.name, a.hidden, a.layers, a.vocab, a.arch)
    n_params = sum(t.numel() for t in state.values())
    states = [state]
    for i in range(a.updates):
        states.append(changed(states[-1], a.frac, seed=i + 1))
    deltas = [
        delta_codec.encode_delta(states[i], states[i + 1], from_version=i, to_version=i + 1)
        for i in range(a.updates)
    ]
    eng = VLLMEngine(
        EngineSection(kind="vllm", model=tmp.name, slots=a.slots, max_len=a.max_tokens + 16, seed=0),
        enforce_eager=True,
    )
    t0 = time.perf_counter()
    await eng.load_keyframe(state, version=0, epoch=1)
    start_s = time.perf_counter() - t0
    stop = asyncio.Event()

    async def keep_busy(slot: int) -> None:
        k = 0
        while not stop.is_set():
            k += 1
            await eng.generate(
                [5 + slot, 17, 42, 99, 7],
                SamplingParams(temperature=1.0, max_tokens=a.max_tokens),
                seed=slot * 1000 + k,
            )

    runners = [asyncio.create_task(keep_busy(s)) for s in range(a.slots)]
    while eng.stats()["tokens"] < a.warmup_tokens * a.slots:
        await asyncio.sleep(0.05)
    res = {"delta": {"stall": [], "apply": []}, "layers": {"stall": [], "apply": []}}
    for i, d in enumerate(deltas):
        mode = ("delta", "layers")[i % 2]
        eng.delta_transport = mode
        n_up, n_stall = eng.metrics.updates, len(eng.metrics.stall_ms)
        await eng.apply_delta(d, epoch=1)
        while eng.metrics.updates == n_up:  # at the first token after it (at once when none decoded)
            await asyncio.sleep(0.005)
        if len(eng.metrics.stall_ms) > n_stall:  # no request decoding at the update: it stalled nothing
            res[mode]["stall"].append(eng.metrics.stall_ms[-1])
            res[mode]["apply"].append(eng.metrics.apply_ms[-1])
        await asyncio.sleep(a.between_s)
    stop.set()
    gap = pct(list(eng.metrics.step_ms), 50)
    await eng.close()
    for r in runners:
        r.cancel()
    await asyncio.gather(*runners, return_exceptions=True)
    tmp.cleanup()
    out = {
        "arch": a.arch,
        "params": n_params,
        "hidden": a.hidden,
        "n_layers": a.layers,
        "vocab": a.vocab,
        "slots": a.slots,
        "frac": a.frac,
        "delta_bytes_mean": float(np.mean([d.nbytes for d in deltas])),
        "bf16_bytes": 2 * n_params,
        "start_s": round(start_s, 1),
        "worker_codec_warm_s": round(getattr(eng, "worker_warm_s", 0.0), 2),
        "step_gap_ms_p50": round(gap, 2),
    }
    for mode, r in res.items():
        # the first update of each transport apart: a cold path shows there, not in the p99
        stall, apply = r["stall"][1:], r["apply"][1:]
        out[f"transport_{mode}"] = {
            "n": len(stall),
            "first_apply_ms": round(r["apply"][0], 1),
            "first_stall_ms": round(r["stall"][0], 1),
            "first_stall_steps": round(r["stall"][0] / gap, 2),
            "stall_ms_p50": round(pct(stall, 50), 1),
            "stall_ms_p99": round(pct(stall, 99), 1),
            "stall_steps_p50": round(pct(stall, 50) / gap, 2),
            "stall_steps_p99": round(pct(stall, 99) / gap, 2),
            "apply_ms_p50": round(pct(apply, 50), 1),
        }
    out["ratio_stall_p50"] = round(
        out["transport_layers"]["stall_ms_p50"] / out["transport_delta"]["stall_ms_p50"], 2
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="bench.vllm_stall", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=384)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument(
        "--updates",
        type=int,
        default=20,
        help="deltas, alternating delta/layers transport (>= 4: a first and a later one each)",
    )
    ap.add_argument("--frac", type=float, default=0.01, help="fraction of elements each delta changes")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--warmup-tokens", type=int, default=32)
    ap.add_argument("--between-s", type=float, default=0.3, help="generation between two updates")
    ap.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    a = ap.parse_args()
    if a.updates < 4:
        ap.error("--updates must be >= 4 (the first update of each transport is reported apart)")
    res = asyncio.run(run(a))
    if not a.json:
        for k, v in res.items():
            print(f"{k:>20}: {v}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
