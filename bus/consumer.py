"""ConsumerLoop: fetch → decode → handler → ack, with heartbeats, retries and a dead-letter queue.

    handler returns          -> ack
    raises TransientError    -> nak(delay)            (DLQ once deliveries >= max_deliver)
    body fails to decode     -> DLQ with the reason, term   (never crashes the loop)
    handler raises EventError-> DLQ with the reason, term   (bad input: retrying cannot help)
    raises anything else     -> nak(delay); DLQ + term once deliveries >= max_deliver
    while a handler runs     -> in_progress() every ack_wait/3, so long work is not redelivered

It only fetches what it can start now: min(batch, concurrency - running, capacity()).
On stop (stop_event or SIGTERM) it stops fetching, lets running handlers finish within
`grace_s`, and naks what is still running so another consumer picks it up at once.

A process that dies holding a message's last allowed delivery gives no verdict, and the
server stops redelivering it. With `sweep_max_deliveries=True` the loop listens for the
server's MAX_DELIVERIES advisory and parks such messages in DLQ (needs the rights to read
advisories and to get/delete stream messages: give it to one trusted process per stream).
`sweep_stranded` finds the ones given up on while nobody listened (the trainer leader runs
both on SCORED by default).
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import nats.js.errors as jse
from nats.aio.msg import Msg

from bus.events import Event, EventError, decode
from kernel import metrics
from kernel.lifetime import cancel_and_wait
from kernel.log import get_logger

log = get_logger("bus.consumer")


class TransientError(Exception):
    """Retry later: the message is nak'ed with `delay` seconds (None: the loop's default)."""

    def __init__(self, msg: str = "", delay: float | None = None):
        super().__init__(msg)
        self.delay = delay


@dataclass
class HandlerContext:
    msg: Msg
    deliveries: int
    max_deliver: int
    stream: str
    _loop: ConsumerLoop = field(repr=False, default=None)

    @property
    def last_delivery(self) -> bool:
        return self.max_deliver > 0 and self.deliveries >= self.max_deliver

    async def in_progress(self) -> None:
        """Reset the server's ack timer now (the loop also does it every ack_wait/3)."""
        await self.msg.in_progress()


@dataclass
class LoopStats:
    fetched: int = 0
    acked: int = 0
    naks: int = 0
    dlq: int = 0
    malformed: int = 0
    errors: int = 0
    heartbeats: int = 0
    drained_naks: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


Handler = Callable[[Event, HandlerContext], Awaitable[None]]


