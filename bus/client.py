"""The Bus: one NATS connection + JetStream context, with the few operations processes need.

connect() retries the first connection (tenacity) and then reconnects forever with backoff.
publish() stamps the readable Rl-* headers and Nats-Msg-Id (so a retried publish is deduped)
and retries until the JetStream ack arrives. pull() returns a subscription that survives
reconnects and server restarts and returns [] when there is nothing to fetch.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import nats
import nats.errors
import nats.js.errors as jse
from nats.aio.msg import Msg
from nats.js import api
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from bus import topology as topo
from bus.config import BusConfig, redact_url
from bus.errors import BlobError, ConnectError, KVConflict, PublishError  # noqa: F401  (re-exported)
from bus.events import Event, encode
from bus.pull import ResilientPull
from bus.weights.blobs import get_blob, put_blob
from kernel import metrics
from kernel.log import get_logger

log = get_logger("bus")

# errors after which a publish or fetch is worth retrying: the connection is (re)establishing
RETRYABLE = (
    nats.errors.TimeoutError,
    asyncio.TimeoutError,
    nats.errors.NoRespondersError,
    jse.NoStreamResponseError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    jse.ServiceUnavailableError,
    nats.errors.OutboundBufferLimitError,
)


def _ssl_context(cfg: BusConfig) -> ssl.SSLContext | None:
    if not (cfg.tls_ca or cfg.tls_cert):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.tls_ca)
    if cfg.tls_cert:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    return ctx


def _auth_failure(e: BaseException | None) -> bool:
    text = repr(e).lower()
    return (
        isinstance(e, nats.errors.AuthorizationError) or "authorization" in text or "authentication" in text
    )


async def connect(cfg: BusConfig | None = None, **overrides) -> Bus:
    """Connect (retrying the first time) and return a Bus. Reconnects forever afterwards.
    Raises ConnectError when no server answers after `connect_attempts`, at once on bad credentials."""
    cfg = cfg or BusConfig()
    if overrides:
        import dataclasses

        cfg = dataclasses.replace(cfg, **overrides)
    blog = log.bind(client=cfg.name)
    shown = [redact_url(u) for u in cfg.servers]  # a URL's password never reaches a log or message
    state: dict = {"bus": None, "err": None}

    async def on_disconnect():
        bus = state["bus"]
        if bus is not None and not bus.nc.is_closed and not getattr(bus.nc, "_asyncrl_closing", False):
            blog.warning("nats disconnected")

    async def on_reconnect():
        bus = state["bus"]
        if bus is not None:
            bus.reconnects += 1  # lets watchers know their server-side state is gone
            blog.info(
                "nats reconnected", server=str(bus.nc.connected_url.netloc if bus.nc.connected_url else "?")
            )

    async def on_error(e):
        state["err"] = e
        blog.warning("nats error", error=repr(e))

    # the first connection gives up (max_reconnect_attempts=1 per try, tenacity around it) so a
    # wrong URL or password is reported; once connected we switch to reconnecting forever
    opts = dict(
        servers=cfg.servers,
        name=cfg.name,
        connect_timeout=cfg.connect_timeout_s,
        max_reconnect_attempts=1,
        reconnect_time_wait=cfg.reconnect_wait_s,
        allow_reconnect=True,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
        tls=_ssl_context(cfg),
        tls_hostname=cfg.tls_hostname,
    )
    opts.update(
        {
            k: v
            for k, v in dict(
                user=cfg.user,
                password=cfg.password,
                token=cfg.token,
                nkeys_seed=cfg.nkeys_seed,
                user_credentials=cfg.creds,
            ).items()
            if v
        }
    )
    try:
        async for attempt_ in AsyncRetrying(
            stop=stop_after_attempt(cfg.connect_attempts),
            reraise=True,
            wait=wait_random_exponential(multiplier=0.2, max=cfg.reconnect_wait_max_s),
            retry=retry_if_exception_type(_Unreachable),
        ):
            with attempt_:
                # bounded: nats-py can hang after a failed TLS handshake on the first connect
                limit = (cfg.connect_timeout_s + cfg.reconnect_wait_s) * 2 * len(cfg.servers) + 1
                try:
                    nc = await asyncio.wait_for(nats.connect(**opts), limit)
                except (TimeoutError, OSError, nats.errors.NoServersError, nats.errors.Error) as e:
                    if _auth_failure(state["err"]) or _auth_failure(e):
                        raise ConnectError(
                            f"NATS at {shown} refused the credentials of {cfg.name!r}: {state['err'] or e!r}"
                        ) from None
                    if isinstance(state["err"], ssl.SSLError) or isinstance(e, ssl.SSLError):
                        raise ConnectError(
                            f"TLS with NATS at {shown} failed (tls_ca / tls_cert / "
                            f"tls_key?): {state['err'] or e!r}"
                        ) from None
                    raise _Unreachable(repr(state["err"] or e)) from e
    except _Unreachable as e:
        raise ConnectError(
            f"no NATS server reachable at {shown} after {cfg.connect_attempts} attempts: {e}"
        ) from None
    nc.options["max_reconnect_attempts"] = -1  # from now on: reconnect forever
    blog.info("nats connected", servers=shown)
    state["bus"] = Bus(nc, cfg)
    return state["bus"]


class _Unreachable(Exception):
    pass


class Bus:
    def __init__(self, nc, cfg: BusConfig):
        self.nc, self.cfg = nc, cfg
        self.js = nc.jetstream(timeout=cfg.request_timeout_s, domain=cfg.js_domain)
        self._kv = None
        self._obs = None
        self.reconnects = 0

    @property
    def name(self) -> str:
        return self.cfg.name

    async def provision(self, cfg: topo.TopologyConfig | None = None) -> dict[str, str]:
        """topology.provision, retried as a publish is (RETRYABLE): a clustered server can time out
        an API call (an R3 stream create waits for its peers) or answer 503 while it elects a
        leader, and the call may still have taken effect; the pass is idempotent, so a retry sees
        what is there."""
        async for attempt in self._retrying():
            with attempt:
                return await topo.provision(self.js, cfg or self.cfg.topology, log=log)
        raise AssertionError("unreachable")

    # -- publishing ------------------------------------------------------------------------
    def _headers(self, event: Event | bytes, msg_id: str | None, headers: dict | None) -> dict[str, str]:
        h = dict(event.headers()) if isinstance(event, Event) else {}
        if msg_id is None and isinstance(event, Event):
            msg_id = event.msg_id()
        if msg_id:
            h["Nats-Msg-Id"] = msg_id
        h["Rl-From"] = self.cfg.name
        if headers:
            h.update(headers)
        return h

    def _retrying(self):
        return AsyncRetrying(
            stop=stop_after_attempt(self.cfg.publish_retries),
            reraise=True,
            wait=wait_random_exponential(multiplier=0.1, max=self.cfg.reconnect_wait_max_s),
            retry=retry_if_exception_type(RETRYABLE),
        )

    async def publish(
        self,
        subject: str,
        event: Event | bytes,
        msg_id: str | None = None,
        headers: dict | None = None,
        timeout: float | None = None,
    ) -> api.PubAck:
        """Publish and wait for the JetStream ack (ack.duplicate: deduped by Nats-Msg-Id)."""
        body = encode(event) if isinstance(event, Event) else bytes(event)
        h = self._headers(event, msg_id, headers)
        try:
            async for attempt in self._retrying():
                with attempt:
                    return await self.js.publish(subject, body, timeout=timeout, headers=h)
        except (jse.NoStreamResponseError, nats.errors.NoRespondersError):
            raise PublishError(
                f"no JetStream stream takes subject {subject!r} "
                f"(topology not provisioned, or a typo in the subject?)"
            ) from None
        except RETRYABLE as e:
            raise PublishError(
                f"publish to {subject!r} not acknowledged after {self.cfg.publish_retries} attempts: {e!r}"
            ) from e
        raise AssertionError("unreachable")

    async def publish_many(
        self, items: list[tuple[str, Event | bytes]], *, window: int = 1024
    ) -> list[api.PubAck]:
        """Pipelined publishing: up to `window` un-acked publishes in flight. Items whose ack
        does not arrive are republished one by one (same Nats-Msg-Id, so no duplicates)."""
        acks: list[api.PubAck | None] = [None] * len(items)
        prepared = [
            (s, encode(e) if isinstance(e, Event) else bytes(e), self._headers(e, None, None))
            for s, e in items
        ]
        for start in range(0, len(prepared), window):
            chunk = prepared[start : start + window]
            futs = []
            for s, b, h in chunk:
                try:
                    futs.append(await self.js.publish_async(s, b, headers=h))
                except RETRYABLE:
                    futs.append(None)
            try:
                done = await asyncio.wait_for(
                    asyncio.gather(*[f for f in futs if f is not None], return_exceptions=True),
                    timeout=self.cfg.request_timeout_s,
                )
            except TimeoutError:
                done = [None] * sum(f is not None for f in futs)
            it = iter(done)
            for i, f in enumerate(futs):
                r = next(it) if f is not None else None
                acks[start + i] = r if isinstance(r, api.PubAck) else None
        for i, a in enumerate(acks):  # stragglers: synchronous, retried
            if a is None:
                s, b, h = prepared[i]
                async for attempt in self._retrying():
                    with attempt:
                        acks[i] = await self.js.publish(s, b, headers=h)
        return acks  # type: ignore[return-value]

    # -- consuming -------------------------------------------------------------------------
    async def pull(self, stream: str, durable: str) -> ResilientPull:
        sub = ResilientPull(self, stream, durable)
        await sub.bind()
        return sub

    async def dlq(self, msg: Msg, reason: str, stream: str | None = None) -> api.PubAck:
        """Copy `msg` to rl.dlq.<stream> with the reason and its origin, then term() it."""
        md = msg.metadata
        stream = stream or md.stream
        h = {k: v for k, v in (msg.headers or {}).items() if not k.startswith("Nats-")}
        h.update(
            {
                "Rl-Reason": reason[:1000],
                "Rl-Stream": stream,
                "Rl-Seq": str(md.sequence.stream),
                "Rl-Deliveries": str(md.num_delivered),
                "Rl-Subject": msg.subject,
                "Rl-Consumer": md.consumer or "",
            }
        )
        ack = await self.publish(
            topo.dlq_subject(stream), msg.data, msg_id=f"dlq-{stream}-{md.sequence.stream}", headers=h
        )
        await msg.term()
        metrics.DLQ_PARKED.labels(stream).inc()
        return ack

    # -- KV (rl-control) -------------------------------------------------------------------
    async def _control(self):
        if self._kv is None:
            try:
                self._kv = await self.js.key_value(topo.CONTROL_BUCKET)
            except jse.BucketNotFoundError:
                await self.provision()
                self._kv = await self.js.key_value(topo.CONTROL_BUCKET)
        return self._kv

    async def kv_get(self, key: str) -> bytes | None:
        kv = await self._control()
        try:
            e = await kv.get(key)
        except (jse.KeyNotFoundError, jse.KeyDeletedError):
            return None
        return e.value

    async def kv_entry(self, key: str) -> tuple[bytes | None, int]:
        """(value, revision); (None, 0) when absent."""
        kv = await self._control()
        try:
            e = await kv.get(key)
        except (jse.KeyNotFoundError, jse.KeyDeletedError):
            return None, 0
        return e.value, e.revision

    async def kv_put(self, key: str, value: bytes) -> int:
        return await (await self._control()).put(key, value)

    async def kv_create(self, key: str, value: bytes) -> int:
        try:
            return await (await self._control()).create(key, value)
        except (jse.KeyWrongLastSequenceError, jse.BadRequestError) as e:
            raise KVConflict(f"kv key {key!r} already exists") from e

    async def kv_update(self, key: str, value: bytes, last_rev: int) -> int:
        try:
            return await (await self._control()).update(key, value, last=last_rev)
        except (jse.KeyWrongLastSequenceError, jse.BadRequestError) as e:
            raise KVConflict(f"kv key {key!r} is not at revision {last_rev}") from e

    async def kv_delete(self, key: str, last_rev: int | None = None) -> None:
        try:
            await (await self._control()).delete(key, last=last_rev)
        except (jse.KeyWrongLastSequenceError, jse.BadRequestError) as e:
            raise KVConflict(f"kv key {key!r} is not at revision {last_rev}") from e

    async def kv_watch(self, key: str) -> AsyncIterator[tuple[bytes | None, int]]:
        """Current value first (if any), then every change; deletes yield (None, rev).
        The server-side watcher does not survive a server restart, so after each reconnect it
        is rebuilt; revisions already yielded are skipped, the latest value is never missed."""
        last_rev = 0
        while True:
            gen = self.reconnects
            try:
                watcher = await (await self._control()).watch(key)
            except RETRYABLE + (nats.errors.ConnectionClosedError,) as e:
                if self.nc.is_closed:
                    raise
                log.debug("kv watch setup failed; retrying", key=key, error=repr(e))
                await asyncio.sleep(0.5)
                continue
            try:
                while gen == self.reconnects:
                    try:
                        e = await watcher.updates(timeout=1.0)
                    except (TimeoutError, nats.errors.TimeoutError):
                        continue
                    if e is None or e.revision <= last_rev:  # None: end of initial values
                        continue
                    last_rev = e.revision
                    yield (None if e.operation in ("DEL", "PURGE") else e.value), e.revision
            finally:
                try:
                    await watcher.stop()
                except Exception:
                    pass

    # -- blobs (object store rl-blobs) ------------------------------------------------------
    async def blob_store(self):
        """The object store (created on first use); bus/weights/blobs.py moves blobs through it."""
        if self._obs is None:
            try:
                self._obs = await self.js.object_store(topo.BLOB_BUCKET)
            except (jse.BucketNotFoundError, jse.NotFoundError):
                await self.provision()
                self._obs = await self.js.object_store(topo.BLOB_BUCKET)
        return self._obs

    async def put_blob(self, name: str, data: bytes | bytearray | memoryview) -> str:
        """Store `data` chunked in the object store; returns its sha256 hex digest."""
        return await put_blob(self, name, data)

    async def get_blob(self, name: str) -> bytes:
        """Fetch and verify (sha256 recorded at put); raises BlobError on missing/corrupt."""
        return await get_blob(self, name)

    async def delete_blob(self, name: str) -> None:
        try:
            await (await self.blob_store()).delete(name)
        except jse.NotFoundError:
            pass

    # -- lifecycle ---------------------------------------------------------------------------
    async def close(self) -> None:
        """Flush what is buffered (acks are fire-and-forget publishes), then close."""
        if self.nc.is_closed:
            return
        self.nc._asyncrl_closing = True
        try:
            if self.nc.is_connected:
                await asyncio.wait_for(self.nc.flush(), timeout=5)
        except Exception:
            pass
        try:
            await self.nc.close()
        except OSError as e:  # the broker is already gone: nothing left to flush or tell it
            log.debug("close on a lost connection", error=repr(e))

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
