"""What one weight update costs inside the vLLM engine, phase by phase, on the real model.

    python -m bench.vllm_apply --json [--updates 6] [--frac 0.1]   # the vllm venv; needs `make models`

One `VLLMEngine` serving SmolLM2-135M (the folder `asyncrl model prepare smollm2` writes), idle;
`updates` deltas applied one after another, each changing `frac` of every tensor's elements by
~1 % (every module is touched, as by a real step at this model's learning rates). Per update:

apply_ms        pause -> push done, as the engine records it (vLLM paused for this long)
wall_ms         the whole `apply_delta` call (+ the container, the RPC, resume)
decode_ms ...   inside vLLM's worker (`asyncrl_last_update`): the container decoded and applied
                to the bf16 copy (decode_ms), the touched modules reloaded (init_ms, load_ms: the
                kernels' re-packing is here, finalize_ms), modules
The summary gives medians over the updates after the first (the first pays one-time costs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time


async def run(a) -> dict:
    import delta_codec
    import policy
    from asyncrl import model as models
    from rollout_worker.sections import EngineSection
    from rollout_worker.vllm_engine import VLLMEngine

    from .vllm_stall import changed

    if not models.is_prepared("smollm2"):
        raise SystemExit(f"smollm2 is not prepared under {models.cache_dir()} (make models)")
    folder = models.model_dir("smollm2")
    cfg, model = policy.load_hf_checkpoint(folder)
    eng = VLLMEngine(
        EngineSection(kind="vllm", model=str(folder), slots=2, max_len=128, seed=0),
        model_config=cfg.to_dict(),
        eos_id=None,
        enforce_eager=True,
    )
    await eng.load_keyframe(policy.inference_state(model), version=0, epoch=1)
    rows = []
    try:
        for i in range(a.updates):
            old = {k: t.clone() for k, t in eng.state.items()}
            d = delta_codec.encode_delta(
                old, changed(old, a.frac, seed=i + 1), from_version=eng.version, to_version=eng.version + 1
            )
            t0 = time.perf_counter()
            await eng.apply_delta(d, epoch=1)
            wall = (time.perf_counter() - t0) * 1e3
            inside = (await eng.llm.collective_rpc("asyncrl_last_update"))[0]
            rows.append(
                {
                    "update": i,
                    "bytes": len(d.to_bytes()),
                    "wall_ms": wall,
                    "apply_ms": eng.metrics.apply_ms[-1],
                }
                | inside
            )
    finally:
        await eng.close()
    later = rows[1:] or rows
    keys = ("apply_ms", "wall_ms", "decode_ms", "init_ms", "load_ms", "finalize_ms", "reload_ms")
    med = {f"{k}_p50": statistics.median(r[k] for r in later) for k in keys if k in later[0]}
    return {
        "updates": rows,
        "first_apply_ms": rows[0]["apply_ms"],
        **med,
        "modules": later[0].get("modules"),
        "frac": a.frac,
        "load_avg": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bench.vllm_apply", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--updates", type=int, default=6)
    ap.add_argument("--frac", type=float, default=0.1, help="fraction of every tensor's elements changed")
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    a = ap.parse_args(argv)
    if a.updates < 1 or not 0 < a.frac <= 1:
        ap.error("needs --updates >= 1 and 0 < --frac <= 1")
    res = asyncio.run(run(a))
    if not a.json:
        for r in res["updates"]:
            print({k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()})
    print(json.dumps(res))
    return 0


if __name__ == "__main__":  # vLLM's engine core is a spawned process: the guard keeps it from re-running this
    raise SystemExit(main())
