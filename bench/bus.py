"""Bus benchmark: publish/consume throughput, blob bandwidth, loss across a server restart.

    python -m bench.bus --json            # last stdout line: one JSON object

publish_per_s   1 KiB Task events, pipelined publish_many (each acked by JetStream)     median
consume_per_s   fetch + decode + no-op handler + ack through ConsumerLoop                median
blob_mb_per_s   200 MB put then get (bit-exact checked): 2*size / (t_put + t_get)        median
loss            messages lost when the server is killed and restarted mid-stream (must be 0)

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
from bus import BusConfig, ConsumerLoop, TopologyConfig, connect
from bus import topology as topo
from bus.events import Task
from kernel import setup_logging


def tasks(n: int, tag: str, size: int = 1024) -> list[tuple[str, Task]]:
    pad = "x" * max(0, size - 150)  # ~1 KiB encoded with the other fields
    return [
        (topo.task_subject("bench"), Task(task_id=f"{tag}-{i}", env="bench", prompt=pad, created_at=0.0))
        for i in range(n)
    ]


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
        "cpus": os.cpu_count(),
    }
    res["targets_met"] = {
        "publish_per_s>=5000": res["publish_per_s"] >= 5000,
        "consume_per_s>=5000": res["consume_per_s"] >= 5000,
        "blob_mb_per_s>=100": res["blob_mb_per_s"] >= 100,
        "loss==0": res["loss"] == 0,
    }
    return res


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
    ap.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    a = ap.parse_args(argv)
    setup_logging("bench", level="warning")
    res = asyncio.run(main_async(a))
    if not a.json:
        for k, v in res.items():
            print(f"{k:>22}: {v}")
    print(json.dumps(res))
    return 0 if res["loss"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
