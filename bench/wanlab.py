"""A hub and its inference regions on one machine, each region behind an emulated WAN link.

    lab = Lab(tmp, {"near": LinkSpec(20, 50), "far": LinkSpec(150, 10)})
    await lab.start()                       # hub (domain hub) + per region: link, server, mirrors
    bus = await lab.worker_bus("far", "w1", read="mirror")     # work on the hub, weights from far
    await lab.cut("far"); await lab.restore("far"); await lab.kill_region("far")

The hub is a nats-server with JetStream domain `hub` and a leaf-node listener; a region is a
nats-server with its own domain (the region's name) whose leaf remote dials the region's link in
`bench.delayline` (one process for all links, so the links keep time while clients are busy),
which carries the bytes to the hub's leaf port. Loopback only (with link="tbf", also addresses
inside the two network namespaces each link's tbf path creates; bench.wantbf).
"""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request
from dataclasses import asdict
from pathlib import Path

from asyncrl.nats_server import EmbeddedServer
from bus import BusConfig, connect
from bus import topology as topo
from bus.weights.regions import weight_source
from kernel.lifetime import cancel_and_wait

from .delayline import LinkSpec


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=2) as r:
        return json.loads(r.read())


class Links:
    """The `bench.delayline` process: one DelayLine per region."""

    def __init__(self):
        self.proc: asyncio.subprocess.Process | None = None
        self.ports: dict[str, int] = {}
        self._lock = asyncio.Lock()

    async def start(self, table: dict) -> dict[str, int]:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.delayline",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=str(Path(__file__).resolve().parents[1]),
        )
        self.ports = (await self._ask(json.dumps(table)))["ports"]
        return self.ports

    async def _ask(self, line: str) -> dict:
        async with self._lock:
            self.proc.stdin.write(line.encode() + b"\n")
            await self.proc.stdin.drain()
            out = await asyncio.wait_for(self.proc.stdout.readline(), 30)
        if not out:
            raise RuntimeError("bench.delayline exited")
        ans = json.loads(out)
        if "error" in ans:
            raise RuntimeError(ans["error"])
        return ans

    async def counters(self) -> dict:
        return await self._ask("counters")

    async def cut(self, name: str) -> None:
        await self._ask(f"cut {name}")

    async def restore(self, name: str) -> None:
        await self._ask(f"restore {name}")

    async def close(self) -> None:
        if self.proc and self.proc.returncode is None:
            self.proc.stdin.write(b"\n")
            try:
                await self.proc.stdin.drain()
                await asyncio.wait_for(self.proc.wait(), 10)
            except (TimeoutError, ConnectionError):
                self.proc.kill()
                await self.proc.wait()


