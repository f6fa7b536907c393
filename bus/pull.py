"""ResilientPull: a durable pull consumer's fetch that survives reconnects and server restarts."""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import Any, Protocol

import nats.js.errors as jse
from nats.aio.msg import Msg
from nats.js import api

from bus import topology as topo
from bus.config import BusConfig
from kernel.log import get_logger

log = get_logger("bus")


class PullBus(Protocol):
    """What a pull needs of its connection (bus.client.Bus, which imports this module: no import back)."""

    cfg: BusConfig
    nc: Any
    js: Any

    async def provision(self) -> Any: ...


class ResilientPull:
    """A pull subscription on a durable consumer that survives reconnects and server restarts.

    Our own fetch (not nats-py's, which spawns a task per message): one wildcard inbox
    subscription whose callback buffers messages; each fetch first takes what is ready
    (`no_wait` request), else long-polls for one message and then tops up without waiting.
    Status replies (404 no messages, 408 expired, 409) end a request; a timeout returns [].
    """

    def __init__(self, bus: PullBus, stream: str, durable: str):
        self.bus, self.stream, self.durable = bus, stream, durable
        self._sub = None
        self._inbox = ""
        self._buf: collections.deque[Msg] = collections.deque()
        self._status: dict[str, tuple[str, str]] = {}  # request token -> (code, description)
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._token = 0
        self.rebuilds = 0
        self.last_status = ("", "")  # status that ended the last request (404, 408, 409 ...)

    @property
    def _next_subject(self) -> str:
        return f"{topo.api_prefix(self.bus.cfg.js_domain)}.CONSUMER.MSG.NEXT.{self.stream}.{self.durable}"

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get(api.Header.STATUS) if msg.headers else None
        if status:
            if status != "100":  # 100 = idle heartbeat / flow control: not the end of a request
                self._status[msg.subject.rsplit(".", 1)[-1]] = (
                    status,
                    msg.headers.get(api.Header.DESCRIPTION, ""),
                )
        else:
            self._buf.append(msg)
        self._wake.set()

    async def bind(self):
        """(Re)subscribe the inbox; the consumer is reprovisioned when the server lost it."""
        try:
            await self.bus.js.consumer_info(self.stream, self.durable)
        except jse.NotFoundError:
            # the consumer is part of the declared topology: (re)provision rather than invent one
            await self.bus.provision()
        self._inbox = self.bus.nc.new_inbox()
        self._sub = await self.bus.nc.subscribe(f"{self._inbox}.*", cb=self._on_msg)
        return self._sub

    def _take(self, n: int) -> list[Msg]:
        return [self._buf.popleft() for _ in range(min(n, len(self._buf)))]

    async def _request(self, n: int, wait_s: float, no_wait: bool) -> list[Msg]:
        self._token += 1
        token = str(self._token)
        req = {"batch": n}
        if no_wait:
            req["no_wait"] = True
        else:
            req["expires"] = int(max(wait_s - 0.05, 0.01) * 1e9)  # server ends it just before we give up
        self._status.clear()
        await self.bus.nc.publish(
            self._next_subject, json.dumps(req).encode(), reply=f"{self._inbox}.{token}"
        )
        deadline = time.monotonic() + wait_s + (1.0 if no_wait else 0.2)
        while len(self._buf) < n and token not in self._status:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                break
        code, desc = self._status.get(token, ("", ""))
        if code == "409" and "deleted" in desc.lower():
            raise jse.NotFoundError(description=f"consumer {self.stream}/{self.durable}: {desc}")
        self.last_status = (code, desc)
        return self._take(n)

    async def fetch(self, batch: int = 1, timeout: float = 1.0) -> list[Msg]:
        """Up to `batch` messages; [] when none arrive within `timeout` (never raises on empty)."""
        if batch < 1:
            return []
        async with self._lock:  # one request in flight per subscription; callers may share it
            return await self._fetch(batch, timeout)

    async def _fetch(self, batch: int, timeout: float) -> list[Msg]:
        try:
            if self._sub is None:
                await self.bind()
            got = self._take(batch)
            if not got:
                got = await self._request(batch, timeout, no_wait=True)
            if not got:
                got = await self._request(1, timeout, no_wait=False)
            if got and len(got) < batch:
                got += await self._request(batch - len(got), timeout, no_wait=True)
            elif not got and self.last_status[0] == "409":
                # e.g. "Exceeded MaxAckPending": the server answers at once; don't spin on it
                await asyncio.sleep(min(timeout, 0.25))
            return got
        except asyncio.CancelledError:
            raise
        except Exception as e:  # connection lost, consumer gone, server restarted mid-request
            self.rebuilds += 1
            log.warning(
                "pull fetch failed; rebuilding subscription",
                stream=self.stream,
                durable=self.durable,
                error=repr(e),
            )
            await self._drop()
            await asyncio.sleep(min(timeout, 0.5))  # don't spin while the server is away
            return []

    async def _drop(self):
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:
                pass

    async def consumer_info(self) -> api.ConsumerInfo:
        return await self.bus.js.consumer_info(self.stream, self.durable)

    async def unsubscribe(self):
        """Stop; messages fetched but not handed out are nak'ed so they come back at once."""
        for m in self._take(len(self._buf)):
            try:
                await m.nak()
            except Exception:
                pass
        await self._drop()