class ConsumerLoop:
    def __init__(
        self,
        bus,
        stream: str,
        durable: str,
        handler: Handler,
        event_cls: type[Event] | None = None,
        *,
        concurrency: int = 8,
        capacity: Callable[[], int] | None = None,
        batch: int = 64,
        fetch_timeout_s: float = 1.0,
        nak_delay_s: float = 1.0,
        grace_s: float = 10.0,
        handle_signals: bool = True,
        sweep_max_deliveries: bool = False,
    ):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.bus, self.stream, self.durable = bus, stream, durable
        self.handler, self.event_cls = handler, event_cls
        self.concurrency, self.capacity, self.batch = concurrency, capacity, batch
        self.fetch_timeout_s, self.nak_delay_s, self.grace_s = fetch_timeout_s, nak_delay_s, grace_s
        self.handle_signals = handle_signals
        self.sweep_max_deliveries = sweep_max_deliveries  # needs advisory + msg get/delete rights
        self.stats = LoopStats()
        self.active: set[asyncio.Task] = set()
        # id(msg) -> [msg, time of its last heartbeat] for running handlers (Msg is unhashable)
        self.inflight: dict[int, list] = {}
        self.ack_wait_s = 30.0
        self.max_deliver = -1
        self._stop = asyncio.Event()
        self.log = log.bind(stream=stream, durable=durable)

    def stop(self) -> None:
        self._stop.set()

    def room(self) -> int:
        free = self.concurrency - len(self.active)
        cap = self.capacity() if self.capacity is not None else math.inf
        return int(max(0, min(self.batch, free, cap)))

    async def run(self, stop_event: asyncio.Event | None = None) -> LoopStats:
        sub = await self.bus.pull(self.stream, self.durable)
        cfg = (await sub.consumer_info()).config  # the server's values are the truth
        self.ack_wait_s = float(cfg.ack_wait or 30.0)
        self.max_deliver = int(cfg.max_deliver or -1)
        loop = asyncio.get_running_loop()
        installed = False
        # SIGTERM -> drain; unless the process already handles SIGTERM itself (then it is
        # expected to set stop_event), since asyncio keeps only one handler per signal. Any handler
        # (asyncio's included: it installs a no-op C-level handler) shows in signal.getsignal.
        if self.handle_signals and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            try:
                loop.add_signal_handler(signal.SIGTERM, self._stop.set)
                installed = True
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread / platform without signals
        stop_waiter = asyncio.ensure_future(stop_event.wait()) if stop_event else None
        if stop_waiter:
            stop_waiter.add_done_callback(lambda _: self._stop.set())
        self.log.info(
            "consumer loop started",
            ack_wait_s=self.ack_wait_s,
            max_deliver=self.max_deliver,
            concurrency=self.concurrency,
        )
        beats = asyncio.create_task(self._heartbeats())
        sweeper = None
        if self.sweep_max_deliveries:

            def parked():
                self.stats.dlq += 1

            sweeper = await watch_max_deliveries(self.bus, self.stream, self.durable, parked)
        try:
            while not self._stop.is_set():
                n = self.room()
                if n == 0:  # full (or capacity says no): wait for a slot or stop, then re-ask
                    waiters = [*self.active, asyncio.ensure_future(self._stop.wait())]
                    done, pending = await asyncio.wait(
                        waiters, timeout=self.fetch_timeout_s, return_when=asyncio.FIRST_COMPLETED
                    )
                    waiters[-1].cancel()
                    continue
                msgs = await sub.fetch(n, timeout=self.fetch_timeout_s)
                self.stats.fetched += len(msgs)
                if msgs:
                    metrics.observe_pending(msgs[-1], self.stream, self.durable)
                for m in msgs:
                    t = asyncio.create_task(self._handle(m))
                    self.active.add(t)
                    t.add_done_callback(self.active.discard)
                if msgs:  # let the handlers start, so capacity() sees them before we ask again
                    await asyncio.sleep(0)
        finally:
            await self._drain()
            await cancel_and_wait([beats], log=self.log)
            if sweeper is not None:
                try:
                    await sweeper.unsubscribe()
                except Exception:
                    pass  # connection already closed
            if stop_waiter:
                stop_waiter.cancel()
            if installed:
                loop.remove_signal_handler(signal.SIGTERM)
            await sub.unsubscribe()
            self.log.info("consumer loop stopped", **self.stats.as_dict())
        return self.stats

    async def _drain(self) -> None:
        if not self.active:
            return
        self.log.info("draining", running=len(self.active), grace_s=self.grace_s)
        _, pending = await asyncio.wait(set(self.active), timeout=self.grace_s)
        for t in pending:
            t.cancel()  # _handle naks cancelled work so it is redelivered without waiting ack_wait
        if pending:
            await asyncio.wait(pending, timeout=5)

    async def _heartbeats(self) -> None:
        """One ticker for all running handlers (a task per message would cost more than the work):
        every ack_wait/3, in_progress() each message whose last beat is older than that."""
        every = max(self.ack_wait_s / 3, 0.05)
        while True:
            await asyncio.sleep(every / 4)
            now = time.monotonic()
            for key, entry in list(self.inflight.items()):
                msg, last = entry
                if now - last >= every and key in self.inflight:
                    entry[1] = now
                    try:
                        await msg.in_progress()
                        self.stats.heartbeats += 1
                    except Exception as e:  # connection blip: the next beat will try again
                        self.log.debug("in_progress failed", error=repr(e))

    async def _settle(self, coro, what: str) -> None:
        try:
            await coro
        except Exception as e:  # the ack/nak is lost: the message will come back after ack_wait
            self.log.warning(f"{what} failed", error=repr(e))

    async def _to_dlq(self, msg: Msg, reason: str) -> None:
        try:
            await self.bus.dlq(msg, reason, self.stream)
            self.stats.dlq += 1
            self.log.warning("parked in DLQ", reason=reason, seq=msg.metadata.sequence.stream)
        except Exception as e:  # DLQ unreachable: leave it unacked, it comes back
            self.log.error("DLQ publish failed; message left for redelivery", error=repr(e), reason=reason)

    async def _handle(self, msg: Msg) -> None:
        md = msg.metadata
        deliveries = md.num_delivered
        try:
            event = decode(msg.data, self.event_cls)
        except EventError as e:
            self.stats.malformed += 1
            await self._to_dlq(msg, f"malformed: {e}")
            return
        ctx = HandlerContext(
            msg=msg, deliveries=deliveries, max_deliver=self.max_deliver, stream=self.stream, _loop=self
        )
        self.inflight[id(msg)] = [msg, time.monotonic()]
        try:
            await self.handler(event, ctx)
        except asyncio.CancelledError:
            self.stats.drained_naks += 1
            await self._settle(msg.nak(), "nak")
            return
        except EventError as e:  # the handler found the input invalid: retrying cannot help
            self.stats.malformed += 1
            await self._to_dlq(msg, f"invalid: {e}")
            return
        except TransientError as e:
            if ctx.last_delivery:
                await self._to_dlq(msg, f"transient error persisted through {deliveries} deliveries: {e}")
            else:
                self.stats.naks += 1
                await self._settle(msg.nak(delay=e.delay if e.delay is not None else self.nak_delay_s), "nak")
            return
        except Exception as e:
            self.stats.errors += 1
            if ctx.last_delivery:
                await self._to_dlq(msg, f"handler failed {deliveries} times: {type(e).__name__}: {e}")
            else:
                self.log.warning(
                    "handler failed; will retry",
                    error=f"{type(e).__name__}: {e}",
                    deliveries=deliveries,
                    max_deliver=self.max_deliver,
                )
                self.stats.naks += 1
                await self._settle(msg.nak(delay=self.nak_delay_s), "nak")
            return
        finally:
            self.inflight.pop(id(msg), None)
        if not msg.is_acked:  # the handler may have settled it itself (ctx.msg.ack / term)
            await self._settle(msg.ack(), "ack")
        self.stats.acked += 1