class Lab:
    def __init__(
        self,
        root: str | Path,
        regions: dict[str, LinkSpec],
        *,
        topology: topo.TopologyConfig | None = None,
        mirror: topo.MirrorConfig | None = None,
        mirrors: bool = True,
        link: str = "proxy",
    ):
        if link not in ("proxy", "tbf"):
            raise ValueError(f"link must be 'proxy' (the delay line's token bucket) or 'tbf', got {link!r}")
        self.link = link  # tbf: the kernel caps each link's rate (bench.wantbf, root)
        self.root = Path(root)
        self.specs = dict(regions)
        self.topology = topology or topo.TopologyConfig(storage="memory")
        self.mirror = mirror or topo.MirrorConfig(storage="memory", weights_keep=self.topology.weights_keep)
        self.mirrors = mirrors  # False: regions without mirrors (every read crosses the WAN)
        self.hub: EmbeddedServer | None = None
        self.regions: dict[str, EmbeddedServer] = {}
        self.links = Links()
        self.hub_leaf_port = 0
        self._buses: list = []

    def _conf(self, name: str, text: str) -> str:
        p = self.root / f"{name}.conf"
        p.write_text(text)
        return str(p)

    async def start(self) -> Lab:
        self.root.mkdir(parents=True, exist_ok=True)
        # leaf port -1: the server picks one; read back from /varz
        self.hub = EmbeddedServer(
            self.root / "hub",
            config_file=self._conf(
                "hub",
                (
                    "server_name: hub\nmax_payload: 8MB\n"
                    f"jetstream {{ domain: {topo.HUB_DOMAIN} }}\n"
                    # no_advertise: else a region learns the hub's own leaf address and reconnects there,
                    # around its WAN link
                    "leafnodes { listen: 127.0.0.1:-1, no_advertise: true }\n"
                ),
            ),
        )
        await self.hub.start()
        self.hub_leaf_port = int(_get_json(self.hub.monitor_url + "/varz")["leaf"]["port"])
        ports = await self.links.start(
            {
                n: {"target": ["127.0.0.1", self.hub_leaf_port], **asdict(s), "tbf": self.link == "tbf"}
                for n, s in self.specs.items()
            }
        )
        admin = await connect(
            BusConfig(
                servers=[self.hub.url], name="lab-admin", js_domain=topo.HUB_DOMAIN, topology=self.topology
            )
        )
        await admin.provision()
        await admin.close()
        for name in self.specs:
            self.regions[name] = EmbeddedServer(
                self.root / name,
                config_file=self._conf(
                    name,
                    (
                        f"server_name: {name}\nmax_payload: 8MB\njetstream {{ domain: {name} }}\n"
                        "leafnodes { reconnect: 1s\n"
                        f'  remotes: [ {{ url: "nats-leaf://127.0.0.1:{ports[name]}" }} ] }}\n'
                    ),
                ),
            )
        await asyncio.gather(*(s.start() for s in self.regions.values()))
        for name in self.specs:
            await self.wait_leaf(name)
            if self.mirrors:
                await self.provision_region(name)
        return self

    async def provision_region(self, name: str) -> dict:
        b = await connect(BusConfig(servers=[self.regions[name].url], name=f"{name}-admin"))
        try:
            return await topo.provision_mirrors(b.js, self.mirror)
        finally:
            await b.close()

    async def wait_leaf(self, name: str, timeout: float = 30.0) -> None:
        srv = self.regions[name]
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                if _get_json(srv.monitor_url + "/leafz").get("leafnodes", 0) >= 1:
                    return
            except OSError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"region {name}: leaf link not up after {timeout}s")
            await asyncio.sleep(0.1)

    # -- clients ---------------------------------------------------------------------------------
    async def hub_bus(self, name: str, **kw):
        b = await connect(
            BusConfig(
                servers=[self.hub.url], name=name, js_domain=topo.HUB_DOMAIN, topology=self.topology, **kw
            )
        )
        self._buses.append(b)
        return b

    async def worker_bus(self, region: str, name: str, read: str = "mirror", **kw):
        """A worker in `region`: work on the hub through the leaf; weights from the region's
        mirrors (read="mirror") or from the hub's streams across the WAN (read="hub")."""
        if read not in ("mirror", "hub"):
            raise ValueError(f"read must be 'mirror' or 'hub', got {read!r}")
        b = await connect(
            BusConfig(
                servers=[self.regions[region].url],
                name=name,
                js_domain=topo.HUB_DOMAIN,
                weights_domain=region if read == "mirror" else None,
                topology=self.topology,
                **kw,
            )
        )
        self._buses.append(b)
        return b, weight_source(b)

    # -- faults ----------------------------------------------------------------------------------
    async def cut(self, region: str) -> None:
        await self.links.cut(region)

    async def restore(self, region: str) -> None:
        await self.links.restore(region)

    async def kill_region(self, region: str) -> None:
        await self.regions[region].stop(kill=True)

    async def start_region(self, region: str) -> None:
        await self.regions[region].start()
        await self.wait_leaf(region)
        if self.mirrors:
            await self.provision_region(region)  # memory mirrors do not survive a restart

    async def counters(self) -> dict:
        return await self.links.counters()

    async def close(self) -> None:
        # bounded: a nats-py close caught mid-reconnect can lose a cancel, and `wait_for` would then
        # wait for it forever; cancel_and_wait cancels again until it has ended
        if self._buses:
            closing = [asyncio.ensure_future(b.close()) for b in self._buses]
            _, stuck = await asyncio.wait(closing, timeout=10)
            await cancel_and_wait(stuck)
            self._buses.clear()
        await self.links.close()
        for s in [*self.regions.values(), self.hub]:
            if s is not None:
                await asyncio.to_thread(s.cleanup)
