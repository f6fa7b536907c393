"""A WAN link on one machine: an asyncio TCP proxy that delays, paces and stalls what it carries.

    link = DelayLine("127.0.0.1", hub_leaf_port, LinkSpec(delay_ms=80, rate_mbit=20, loss=0.001))
    port = await link.start()          # the region's server dials 127.0.0.1:port instead of the hub
    link.down.bytes                    # hub -> region bytes carried (hub egress on this link)
    await link.cut(); await link.restore()

Per direction, every chunk read from one side is serialised at `rate_mbit` on a link shared by
all connections of that direction (a token bucket with a burst of one chunk: the chunk leaves
when the previous one has), then arrives `delay_ms` later on the other side. The bytes queued
in the line are capped (about two bandwidth-delay products), so a slow link pushes back on the
sender through TCP as a real bottleneck does. Both legs are loopback TCP, which never loses, so
loss is emulated as what TCP makes of it: a lost segment holds the byte stream until it is
retransmitted, about one round trip (fast retransmit); each MSS-sized segment is lost with
probability `loss`. Not emulated: congestion-window collapse after a loss, reordering.

`cut()` resets every connection and refuses new ones (a region's link down) until `restore()`.
No privileges needed; `bench.wan` uses this on every region link. Loopback only. With
`--link tbf` (root) the rate is the kernel's `tbf` on a veth between two namespaces instead
(`bench.wantbf`), and this line keeps the latency, loss and counters.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field


@dataclass
class LinkSpec:
    delay_ms: float = 0.0  # one way
    rate_mbit: float = 0.0  # per direction; 0: not capped
    loss: float = 0.0  # per MSS segment, emulated as a one-RTT stall
    mss: int = 1448
    queue_bytes: int = 0  # bytes in the line per direction before the reader waits; 0: ~2 BDP

    def __post_init__(self):
        if self.delay_ms < 0 or self.rate_mbit < 0:
            raise ValueError(
                f"LinkSpec: delay_ms and rate_mbit must be >= 0, got {self.delay_ms}, {self.rate_mbit}"
            )
        if not 0 <= self.loss < 1:
            raise ValueError(f"LinkSpec.loss must be in [0, 1), got {self.loss}")
        if self.mss < 1:
            raise ValueError(f"LinkSpec.mss must be >= 1, got {self.mss}")

    @property
    def bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    def cap(self) -> int:
        if self.queue_bytes:
            return self.queue_bytes
        bdp = self.bytes_per_s * 2 * self.delay_ms / 1000 if self.rate_mbit else 0
        return int(max(2 * bdp, 256 * 1024))


@dataclass
class Direction:
    """One direction of the link: its counters and the time the bottleneck is free again."""

    bytes: int = 0  # delivered to the far side
    chunks: int = 0
    stalls: int = 0  # segments "lost" (each held the stream one RTT)
    free_at: float = 0.0
    history: list = field(default_factory=list)  # (t, cumulative bytes) when sampled

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "chunks": self.chunks, "stalls": self.stalls}


class DelayLine:
    def __init__(
        self,
        target_host: str,
        target_port: int,
        spec: LinkSpec | None = None,
        *,
        listen_host: str = "127.0.0.1",
        seed: int = 0,
        connect=None,
    ):
        self.target = (target_host, target_port)
        # connect: an async () -> (reader, writer) dialling the target another way (bench.wantbf:
        # across a tbf-shaped veth, the kernel then does the rate and this line the latency)
        self._connect = connect
        self.listen_host = listen_host
        self.spec = spec or LinkSpec()
        self.up, self.down = Direction(), Direction()  # up: client -> target; down: target -> client
        self.port: int | None = None
        self.connections = 0
        self.refused = 0
        self._up = True
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._rng = random.Random(seed)

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._accept, self.listen_host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @property
    def is_up(self) -> bool:
        return self._up

    async def cut(self) -> None:
        """Link down: reset what is open, refuse new connections until restore()."""
        self._up = False
        for w in list(self._writers):
            _abort(w)
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    def restore(self) -> None:
        self._up = True

    async def close(self) -> None:
        await self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def counters(self) -> dict:
        return {
            "down": self.down.as_dict(),
            "up": self.up.as_dict(),
            "connections": self.connections,
            "refused": self.refused,
        }

    # -- carrying ------------------------------------------------------------------------------
    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        if not self._up:
            self.refused += 1
            _abort(c_writer)
            return
        try:
            t_reader, t_writer = await (
                self._connect() if self._connect else asyncio.open_connection(*self.target)
            )
        except OSError:
            self.refused += 1
            _abort(c_writer)
            return
        self.connections += 1
        task = asyncio.current_task()
        self._conns.add(task)
        self._writers.update((c_writer, t_writer))
        try:
            pumps = [
                asyncio.ensure_future(self._pump(c_reader, t_writer, self.up)),
                asyncio.ensure_future(self._pump(t_reader, c_writer, self.down)),
            ]
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for p in pumps:
                    p.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except asyncio.CancelledError:
            pass
        finally:
            for w in (c_writer, t_writer):
                self._writers.discard(w)
                _abort(w)
            self._conns.discard(task)

    def _schedule(self, d: Direction, n: int, now: float) -> float:
        """When a chunk of n bytes read now reaches the far side."""
        s = self.spec
        start = max(now, d.free_at)
        tx = n / s.bytes_per_s if s.rate_mbit else 0.0
        stall = 0.0
        if s.loss:
            segs = math.ceil(n / s.mss)
            lost = (
                sum(self._rng.random() < s.loss for _ in range(segs))
                if segs < 64
                else _binomial(self._rng, segs, s.loss)
            )
            if lost:
                d.stalls += lost
                stall = lost * max(2 * s.delay_ms / 1000, 0.001)  # each loss: one RTT until resent
        d.free_at = start + tx + stall
        return d.free_at + s.delay_ms / 1000

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, d: Direction) -> None:
        loop = asyncio.get_running_loop()
        line: asyncio.Queue = asyncio.Queue()
        state = {"queued": 0}
        drained = asyncio.Event()

        async def deliver():
            while True:
                item = await line.get()
                if item is None:
                    return
                due, data = item
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                d.bytes += len(data)
                d.chunks += 1
                state["queued"] -= len(data)
                drained.set()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(64 * 1024)
                if not data:
                    break
                line.put_nowait((self._schedule(d, len(data), loop.time()), data))
                state["queued"] += len(data)
                while state["queued"] > self.spec.cap() and not sender.done():
                    drained.clear()
                    await drained.wait()
                if sender.done():
                    break
            line.put_nowait(None)
            await sender
        finally:
            sender.cancel()


def _binomial(rng: random.Random, n: int, p: float) -> int:
    """Number of losses among n segments (normal approximation for large n, exact when small)."""
    mean = n * p
    if mean < 5:
        # Poisson is exact enough for rare losses
        k, t, limit = 0, rng.random(), math.exp(-mean)
        while t > limit:
            t *= rng.random()
            k += 1
        return k
    return max(0, min(n, round(rng.gauss(mean, math.sqrt(mean * (1 - p))))))


def _abort(w: asyncio.StreamWriter) -> None:
    try:
        w.transport.abort()
    except Exception:
        pass


# -- as a process of its own (bench.wan runs every link here, away from the measured clients) -----
async def _serve(specs: dict) -> None:
    """stdin: one JSON link table {name: {target: [host, port], delay_ms, rate_mbit, loss, tbf}}, then
    command lines `cut NAME` | `restore NAME` | `counters` | `spec NAME {json}`; stdout: one JSON
    answer per line (the first: {"ports": {name: port}}). tbf: true caps rate_mbit with the kernel's
    tbf on a veth between namespaces made here (bench.wantbf), deleted when this process ends."""

    links: dict[str, DelayLine] = {}
    paths: dict = {}
    try:
        for i, (name, s) in enumerate(specs.items()):
            host, port = s.pop("target")
            connect = None
            if s.pop("tbf", False) and s.get("rate_mbit"):
                from .wantbf import TbfPath

                paths[name] = await TbfPath(s["rate_mbit"]).start(host, int(port))
                connect, s["rate_mbit"] = paths[name].open, 0.0
            links[name] = DelayLine(host, int(port), LinkSpec(**s), seed=i, connect=connect)
            await links[name].start()
        await _commands(links, paths)
    finally:
        for link in links.values():
            await link.close()
        for p in paths.values():
            await p.close()


async def _commands(links: dict, paths: dict) -> None:
    import json
    import sys

    def say(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    say({"ports": {n: link.port for n, link in links.items()}})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().strip():
        cmd, _, rest = line.partition(" ")
        name, _, arg = rest.partition(" ")
        try:
            if cmd == "counters":
                say({n: link.counters() for n, link in links.items()})
            elif cmd == "cut":
                await links[name].cut()
                say({"ok": True})
            elif cmd == "restore":
                links[name].restore()
                say({"ok": True})
            elif cmd == "spec":
                spec = LinkSpec(**json.loads(arg))
                if name in paths and spec.rate_mbit:  # the kernel keeps the rate
                    paths[name].set_rate(spec.rate_mbit)
                    spec.rate_mbit = 0.0
                links[name].spec = spec
                say({"ok": True})
            else:
                say({"error": f"unknown command {cmd!r}"})
        except KeyError:
            say({"error": f"no link {name!r}"})


if __name__ == "__main__":
    import json
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # exit through atexit: tbf namespaces deleted
    asyncio.run(_serve(json.loads(sys.stdin.readline())))
