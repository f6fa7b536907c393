"""One region's workers for bench.wan, as a process of its own: K WeightFollowers (the real
follow + apply on a bf16 state, off the event loop) and optional task workers against the
region's nats-server, each reporting every version it reaches as a JSON line on stdout; and
RegionProc, the bench's handle on that process (start, read its reports, stop by closing stdin).

    python -m bench.wan_region --region r20 --url nats://... --workers 3 --read mirror
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import delta_codec
from bus import BusConfig, connect, events
from bus import topology as topo
from bus.events import Task
from bus.weights.follower import StateTarget, WeightFollower
from bus.weights.regions import weight_source
from kernel import setup_logging

from .wanlab import Lab


class ThreadedTarget(StateTarget):
    """apply_delta off the event loop, so K workers in one process do not queue on it; reports
    every version it reaches (keyframes included) to `report(version)`."""

    def __init__(self, report):
        super().__init__()
        self.report = report

    async def load_keyframe(self, state, version: int, epoch: int) -> None:
        await super().load_keyframe(state, version, epoch)
        self.report(version)

    async def apply_delta(self, delta, epoch: int) -> None:
        await asyncio.to_thread(delta_codec.apply_delta, self.state, delta)
        self.version, self.epoch = delta.to_version, epoch
        self.report(self.version)


async def region_main(a) -> None:
    out = sys.stdout

    def say(**kw):
        out.write(json.dumps(kw) + "\n")
        out.flush()

    stop = asyncio.Event()
    tasks = []
    for i in range(a.workers):
        name = f"{a.region}-w{i}"
        bus = await connect(
            BusConfig(
                servers=[a.url],
                name=name,
                js_domain=topo.HUB_DOMAIN,
                weights_domain=a.region if a.read == "mirror" else None,
                connect_attempts=5,
            )
        )
        feed = WeightFollower(weight_source(bus), name=name, poll_s=0.5)
        target = ThreadedTarget(lambda v, name=name: say(w=name, v=v, t=time.time()))
        tasks.append(asyncio.ensure_future(feed.follow(target, stop)))
        if a.task_hold_s > 0:
            tasks.append(asyncio.ensure_future(task_worker(bus, name, a.task_hold_s, say)))
    say(ready=a.region)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.readline()  # the bench closes stdin to stop us
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def task_worker(bus, name: str, hold_s: float, say) -> None:
    sub = await bus.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
    while True:
        for m in await sub.fetch(1, timeout=0.5):
            await asyncio.sleep(hold_s)
            tid = events.decode(m.data, Task).task_id
            try:  # as a worker does: the result first (deduped by id), then the ack
                await bus.publish(topo.rollout_subject("wan"), tid.encode(), msg_id=f"rollout-{tid}")
                await m.ack_sync(timeout=2)
                say(task=tid, w=name, deliveries=m.metadata.num_delivered)
            except Exception:
                pass  # our region is gone: the hub redelivers after ack_wait


class RegionProc:
    def __init__(self, lab: Lab, region: str, workers: int, read: str, task_hold_s: float = 0.0):
        self.lab, self.region, self.workers, self.read, self.task_hold_s = (
            lab,
            region,
            workers,
            read,
            task_hold_s,
        )
        self.patched: dict[tuple[str, int], float] = {}  # (worker, version) -> wall time
        self.version: dict[str, int] = {}
        self.tasks: list[dict] = []
        self.proc = None
        self._ready = asyncio.Event()
        self._reader = None

    async def start(self):
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.wan_region",
            "--region",
            self.region,
            "--url",
            self.lab.regions[self.region].url,
            "--workers",
            str(self.workers),
            "--read",
            self.read,
            "--task-hold-s",
            str(self.task_hold_s),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        self._reader = asyncio.ensure_future(self._read())
        await asyncio.wait_for(self._ready.wait(), 60)

    async def _read(self):
        while line := await self.proc.stdout.readline():
            try:
                m = json.loads(line)
            except ValueError:
                continue
            if "ready" in m:
                self._ready.set()
            elif "task" in m:
                self.tasks.append(m)
            elif "v" in m:
                self.patched.setdefault((m["w"], m["v"]), m["t"])
                self.version[m["w"]] = max(self.version.get(m["w"], -1), m["v"])

    def min_version(self) -> int:
        return min((self.version.get(f"{self.region}-w{i}", -1) for i in range(self.workers)), default=-1)

    async def stop(self):
        if self.proc and self.proc.returncode is None:
            try:
                self.proc.stdin.close()
                await asyncio.wait_for(self.proc.wait(), 15)
            except (TimeoutError, ConnectionError):
                self.proc.kill()
                await self.proc.wait()
        if self._reader:
            await asyncio.wait_for(self._reader, 5)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--region", required=True)
    p.add_argument("--url", required=True, help="the region's nats-server")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--read", choices=("hub", "mirror"), default="mirror")
    p.add_argument("--task-hold-s", type=float, default=0.0)
    a = p.parse_args(argv)
    setup_logging("bench-wan-region", level="warning")  # stderr: stdout is the pipe to the bench
    asyncio.run(region_main(a))


if __name__ == "__main__":
    main()
