"""Inference regions: where a worker reads policy weights.

A region is a nats-server with its own JetStream domain, connected to the hub as a leaf node.
It holds mirrors of WEIGHTS and of the blob store's stream (`topology.provision_mirrors`), so
each update crosses the WAN once per region however many workers read it. Work does not move:
a region's workers pull TASKS and publish ROLLOUTS on the hub (their Bus has js_domain="hub"),
through the same leaf link, so when a region dies its unacked tasks go back to the hub's work
queue after ack_wait and other regions take them.

    bus = await connect(BusConfig(servers=["nats://region-eu:4222"], js_domain="hub",
                                  weights_domain="eu"))
    feed = WeightFollower(weight_source(bus), public_key=...)   # WEIGHTS + blobs from eu's mirrors

`WeightSource` stands in for the Bus in what WeightFollower uses (nc, js, get_blob) and adds the
wake-up: a headers-only ordered push consumer on the local WEIGHTS mirror, so a worker is woken
when the mirror (not the hub) has the message, and no payload crosses the WAN a second time for
the wake-up (the hub's plain `rl.weights.>` subjects carry inline deltas). The feed still reads
by sequence and backs off when a wake-up finds nothing (`wake_on="hub"`: the plain subscription).
"""

from __future__ import annotations

from nats.js import api
from nats.js.errors import BucketNotFoundError, NotFoundError

from bus import topology as topo
from bus.weights import blobs
from kernel.log import get_logger

log = get_logger(__name__)


class MirrorMissing(RuntimeError):
    pass


class WeightSource:
    """WEIGHTS and the blob store read from JetStream domain `domain` (a region's mirrors)."""

    def __init__(self, bus, domain: str | None, *, wake_on: str = "mirror", blob_wait_s: float = 60.0):
        if wake_on not in ("mirror", "hub"):
            raise ValueError(f"wake_on must be 'mirror' or 'hub', got {wake_on!r}")
        self.bus, self.domain, self.wake_on, self.blob_wait_s = bus, domain, wake_on, blob_wait_s
        self.nc, self.cfg = bus.nc, bus.cfg
        self.js = bus.nc.jetstream(timeout=bus.cfg.request_timeout_s, domain=domain)
        self._obs = None

    @property
    def name(self) -> str:
        return self.bus.name

    async def kv_entry(self, key: str):
        """Control values (the leader lease that vouches for an epoch) live on the hub, not in the
        region: read them through the hub's KV like every other client."""
        return await self.bus.kv_entry(key)

    async def blob_store(self):
        # never provisions: a region's mirrors are declared by its operator (provision_mirrors)
        if self._obs is None:
            try:
                self._obs = await self.js.object_store(topo.BLOB_BUCKET)
            except (BucketNotFoundError, NotFoundError):
                raise MirrorMissing(
                    f"no {topo.BLOB_STREAM} in JetStream domain {self.domain!r}: "
                    f"provision the region's mirrors (asyncrl region / provision_mirrors)"
                ) from None
        return self._obs

    async def get_blob(self, name: str) -> bytes:
        """Read from the region's blob mirror, waiting for a blob that has not arrived yet."""
        return await blobs.get_blob(self, name, wait_s=self.blob_wait_s)

    async def subscribe_weights(self, cb):
        """Wake-ups for WeightFollower. "mirror": when the local mirror stores a WEIGHTS message
        (headers only, ordered: the client recreates it after a gap or a server restart)."""
        if self.wake_on == "hub":
            return await self.nc.subscribe("rl.weights.>", cb=cb)
        return await self.js.subscribe(
            "rl.weights.>",
            stream=topo.WEIGHTS,
            cb=cb,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.NEW,
            headers_only=True,
            idle_heartbeat=2.0,
        )


def weight_source(bus, **kw):
    """The Bus itself when the worker reads weights where it reads work (no region), else the
    region's mirrors named by `BusConfig.weights_domain`."""
    domain = getattr(bus.cfg, "weights_domain", None)
    if not domain or domain == bus.cfg.js_domain:
        return bus
    return WeightSource(bus, domain, **kw)


def weight_follower(bus, **feed_kw):
    """The WeightFollower a process should follow: its region's mirrors when its BusConfig names
    one (`weights_domain`), else the Bus. One call, so processes need no region logic."""
    from bus.weights.follower import WeightFollower  # here: `python -m bus.weights.regions` needs no torch

    return WeightFollower(weight_source(bus), **feed_kw)


async def mirror_status(js) -> dict[str, dict]:
    """Per mirror on a region's server: messages, last sequence, and the mirror's lag and
    last-contact age as the server reports them (for `inspect` and the catch-up bench)."""
    out = {}
    for name in topo.MIRRORED:
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            out[name] = {"missing": True}
            continue
        m = info.mirror
        out[name] = {
            "messages": info.state.messages,
            "last_seq": info.state.last_seq,
            "lag": getattr(m, "lag", None),
            "active_s": (m.active / 1e9) if m and m.active else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m bus.weights.regions`: declare (or update) the mirrors on a region's server, once, as
    its admin: ASYNCRL_BUS__SERVERS/USER/PASSWORD name the region's server (no js_domain: its
    own domain), ASYNCRL_MIRROR__WEIGHTS_KEEP etc. the retention (topology.MirrorConfig)."""
    import asyncio
    import json

    from bus.client import connect
    from bus.config import BusConfig
    from kernel.config import load_config

    bus_cfg = load_config(BusConfig, env_prefix="ASYNCRL_BUS__")  # both checked before connecting
    mirror_cfg = load_config(topo.MirrorConfig, env_prefix="ASYNCRL_MIRROR__")

    async def run() -> dict:
        bus = await connect(bus_cfg)
        try:
            return await topo.provision_mirrors(bus.js, mirror_cfg, log=log)
        finally:
            await bus.close()

    print(json.dumps(asyncio.run(run())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
