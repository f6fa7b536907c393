"""Rollout-worker benchmark: continuous generation while a trainer publishes deltas.

    python -m bench.worker --json            # last stdout line: one JSON object

An embedded nats-server, a publisher playing the trainer (WeightPublisher, the real path), and
N full rollout workers (Worker: TASKS consumer -> TorchEngine -> ROLLOUTS, each with its own
connection and WeightFeed) in this one process, fed a steady supply of tasks. Every delta is a
`frac` change of a `model`-sized bf16 state (pre-encoded, so encoding does not compete for CPU).

tokens_per_s                  all workers together, generated tokens / wall second (timed phase)
slot_occupancy                mean over decode steps of busy slots / slots
decode_step_ms_p50            one batched decode step (median over workers' medians)
step_gap_ms_p50/p99           end of one decode step to the next when no update came between (baseline)
update_stall_ms_p50/p99       gap between the two decode steps straddling an update (pooled)
update_apply_ms_p50/p99       time to apply one delta in place (digests, copy into the model)
update_stall_excess_ms_p99    stall minus that update's apply time; target <= 2 x decode p50
publish_to_patched_ms_p50/p99 publish_delta() called -> every worker has applied it
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import numpy as np
import torch

import delta_codec
import policy
from bus import BusConfig, EmbeddedServer, connect, setup_logging
from bus import topology as topo
from bus.events import Task
from bus.weights import WeightPublisher
from rollout_worker.engine import EngineMetrics
from rollout_worker.worker import Worker, WorkerConfig


def perturb(state: dict, frac: float, seed: int) -> dict:
    """`frac` of every tensor's elements moved by a small relative step (an optimizer step stand-in)."""
    g = torch.Generator().manual_seed(seed)
    new = {}
    for k, v in state.items():
        flat = v.clone().reshape(-1)
        idx = (torch.rand(flat.numel(), generator=g) < frac).nonzero()[:, 0]
        x = flat[idx].float()
        flat[idx] = (x + (x.abs() + 1e-3) * 0.05 * torch.randn(idx.numel(), generator=g)).to(v.dtype)
        new[k] = flat.reshape(v.shape)
    return new


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else 0.0


async def feed_tasks(bus, stop: asyncio.Event, low: int, max_tokens: int) -> None:
    """Keep at least `low` tasks waiting on TASKS (a steady supply)."""
    i = 0
    while not stop.is_set():
        info = await bus.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)
        missing = 2 * low - info.num_pending if info.num_pending < low else 0
        if missing > 0:
            batch = [(topo.task_subject("bench"), Task(task_id=f"b{i + j}", env="bench", prompt="12+30=",
                                                       sampling={"max_tokens": max_tokens, "n": 1}))
                     for j in range(missing)]
            i += missing
            await bus.publish_many(batch)
        await asyncio.sleep(0.05)


async def drain_rollouts(bus, stop: asyncio.Event) -> None:
    """Stand-in scorer: consume ROLLOUTS so the work-queue stream stays small."""
    sub = await bus.pull(topo.ROLLOUTS, topo.SCORER_CONSUMER)
    while not stop.is_set():
        for m in await sub.fetch(256, timeout=0.2):
            await m.ack()


