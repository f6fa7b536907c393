"""Connections to the endpoint, bounded: at most `max_connections` open (more are closed on accept),
and each must send a request's headers within `header_timeout_s` of connecting or of its last
response (aiohttp's server has no such timeout: a client that opens a connection and sends nothing,
or half a header, would hold it forever).

    guard = ConnectionGuard(max_connections, header_timeout_s)
    server = await loop.create_server(guard.factory(runner.server), host, port)
    guard.busy(request.transport) ... guard.idle(request.transport)   around each request (middleware)
"""

from __future__ import annotations

import asyncio


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, with an accept cap and an idle/header deadline."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol):
        self.guard, self.inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.active = 0

    def connection_made(self, transport) -> None:
        g = self.guard
        if len(g.conns) >= g.max_connections:
            g.stats["refused"] += 1
            self.inner = None
            transport.abort()
            return
        self.transport = transport
        g.conns[transport] = self
        self.inner.connection_made(transport)
        self.arm()

    def arm(self) -> None:
        self.disarm()
        if self.transport is not None and self.active == 0:
            self.timer = asyncio.get_running_loop().call_later(self.guard.header_timeout_s, self.expire)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def expire(self) -> None:
        self.timer = None
        if self.active == 0 and self.transport is not None:
            self.guard.stats["timed_out"] += 1
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        self.disarm()
        if self.transport is not None:
            self.guard.conns.pop(self.transport, None)
            self.transport = None
        if self.inner is not None:
            self.inner.connection_lost(exc)


class ConnectionGuard:
    def __init__(self, max_connections: int, header_timeout_s: float):
        self.max_connections, self.header_timeout_s = max_connections, header_timeout_s
        self.conns: dict[asyncio.BaseTransport, _Guarded] = {}
        self.stats = {"refused": 0, "timed_out": 0}

    def factory(self, inner_factory):
        return lambda: _Guarded(self, inner_factory())

    def busy(self, transport) -> None:
        c = self.conns.get(transport)
        if c is not None:
            c.active += 1
            c.disarm()

    def idle(self, transport) -> None:
        c = self.conns.get(transport)
        if c is not None:
            c.active = max(0, c.active - 1)
            c.arm()

    def close_all(self) -> None:
        for t in list(self.conns):
            t.abort()
