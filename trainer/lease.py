"""Leader lease on KV rl-control/leader; its revision at acquisition is the fencing epoch.

The value is JSON {holder, epoch, renewed_at, ttl_s, released}. The leader renews it every
`renew_s` (well before ttl_s) with a compare-and-swap on the revision it last wrote, so two
trainers can never both believe they renewed. A standby watches the key and takes over with a
CAS on the revision it saw once that revision has stayed unchanged for ttl_s *on its own
monotonic clock* (no cross-host clock comparison), or at once when the holder released it.
KV revisions are stream sequences, so every takeover's epoch is higher than all before it.

A leader that cannot renew for ttl_s (partition, SIGSTOP) considers itself deposed
(`valid()` is false) and must not publish. That is only a local check: the fence is on the
server. Before every WEIGHTS write the leader `confirm()`s the lease with a CAS (refused once
a standby took over), and the write itself expects the stream's last sequence to be the one
this leader last wrote (bus/weights/publisher.py), so a leader paused between the two is refused too.
"""

from __future__ import annotations

import asyncio
import json
import time

from bus import topology as topo
from kernel import get_logger

log = get_logger(__name__)


class LeaseLost(RuntimeError):
    pass


def lease_value(holder: str, epoch: int, ttl_s: float, released: bool = False) -> bytes:
    return json.dumps(
        {"holder": holder, "epoch": epoch, "renewed_at": time.time(), "ttl_s": ttl_s, "released": released}
    ).encode()


def parse_lease(raw: bytes | None) -> dict | None:
    if not raw:
        return None
    try:
        d = json.loads(raw)
        return d if isinstance(d, dict) else {}
    except ValueError:
        return {}  # garbage in the key: treated as a lease held by nobody known


class LeaderLease:
    def __init__(self, bus, holder: str, ttl_s: float, renew_s: float, key: str = topo.KEY_LEADER):
        if renew_s >= ttl_s:
            raise ValueError(f"lease renew interval {renew_s}s must be below its ttl {ttl_s}s")
        self.bus, self.holder, self.ttl_s, self.renew_s, self.key = bus, holder, ttl_s, renew_s, key
        self.epoch = 0
        self.rev = 0  # revision we last wrote
        self.renewed_mono = 0.0  # monotonic time of our last successful write
        self._seen: tuple[int, float] = (-1, 0.0)  # (revision observed, when first observed)
        self._cas = asyncio.Lock()  # renewals (keeper, confirm) each CAS on the revision the last one wrote

    async def _read(self) -> tuple[dict | None, int]:
        value, rev = await self.bus.kv_entry(self.key)
        return parse_lease(value), rev

    def valid(self) -> bool:
        return self.epoch > 0 and time.monotonic() - self.renewed_mono < self.ttl_s

    async def try_acquire(self) -> bool:
        """One attempt; True when we now hold the lease (self.epoch set)."""
        value, rev = await self._read()
        now = time.monotonic()
        if rev != self._seen[0]:
            self._seen = (rev, now)
        try:
            if value is None:  # never held, or deleted
                t0 = time.monotonic()
                self.rev = await self.bus.kv_create(self.key, lease_value(self.holder, 0, self.ttl_s))
            elif value.get("released") or now - self._seen[1] >= self.ttl_s:
                t0 = time.monotonic()
                self.rev = await self.bus.kv_update(self.key, lease_value(self.holder, 0, self.ttl_s), rev)
            else:
                return False
        except Exception as e:  # lost the race (wrong last revision / exists)
            log.info("lease acquisition lost a race", error=str(e), holder=self.holder)
            return False
        self.epoch, self.renewed_mono = self.rev, t0
        try:
            await self.renew()  # record the epoch inside the value for operators
        except LeaseLost:
            self.epoch = 0
            return False
        log.info(
            "leader lease acquired",
            epoch=self.epoch,
            holder=self.holder,
            previous=(value or {}).get("holder"),
        )
        return True

    async def acquire(self, stop: asyncio.Event | None = None, poll_s: float = 0.5) -> int:
        """Wait as standby until we lead; returns the epoch (0 when stopped first)."""
        announced = False
        while not (stop is not None and stop.is_set()):
            if await self.try_acquire():
                return self.epoch
            if not announced:
                log.info("standby: waiting for the leader lease", holder=self.holder, ttl_s=self.ttl_s)
                announced = True
            await asyncio.sleep(poll_s)
        return 0

    async def confirm(self) -> None:
        """The fence before a publication: a CAS on the lease (raises LeaseLost once deposed)."""
        if not self.epoch:
            raise LeaseLost("not holding the leader lease")
        await self.renew()

    async def renew(self) -> None:
        async with self._cas:
            await self._renew()

    async def _renew(self) -> None:
        t0 = time.monotonic()
        try:
            self.rev = await self.bus.kv_update(
                self.key, lease_value(self.holder, self.epoch, self.ttl_s), self.rev
            )
        except Exception as e:
            value, rev = await self._read()
            if (value or {}).get("holder") != self.holder or rev != self.rev:
                raise LeaseLost(
                    f"lease taken by {(value or {}).get('holder')!r} at revision {rev}: {e}"
                ) from e
            raise
        self.renewed_mono = t0

    async def keep(self, stop: asyncio.Event, lost: asyncio.Event) -> None:
        """Renew every renew_s until stop; set `lost` when deposed or unable to renew for ttl."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.renew_s)
                return
            except TimeoutError:
                pass
            try:
                await self.renew()
            except LeaseLost as e:
                log.error("leader lease lost", error=str(e))
                lost.set()
                return
            except Exception as e:  # transient: retry until the lease would have expired
                log.warning("lease renewal failed; retrying", error=str(e))
            if not self.valid():
                log.error("leader lease expired before it could be renewed")
                lost.set()
                return

    async def release(self) -> None:
        """Hand over at once (graceful stop): a standby sees released=true and takes over."""
        if self.epoch and self.valid():
            try:
                async with self._cas:
                    await self.bus.kv_update(
                        self.key, lease_value(self.holder, self.epoch, self.ttl_s, True), self.rev
                    )
            except Exception as e:
                log.warning("lease release failed (it will expire)", error=str(e))
        self.epoch = 0
