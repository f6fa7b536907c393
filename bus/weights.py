"""The weight protocol on the bus: how policy versions travel from trainer to workers.

Trainer side, `WeightPublisher`: a keyframe (full bf16 state) every K versions and a sparse
lossless delta for every version in between, signed, inline when small and in the object
store otherwise; then the KV key `version` is bumped so workers can measure their lag.

Worker side, `WeightFeed`: each reader keeps its own cursor (a stream sequence) on `WEIGHTS`
and walks the stream in order with direct gets (`next_by_subj`), woken by a plain NATS
subscription, so there is no consumer state on the server to lose on reconnect. Every
update is checked before it touches the weights:

    keyframe   accepted iff newer epoch, or same epoch and newer version; digest + signature
    delta      epoch <  mine                      -> refused (deposed leader), no resync
               to_version <= mine, same epoch     -> replay, skipped
               from_version != mine               -> gap: resync from the latest keyframe
               bad signature / payload / codec    -> refused: resync
               target refuses (base digest)       -> refused: resync

Resync loads the latest keyframe if it moves us forward and continues from it; otherwise
the reader keeps walking until a newer keyframe shows up. The target (an engine) keeps
generating meanwhile: it only ever sees whole, verified updates.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import delta_codec
from delta_codec import signing
from nats.js.errors import NotFoundError

from . import events, metrics
from . import topology as topo
from .log import get_logger

log = get_logger(__name__)

WEIGHTS_SUBJECTS = "rl.weights.>"
CODEC = delta_codec.CODEC


def encode_version(v: int) -> bytes:
    return str(int(v)).encode()


def parse_version(raw: bytes | None) -> int:
    """KV `version` value -> int (-1 when unset or unreadable)."""
    try:
        return int(raw.decode()) if raw else -1
    except (ValueError, UnicodeDecodeError):
        return -1


def _config_dict(model_config: Any) -> dict:
    return model_config.to_dict() if hasattr(model_config, "to_dict") else dict(model_config)


class WeightPublisher:
    """Publishes keyframes and deltas for one trainer epoch (the leader lease revision)."""

    def __init__(self, bus, epoch: int, trainer_id: str, signing_key=None, inline_max: int = 256 * 1024):
        self.bus, self.epoch, self.trainer_id = bus, int(epoch), trainer_id
        self.signing_key, self.inline_max = signing_key, inline_max

    def _sign(self, payload: bytes) -> bytes:
        return signing.sign(self.signing_key, payload) if self.signing_key is not None else b""

    async def _place(self, name: str, payload: bytes) -> tuple[bytes | None, str]:
        """Inline when small; otherwise the object store (stored before the event is announced)."""
        if len(payload) <= self.inline_max:
            return payload, ""
        await self.bus.put_blob(name, payload)
        return None, name

    async def publish_keyframe(self, state, version: int, model_config, *, set_version: bool = True) -> events.Keyframe:
        kf = delta_codec.make_keyframe(state, version=version)
        payload = kf.to_bytes()
        inline, blob = await self._place(f"keyframe-e{self.epoch}-v{version}", payload)
        ev = events.Keyframe(version=int(version), epoch=self.epoch, codec=CODEC, size=len(payload),
                             digest=kf.digest, model_config=_config_dict(model_config),
                             signature=self._sign(payload), payload=inline, blob=blob, trainer_id=self.trainer_id)
        await self.bus.publish(topo.KEYFRAME_SUBJECT, ev)
        metrics.published("keyframe", len(payload), int(version))
        if set_version:
            await self.set_version(version)
        log.info("keyframe published", version=version, epoch=self.epoch, bytes=len(payload), inline=blob == "")
        return ev

    async def publish_delta(self, delta: "delta_codec.Delta", epoch: int | None = None, *,
                            set_version: bool = True) -> events.Delta:
        epoch = self.epoch if epoch is None else int(epoch)
        payload = delta.to_bytes()
        inline, blob = await self._place(f"delta-e{epoch}-v{delta.to_version}", payload)
        stats = delta.stats
        changed_frac = stats.changed / stats.total if stats.total else 0.0
        ev = events.Delta(from_version=int(delta.from_version), to_version=int(delta.to_version), epoch=epoch,
                          codec=CODEC, size=len(payload), base_digest=delta.base_digest, new_digest=delta.new_digest,
                          signature=self._sign(payload), payload=inline, blob=blob,
                          changed_frac=changed_frac, trainer_id=self.trainer_id)
        await self.bus.publish(topo.DELTA_SUBJECT, ev)
        metrics.published("delta", len(payload), int(delta.to_version))
        if set_version:
            await self.set_version(delta.to_version)
        log.debug("delta published", to_version=delta.to_version, epoch=epoch, bytes=len(payload),
                  inline=blob == "", changed_frac=round(changed_frac, 5))
        return ev

    async def set_version(self, v: int) -> int:
        return await self.bus.kv_put(topo.KEY_VERSION, encode_version(v))


class WeightTarget(Protocol):
    """What a feed drives: an engine, or `StateTarget` (a plain state dict)."""
    version: int
    epoch: int

    async def load_keyframe(self, state, version: int, epoch: int) -> None: ...
    async def apply_delta(self, delta: "delta_codec.Delta", epoch: int) -> None: ...


class StateTarget:
    """A bf16 state dict kept up to date by a feed (calibrate-cost, tests, tools)."""

    def __init__(self) -> None:
        self.state: dict | None = None
        self.version, self.epoch = -1, -1
        self.model_config: dict | None = None     # set by WeightFeed.latest_state from the keyframe

    async def load_keyframe(self, state, version: int, epoch: int) -> None:
        self.state, self.version, self.epoch = state, version, epoch

    async def apply_delta(self, delta, epoch: int) -> None:
        delta_codec.apply_delta(self.state, delta)
        self.version, self.epoch = delta.to_version, epoch


@dataclass
class KeyframeUpdate:
    event: events.Keyframe
    state: dict
    seq: int                      # stream sequence of the keyframe message

    @property
    def version(self) -> int: return self.event.version

    @property
    def epoch(self) -> int: return self.event.epoch

    @property
    def model_config(self) -> dict: return self.event.model_config


class Refused(Exception):
    def __init__(self, reason: str, detail: str, resync: bool):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.resync = reason, detail, resync


class WeightFeed:
    """Verified policy updates for one reader, in stream order, from its own position."""

    def __init__(self, bus, public_key=None, poll_s: float = 1.0, name: str = ""):
        self.bus, self.public_key, self.poll_s, self.name = bus, public_key, poll_s, name
        self.refused: Counter[str] = Counter()       # reason -> count
        self.applied = Counter()                     # "delta" / "keyframe" / "replay"
        self.resyncs = 0
        self.last_refusal = ""
        self.cursor = 0                              # last stream sequence consumed
        self._wake = asyncio.Event()
        self._sub = None

    # -- reading the stream ------------------------------------------------------------
    async def _ensure_wakeup(self) -> None:
        if self._sub is None:
            async def on_msg(_msg):
                self._wake.set()
            # a regional source (bus.regions.WeightSource) wakes us when its mirror stores a message
            subscribe = getattr(self.bus, "subscribe_weights", None)
            self._sub = await (subscribe(on_msg) if subscribe is not None
                               else self.bus.nc.subscribe(WEIGHTS_SUBJECTS, cb=on_msg))

    async def _wait(self, timeout: float, stop: asyncio.Event | None = None) -> bool:
        """Until a WEIGHTS message is published, `stop` is set, or `timeout` (a missed wakeup).
        True when woken by a publish."""
        waits = [asyncio.ensure_future(self._wake.wait())]
        if stop is not None:
            waits.append(asyncio.ensure_future(stop.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self._wake.is_set()

    LAG_RETRY_S = 0.005       # first re-read after a wake-up that found nothing; doubles up to poll_s

    async def _next_msg(self, stop: asyncio.Event | None):
        """The first WEIGHTS message after the cursor; waits for one. None when stopped.
        Read by sequence, never assumed: a wake-up says a message was published somewhere, not
        that the stream read here holds it yet (a region's mirror lags the hub's publish), so a
        read after a wake-up that finds nothing is retried soon, backing off, not after poll_s."""
        await self._ensure_wakeup()
        after_wake, backoff = False, self.LAG_RETRY_S
        while stop is None or not stop.is_set():
            self._wake.clear()
            try:
                return await self.bus.js.get_msg(topo.WEIGHTS, seq=self.cursor + 1,
                                                 subject=WEIGHTS_SUBJECTS, next=True)
            except NotFoundError:
                pass
            except Exception as e:  # broker restart / reconnect: retry after a beat
                log.warning("weights read failed; retrying", error=str(e), feed=self.name)
            if after_wake and backoff < self.poll_s:
                timeout, backoff = backoff, backoff * 2
            else:
                timeout, backoff = self.poll_s, self.LAG_RETRY_S
            woke = await self._wait(timeout, stop)
            after_wake = woke or (after_wake and backoff < self.poll_s)
        return None

    async def _payload(self, ev) -> bytes:
        if ev.codec != CODEC:
            raise Refused("codec", f"{ev.msg_id()} uses codec {ev.codec!r}, this build reads {CODEC!r}", resync=True)
        try:
            data = ev.payload if ev.payload is not None else await self.bus.get_blob(ev.blob)
        except Exception as e:
            raise Refused("payload", f"cannot fetch blob {ev.blob!r}: {e}", resync=True) from None
        if len(data) != ev.size:
            raise Refused("payload", f"{len(data)} bytes, announced {ev.size}", resync=True)
        if self.public_key is not None:
            if not ev.signature:
                raise Refused("signature", f"{ev.msg_id()} is unsigned", resync=True)
            try:
                signing.verify(self.public_key, data, ev.signature)
            except Exception as e:
                raise Refused("signature", f"{ev.msg_id()}: {e}", resync=True) from None
        return data

    async def _load_keyframe(self, ev: events.Keyframe, seq: int) -> KeyframeUpdate:
        data = await self._payload(ev)
        try:
            kf = delta_codec.Keyframe.from_bytes(data)
            if kf.version != ev.version or (ev.digest and kf.digest != ev.digest):
                raise ValueError(f"payload is v{kf.version} digest {kf.digest}, event says v{ev.version} {ev.digest}")
            state = delta_codec.load_keyframe(kf)          # checks every tensor's digest
        except Exception as e:
            raise Refused("corrupt", f"keyframe v{ev.version}: {e}", resync=False) from None
        return KeyframeUpdate(ev, state, seq)

    async def latest_keyframe(self, wait: bool = True, stop: asyncio.Event | None = None) -> KeyframeUpdate | None:
        """The newest valid keyframe on WEIGHTS (waits for one to exist when `wait`)."""
        await self._ensure_wakeup()
        while stop is None or not stop.is_set():
            self._wake.clear()
            try:
                raw = await self.bus.js.get_last_msg(topo.WEIGHTS, topo.KEYFRAME_SUBJECT)
                ev = events.decode(raw.data, events.Keyframe)
                return await self._load_keyframe(ev, raw.seq)
            except NotFoundError:
                pass
            except (events.EventError, Refused) as e:
                self._refuse(getattr(e, "reason", "malformed"), str(e))
            except Exception as e:
                log.warning("keyframe read failed; retrying", error=str(e), feed=self.name)
            if not wait:
                return None
            await self._wait(self.poll_s, stop)
        return None

    def _refuse(self, reason: str, detail: str) -> None:
        self.refused[reason] += 1
        metrics.DELTAS_REFUSED.labels(reason).inc()
        self.last_refusal = f"{reason}: {detail}"
        log.warning("weight update refused", reason=reason, detail=detail, feed=self.name)

    # -- following ---------------------------------------------------------------------
    async def _resync(self, target: WeightTarget) -> None:
        """Jump to the latest keyframe if it moves the target forward; else keep walking."""
        self.resyncs += 1
        kf = await self.latest_keyframe(wait=False)
        if kf is not None and (kf.epoch > target.epoch or (kf.epoch == target.epoch and kf.version > target.version)):
            try:
                await target.load_keyframe(kf.state, kf.version, kf.epoch)
            except Exception as e:
                self._refuse("apply", f"{kf.event.msg_id()}: {type(e).__name__}: {e}")
                return
            self.cursor = kf.seq
            self.applied["keyframe"] += 1
            log.info("resynced from keyframe", version=kf.version, epoch=kf.epoch, feed=self.name)
        else:
            log.info("no newer keyframe yet; waiting for one", version=target.version, feed=self.name)

    async def _step(self, target: WeightTarget, raw) -> None:
        try:
            ev = events.decode(raw.data)
        except events.EventError as e:
            raise Refused("malformed", str(e), resync=False) from None
        if isinstance(ev, events.Keyframe):
            if ev.epoch > target.epoch or (ev.epoch == target.epoch and ev.version > target.version):
                kf = await self._load_keyframe(ev, raw.seq)
                try:
                    await target.load_keyframe(kf.state, kf.version, kf.epoch)
                except Exception as e:   # e.g. a keyframe for another model: refused, state unchanged
                    raise Refused("apply", f"{ev.msg_id()}: {type(e).__name__}: {e}", resync=False) from None
                self.applied["keyframe"] += 1
                metrics.applied("keyframe", raw)
            return
        if not isinstance(ev, events.Delta):
            raise Refused("malformed", f"unexpected {ev.KIND} on WEIGHTS", resync=False)
        if ev.epoch < target.epoch:
            raise Refused("stale_epoch", f"{ev.msg_id()} from epoch {ev.epoch} < {target.epoch}", resync=False)
        if ev.to_version <= target.version and ev.epoch == target.epoch:
            self.applied["replay"] += 1
            return
        if ev.from_version != target.version:
            raise Refused("gap", f"{ev.msg_id()} starts at v{ev.from_version}, target at v{target.version}",
                          resync=True)
        data = await self._payload(ev)
        try:
            d = delta_codec.Delta.from_bytes(data)
        except Exception as e:
            raise Refused("corrupt", f"{ev.msg_id()}: {e}", resync=True) from None
        if (d.from_version, d.to_version) != (ev.from_version, ev.to_version):
            raise Refused("corrupt", f"{ev.msg_id()}: payload says v{d.from_version}->v{d.to_version}", resync=True)
        if ev.base_digest and (d.base_digest, d.new_digest) != (ev.base_digest, ev.new_digest):
            raise Refused("digest", f"{ev.msg_id()}: payload digests differ from the announced ones", resync=True)
        try:
            await target.apply_delta(d, ev.epoch)
        except Exception as e:  # base digest mismatch, engine refusal: state unchanged
            raise Refused("apply", f"{ev.msg_id()}: {type(e).__name__}: {e}", resync=True) from None
        self.applied["delta"] += 1
        metrics.applied("delta", raw)

    async def follow(self, target: WeightTarget, stop: asyncio.Event, start: KeyframeUpdate | None = None,
                     resume: bool = False, on_update=None) -> None:
        """Keep `target` on the newest policy until `stop` is set: from `start` (default: the
        latest keyframe), or with `resume` from where this feed stopped last time.
        `on_update(version, epoch)` (async) runs after each update the target took."""
        if not resume:
            if start is None:
                start = await self.latest_keyframe(wait=True, stop=stop)
                if start is None:
                    return
            if (target.version, target.epoch) != (start.version, start.epoch):
                await target.load_keyframe(start.state, start.version, start.epoch)
            self.cursor = start.seq
        while not stop.is_set():
            raw = await self._next_msg(stop)
            if raw is None:
                break
            self.cursor = raw.seq
            before = (target.version, target.epoch)
            await self._apply_or_refuse(target, raw)
            if on_update is not None and (target.version, target.epoch) != before:
                await on_update(target.version, target.epoch)

    async def latest_state(self, stop: asyncio.Event | None = None) -> StateTarget:
        """Latest keyframe plus every delta after it, applied to a plain state dict."""
        target = StateTarget()
        kf = await self.latest_keyframe(wait=True, stop=stop)
        if kf is None:
            return target
        await target.load_keyframe(kf.state, kf.version, kf.epoch)
        target.model_config = kf.model_config
        self.cursor = kf.seq
        while True:
            try:
                raw = await self.bus.js.get_msg(topo.WEIGHTS, seq=self.cursor + 1, subject=WEIGHTS_SUBJECTS, next=True)
            except NotFoundError:
                return target
            self.cursor = raw.seq
            await self._apply_or_refuse(target, raw)

    async def _apply_or_refuse(self, target, raw) -> None:
        """One WEIGHTS message: applied, or refused with its reason (and a resync when needed)."""
        try:
            await self._step(target, raw)
        except Refused as e:
            self._refuse(e.reason, e.detail)
            if e.resync:
                await self._resync(target)

    def stats(self) -> dict:
        return {"refused": dict(self.refused), "applied": dict(self.applied), "resyncs": self.resyncs,
                "cursor": self.cursor, "last_refusal": self.last_refusal}

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
            self._sub = None