async def run(a) -> dict:
    cfg = policy.ModelConfig.preset(a.model, vocab_size=policy.CharTokenizer.default().vocab_size,
                                    max_seq_len=a.max_len)
    torch.manual_seed(0)
    model = policy.Transformer(cfg)
    n_params = model.num_params()
    s0 = prev = policy.inference_state(model)
    del model
    t0 = time.perf_counter()
    deltas = []
    for v in range(1, a.deltas + 1):
        new = perturb(prev, a.frac, seed=v)
        deltas.append(delta_codec.encode_delta(prev, new, from_version=v - 1, to_version=v))
        prev = new
    log(f"model {a.model}: {n_params / 1e6:.1f} M params; {a.deltas} deltas of {a.frac:.1%} encoded in "
        f"{time.perf_counter() - t0:.1f}s, {deltas[0].nbytes / 1e6:.2f} MB each")
    async with EmbeddedServer() as srv:
        pub_bus = await connect(BusConfig(servers=[srv.url], name="bench-trainer"))
        await pub_bus.provision()
        pub = WeightPublisher(pub_bus, epoch=1, trainer_id="bench")
        await pub.publish_keyframe(s0, 0, cfg)
        stop = asyncio.Event()
        side = [asyncio.create_task(feed_tasks(pub_bus, stop, a.workers * a.slots * 2, a.max_tokens)),
                asyncio.create_task(drain_rollouts(pub_bus, stop))]
        workers, runs, buses = [], [], []
        for i in range(a.workers):
            b = await connect(BusConfig(servers=[srv.url], name=f"bench-w{i}"))
            w = Worker(WorkerConfig(bus=b.cfg, worker_id=f"w{i}", slots=a.slots, max_lag=10 ** 6,
                                    max_len=a.max_len, heartbeat_s=3600), b)
            buses.append(b)
            workers.append(w)
            runs.append(asyncio.create_task(w.run(stop, handle_signals=False)))
        while not all(w.engine is not None and w.engine.version == 0 and w.engine.stats()["tokens"] > 0
                      for w in workers):
            await asyncio.sleep(0.05)
        await asyncio.sleep(a.warmup_s)
        for w in workers:                                   # timed phase starts now
            w.engine.metrics = EngineMetrics(a.slots)
        p2p = []
        t_start = time.perf_counter()
        for d in deltas:
            t0 = time.perf_counter()
            await pub.publish_delta(d)
            while not all(w.engine.version >= d.to_version for w in workers):
                await asyncio.sleep(0.001)
            p2p.append((time.perf_counter() - t0) * 1e3)
            await asyncio.sleep(max(0.0, a.interval_s - (time.perf_counter() - t0)))
        await asyncio.sleep(a.tail_s)
        snaps = [w.engine.stats() for w in workers]
        ms = [w.engine.metrics for w in workers]
        wall = time.perf_counter() - t_start
        refused = sum(sum(w.feed.refused.values()) for w in workers)
        stop.set()
        await asyncio.gather(*runs, return_exceptions=True)
        for t in side:
            t.cancel()
        await asyncio.gather(*side, return_exceptions=True)
        for b in [*buses, pub_bus]:
            await b.close()

    stall = [x for m in ms for x in m.stall_ms]
    gaps = [x for m in ms for x in m.gap_ms]
    excess = [x for m in ms for x in m.stall_excess_ms]
    apply_ms = [x for m in ms for x in m.apply_ms]
    decode_p50 = float(np.median([s["decode_step_ms_p50"] for s in snaps]))
    out = {
        "bench": "worker", "model": a.model, "params_m": round(n_params / 1e6, 1), "workers": a.workers,
        "slots": a.slots, "deltas": a.deltas, "delta_frac": a.frac, "delta_mb": round(deltas[0].nbytes / 1e6, 3),
        "tokens_per_s": round(sum(s["tokens"] for s in snaps) / wall, 1),
        "slot_occupancy": round(float(np.mean([s["slot_occupancy"] for s in snaps])), 4),
        "decode_step_ms_p50": round(decode_p50, 2),
        "step_gap_ms_p50": round(pct(gaps, 50), 2), "step_gap_ms_p99": round(pct(gaps, 99), 2),
        "update_stall_ms_p50": round(pct(stall, 50), 2), "update_stall_ms_p99": round(pct(stall, 99), 2),
        "update_apply_ms_p50": round(pct(apply_ms, 50), 2), "update_apply_ms_p99": round(pct(apply_ms, 99), 2),
        "update_stall_excess_ms_p99": round(pct(excess, 99), 2),
        "publish_to_patched_ms_p50": round(pct(p2p, 50), 1), "publish_to_patched_ms_p99": round(pct(p2p, 99), 1),
        "updates_applied": sum(m.updates for m in ms), "updates_refused": refused,
    }
    out["stall_target_met"] = out["update_stall_excess_ms_p99"] <= 2 * decode_p50
    out["publish_target_met"] = out["publish_to_patched_ms_p99"] <= 1000.0
    out["occupancy_target_met"] = out["slot_occupancy"] >= 0.95
    return out


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench.worker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="base50m", help="policy.ModelConfig preset (tiny|small|base50m|base100m)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--deltas", type=int, default=10)
    ap.add_argument("--frac", type=float, default=0.01, help="fraction of elements changed per delta")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--interval-s", type=float, default=1.0, help="time between two deltas")
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--tail-s", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per decode call")
    ap.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    a = ap.parse_args(argv)
    setup_logging("bench", json=True, level="warning")
    torch.set_num_threads(a.threads)
    res = asyncio.run(run(a))
    if not a.json:
        for k, v in res.items():
            print(f"{k:32s} {v}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