async def park_max_delivered(
    bus, stream: str, seq: int, deliveries: int | None = None, consumer: str = "", reason: str = ""
) -> bool:
    """Move message `seq` of `stream` to DLQ and delete it from the stream. For messages whose
    last delivery got no verdict (the process died or hung without heartbeats): the server
    stops redelivering them, so without this they would sit in the work queue forever."""
    from bus import topology as topo

    try:
        raw = await bus.js.get_msg(stream, seq=seq)
    except jse.NotFoundError:
        return False  # already acked / parked by someone else
    h = {k: v for k, v in (raw.headers or {}).items() if not k.startswith("Nats-")}
    h.update(
        {
            "Rl-Reason": reason
            or f"max_deliver reached without a verdict after {deliveries} deliveries "
            f"(consumer died or hung without heartbeats)",
            "Rl-Stream": stream,
            "Rl-Seq": str(seq),
            "Rl-Deliveries": str(deliveries or ""),
            "Rl-Subject": raw.subject or "",
            "Rl-Consumer": consumer,
        }
    )
    await bus.publish(topo.dlq_subject(stream), raw.data or b"", msg_id=f"dlq-{stream}-{seq}", headers=h)
    try:
        await bus.js.delete_msg(stream, seq)
    except jse.NotFoundError:
        pass
    return True


async def watch_max_deliveries(bus, stream: str, durable: str, on_parked=None):
    """Subscribe to the server's MAX_DELIVERIES advisories for stream/durable and park each
    such message in DLQ. Returns the subscription (unsubscribe to stop). Needs the rights to
    subscribe to $JS.EVENT.ADVISORY.> and to get/delete messages of the stream."""

    async def on_advisory(m):
        try:
            adv = json.loads(m.data)
            if await park_max_delivered(
                bus,
                adv.get("stream", stream),
                int(adv["stream_seq"]),
                adv.get("deliveries"),
                adv.get("consumer", durable),
            ):
                log.warning("parked max-delivered message in DLQ", stream=stream, seq=adv["stream_seq"])
                if on_parked:
                    on_parked()
        except Exception as e:  # next advisory (or an operator) will retry; never kill the loop
            log.error("max-deliveries sweep failed", error=repr(e), data=m.data[:200])

    return await bus.nc.subscribe(
        f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{durable}", cb=on_advisory
    )


async def sweep_stranded(bus, stream: str, durable: str, on_parked=None) -> int:
    """Park in DLQ every message of work-queue `stream` that `durable` will never deliver again
    (its max_deliver used up without a verdict: e.g. naks on repeated step-downs, or consumers
    that died holding it while no MAX_DELIVERIES advisory listener was up). Returns how many.

    It decides only while the consumer holds nothing (num_ack_pending == 0: messages waiting for
    a redelivery, nak-delayed or timed out, still count as pending). Then every message still in
    the stream at or below the consumer's delivered sequence was given up on by the server, since
    acked and termed messages leave a work queue. So call it where nobody else is consuming:
    a newly elected single consumer (the trainer leader) before its first fetch."""
    from bus import topology as topo

    info = await bus.js.consumer_info(stream, durable)
    if info.num_ack_pending:
        return 0
    upto, seq, parked = info.delivered.stream_seq, 0, 0
    subject = topo.WORK_STREAMS.get(stream, ">")
    while seq < upto:
        try:
            raw = await bus.js.get_msg(stream, seq=seq + 1, subject=subject, next=True)
        except jse.NotFoundError:
            break
        seq = raw.seq
        if seq > upto:
            break
        if await park_max_delivered(
            bus,
            stream,
            seq,
            info.config.max_deliver,
            durable,
            reason=f"stranded: consumer {durable} used up max_deliver="
            f"{info.config.max_deliver} deliveries without a verdict "
            f"(step-downs, or consumers that died holding it)",
        ):
            parked += 1
            log.warning("parked stranded message in DLQ", stream=stream, seq=seq)
            if on_parked:
                on_parked()
    return parked
