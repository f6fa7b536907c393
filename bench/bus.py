"""Bus benchmark: publish/consume throughput, blob bandwidth, loss across a server restart.

    python -m bench.bus --json            # last stdout line: one JSON object

publish_per_s   1 KiB Task events, pipelined publish_many (each acked by JetStream)     median
consume_per_s   fetch + decode + no-op handler + ack through ConsumerLoop                median
blob_mb_per_s   200 MB put then get (bit-exact checked): 2*size / (t_put + t_get)        median
loss            messages lost when the server is killed and restarted mid-stream (must be 0)
rollout_*_us    encode / decode (every number validated) of one Rollout of 20 and of 1,024 completion
                tokens, in process, no server: µs per event                             median

--sync always (the default, what every process and deploy/nats config runs with): JetStream
flushes each write to disk before acknowledging it; --sync default: the server's own policy
(acknowledged at once, flushed every 2 minutes), for the cost of durability.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

from asyncrl.nats_server import EmbeddedServer
from bus import BusConfig, ConsumerLoop, TopologyConfig, connect, events
from bus import topology as topo
from bus.events import Task
from kernel import setup_logging


def tasks(n: int, tag: str, size: int = 1024) -> list[tuple[str, Task]]:
    pad = "x" * max(0, size - 150)  # ~1 KiB encoded with the other fields
    return [
        (topo.task_subject("bench"), Task(task_id=f"{tag}-{i}", env="bench", prompt=pad, created_at=0.0))
        for i in range(n)
    ]


def rollout(n_tokens: int) -> events.Rollout:
    """A single-turn Rollout as a worker publishes it: n completion tokens with logprobs and versions."""
    return events.Rollout(
        rollout_id="t-0-0",
        task_id="t-0",
        env="arith",
        sample_index=0,
        group_size=4,
        prompt="What is 17 + 25?",
        spec={"answer": 42},
        prompt_ids=list(range(100, 130)),
        completion_ids=[(7 * i) % 49152 for i in range(n_tokens)],
        completion_text="x" * (3 * n_tokens),
        logprobs=[-0.125 - (i % 7) / 8 for i in range(n_tokens)],
        token_versions=[3 + i // max(1, n_tokens // 2) for i in range(n_tokens)],
        sampling={"temperature": 0.7, "top_p": 1.0, "top_k": 0, "max_tokens": n_tokens},
        sampling_mask={},
        quant={},
        finish_reason="stop",
        cost_tokens=n_tokens,
        wall_s=0.5,
        worker_id="w0",
    )


def codec_us(n_tokens: int, repeats: int, n: int = 2000) -> tuple[float, float]:
    """(encode µs, decode µs) per Rollout, each the median of `repeats` timed loops of n events."""
    ev = rollout(n_tokens)
    body = events.encode(ev)
    enc, dec = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            events.encode(ev)
        enc.append((time.perf_counter() - t) / n * 1e6)
        t = time.perf_counter()
        for _ in range(n):
            events.decode(body)
        dec.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(enc), statistics.median(dec)


async def drain_with_loop(bus, n: int, concurrency: int = 256) -> float:
    seen = set()

    async def handler(ev, ctx):
        seen.add(ev.task_id)

    loop = ConsumerLoop(
        bus,
        topo.TASKS,
        topo.ROLLOUT_CONSUMER,
        handler,
        Task,
        concurrency=concurrency,
        batch=concurrency,
        fetch_timeout_s=0.5,
        handle_signals=False,
    )
    stop = asyncio.Event()
    t0 = time.perf_counter()
    runner = asyncio.create_task(loop.run(stop))
    while loop.stats.acked < n:
        await asyncio.sleep(0.005)
    dt = time.perf_counter() - t0
    stop.set()
    await runner
    return dt


async def bench_pubsub(url: str, n: int) -> tuple[float, float]:
    bus = await connect(BusConfig(servers=[url], name="bench-pub"))
    try:
        await bus.js.purge_stream(topo.TASKS)
        items = tasks(n, f"p{time.monotonic_ns()}")
        t0 = time.perf_counter()
        acks = await bus.publish_many(items)
        pub = n / (time.perf_counter() - t0)
        assert len({a.seq for a in acks}) == n
        cons = n / await drain_with_loop(bus, n)
        return pub, cons
    finally:
        await bus.close()


async def bench_blob(url: str, mb: int) -> tuple[float, float, float]:
    bus = await connect(BusConfig(servers=[url], name="bench-blob"))
    try:
        data = os.urandom(mb * 1024 * 1024)
        t0 = time.perf_counter()
        await bus.put_blob("bench-blob", data)
        t1 = time.perf_counter()
        got = await bus.get_blob("bench-blob")
        t2 = time.perf_counter()
        if got != data:
            raise SystemExit("blob round trip is not bit-exact")
        await bus.delete_blob("bench-blob")
        size = len(data) / 1e6
        return 2 * size / (t2 - t0), size / (t1 - t0), size / (t2 - t1)
    finally:
        await bus.close()


async def bench_loss(srv: EmbeddedServer, n: int) -> dict:
    """Producer and ConsumerLoop run while the server is SIGKILLed and restarted halfway."""
    bus = await connect(BusConfig(servers=[srv.url], name="bench-loss"))
    try:
        await bus.js.purge_stream(topo.TASKS)
        got: list[str] = []

        async def handler(ev, ctx):
            got.append(ev.task_id)

        loop = ConsumerLoop(
            bus,
            topo.TASKS,
            topo.ROLLOUT_CONSUMER,
            handler,
            Task,
            concurrency=64,
            fetch_timeout_s=0.5,
            handle_signals=False,
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(loop.run(stop))
        items = tasks(n, "loss", size=256)
        for i, (s, ev) in enumerate(items):
            await bus.publish(s, ev)
            if i == n // 2:
                await srv.restart(kill=True)
        deadline = time.monotonic() + 60
        while len(set(got)) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        await runner
        return {"loss": n - len(set(got)), "duplicates_delivered": len(got) - len(set(got))}
    finally:
        await bus.close()


async def main_async(a) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-bus-") as d:
        sync = None if a.sync == "default" else a.sync
        async with EmbeddedServer(store_dir=d, sync=sync) as srv:
            sync_always = bool(srv.jetstream_config().get("sync_always"))
            b = await connect(
                BusConfig(
                    servers=[srv.url],
                    name="bench",
                    topology=TopologyConfig(ack_wait_s=5, max_ack_pending=10000),
                )
            )
            await b.provision()
            await b.close()
            pubs, cons, blobs, puts, gets = [], [], [], [], []
            for _ in range(a.repeats):
                p, c = await bench_pubsub(srv.url, a.n)
                pubs.append(p)
                cons.append(c)
            for _ in range(a.blob_repeats):
                r, p, g = await bench_blob(srv.url, a.blob_mb)
                blobs.append(r)
                puts.append(p)
                gets.append(g)
            loss = await bench_loss(srv, a.loss_n)
    med = statistics.median
    res = {
        "bench": "bus",
        "sync": a.sync,
        "sync_always": sync_always,  # as the running server reports it (/varz)
        "n": a.n,
        "repeats": a.repeats,
        "publish_per_s": round(med(pubs)),
        "consume_per_s": round(med(cons)),
        "blob_mb": a.blob_mb,
        "blob_mb_per_s": round(med(blobs), 1),
        "blob_put_mb_per_s": round(med(puts), 1),
        "blob_get_mb_per_s": round(med(gets), 1),
        **loss,
        "loss_n": a.loss_n,
        **{k: v for k, v in codec_only(a).items() if k.startswith("rollout_")},
        "cpus": os.cpu_count(),
    }
    res["targets_met"] = {
        "publish_per_s>=5000": res["publish_per_s"] >= 5000,
        "consume_per_s>=5000": res["consume_per_s"] >= 5000,
        "blob_mb_per_s>=100": res["blob_mb_per_s"] >= 100,
        "loss==0": res["loss"] == 0,
    }
    return res


def codec_only(a) -> dict:
    enc20, dec20 = codec_us(20, max(3, a.repeats))
    enc1k, dec1k = codec_us(1024, max(3, a.repeats), n=200)
    return {
        "bench": "bus",
        "codec_only": True,
        "rollout_encode_us": round(enc20, 1),
        "rollout_decode_us": round(dec20, 1),
        "rollout_1k_encode_us": round(enc1k, 1),
        "rollout_1k_decode_us": round(dec1k, 1),
        "cpus": os.cpu_count(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bus", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=20000, help="events per publish/consume run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blob-mb", type=int, default=200)
    ap.add_argument("--blob-repeats", type=int, default=2)
    ap.add_argument("--loss-n", type=int, default=2000)
    ap.add_argument(
        "--sync",
        choices=("always", "default"),
        default="always",
        help="JetStream sync_interval: always (flushed before acked) or the server's default (2 min)",
    )
    ap.add_argument(
        "--codec-only", action="store_true", help="only the Rollout encode/decode figures (no server)"
    )
    ap.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    a = ap.parse_args(argv)
    setup_logging("bench", level="warning")
    res = codec_only(a) if a.codec_only else asyncio.run(main_async(a))
    if not a.json:
        for k, v in res.items():
            print(f"{k:>22}: {v}")
    print(json.dumps(res))
    return 0 if res.get("loss", 0) == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
