"""The weight protocol on the bus: how policy versions travel from trainer to workers.

Trainer side, `WeightPublisher`: a keyframe (full bf16 state) every K versions and a sparse
lossless delta for every version in between, signed, inline when small and in the object
store otherwise; then the KV key `version` is bumped so workers can measure their lag.
The epoch, trainer id (and a keyframe's model config) also travel inside the payload's
container header, which the signature covers. Every write is conditional on the server
(expected last sequence of WEIGHTS): a deposed leader's write is refused, see `_write`.

Worker side, `WeightFollower`: each reader keeps its own cursor (a stream sequence) on `WEIGHTS`
and walks the stream in order with direct gets (`next_by_subj`), woken by a plain NATS
subscription, so there is no consumer state on the server to lose on reconnect. Every
update is checked before it touches the weights:

    keyframe   accepted iff newer epoch, or same epoch and newer version; digest + signature;
               fields == the payload's signed header; epoch issued by the KV leader lease
    delta      epoch <  mine                      -> refused (deposed leader), no resync
               to_version <= mine, same epoch     -> replay, skipped
               from_version != mine               -> gap: resync from the latest keyframe
               bad signature / payload / codec    -> refused: resync
               fields != the signed header        -> refused (a forgery: the real one is in the stream)
               newer epoch the lease never issued -> refused
               target refuses (base digest)       -> refused: resync
    manifest   a version published from shards: the delta rules, then every part checked and the
               version applied whole or not at all (bus/weight_manifest.py)

Signing is what stops forgery: without a public key the field check only catches accidental
mismatches (anyone able to publish on rl.weights.> can then build a consistent payload), and
the lease check only bounds the epoch to one the KV has issued.

Resync loads the latest keyframe if it moves us forward and continues from it; otherwise
the reader keeps walking until a newer keyframe shows up. The target (an engine) keeps
generating meanwhile: it only ever sees whole, verified updates.
"""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import delta_codec
from delta_codec import signing
from delta_codec.sharded import apply_parts
from nats.js.errors import APIError, NotFoundError

from . import events, metrics
from . import topology as topo
from .errors import PublishError
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


EXPECTED_LAST_SEQ = "Nats-Expected-Last-Sequence"
WRONG_LAST_SEQUENCE = 10071          # JetStream API error code: the stream's last sequence differs


class Fenced(PublishError):
    """The server refused a WEIGHTS write: the stream moved on since this publisher last wrote
    (a newer leader published), and the publisher may not retry (no fence, or out of tries).
    A PublishError: the trainer goes back to standby on it."""


def signed_fields(epoch: int, trainer_id: str, model_config: dict | None = None) -> dict:
    """The event fields a publisher also puts inside the payload's signed container header."""
    d = {"epoch": int(epoch), "trainer_id": trainer_id}
    if model_config is not None:
        d["model_config"] = model_config
    return d


class WeightPublisher:
    """Publishes keyframes and deltas for one trainer epoch (the leader lease revision).

    Every write is conditional on the server (Nats-Expected-Last-Sequence = the WEIGHTS sequence
    this publisher last wrote or read), so once a newer leader has published, a deposed one's
    write is refused by the server however long it was paused. A refused write is retried only
    after `fence()` (the lease's compare-and-set) confirms this publisher still leads; without
    a fence (tools, tests: no lease) it re-reads the stream's position and retries."""

    def __init__(self, bus, epoch: int, trainer_id: str, signing_key=None, inline_max: int = 256 * 1024,
                 fence=None, before_write=None, max_conflicts: int = 5):
        self.bus, self.epoch, self.trainer_id = bus, int(epoch), trainer_id
        self.signing_key, self.inline_max = signing_key, inline_max
        self.fence = fence                  # async (): raises unless we still lead (a server-side CAS)
        self.before_write = before_write    # async (event): test hook, between the fence and the write
        self.max_conflicts = max_conflicts
        self.last_seq: int | None = None    # WEIGHTS sequence this publisher last wrote or read
        self.refusals = 0                   # writes the server refused (wrong last sequence)

    def _sign(self, payload: bytes) -> bytes:
        return signing.sign(self.signing_key, payload) if self.signing_key is not None else b""

    async def _place(self, name: str, payload: bytes) -> tuple[bytes | None, str]:
        """Inline when small; otherwise the object store (stored before the event is announced)."""
        if len(payload) <= self.inline_max:
            return payload, ""
        await self.bus.put_blob(name, payload)
        return None, name

    async def _stream_last_seq(self) -> int:
        return int((await self.bus.js.stream_info(topo.WEIGHTS)).state.last_seq)

    async def _write(self, subject: str, ev: events.WeightEvent) -> int:
        """Publish `ev` only if WEIGHTS is still where this publisher left it; -> its sequence.
        Order: read the position, fence (lease CAS), write. A pause anywhere in between is caught
        by the CAS or by the server; a position read after a refusal is adopted only once the
        fence passed, so a deposed publisher never holds a fresh one."""
        expected = self.last_seq if self.last_seq is not None else await self._stream_last_seq()
        for _ in range(self.max_conflicts + 1):
            if self.fence is not None:
                await self.fence()           # raises once deposed: a refused write is not retried
            if self.before_write is not None:
                await self.before_write(ev)
            try:
                ack = await self.bus.publish(subject, ev, headers={EXPECTED_LAST_SEQ: str(expected)})
            except APIError as e:
                if e.err_code != WRONG_LAST_SEQUENCE:
                    raise
                self.refusals += 1
                seen = await self._stream_last_seq()
                log.warning("weights write refused by the server: the stream moved on", msg=ev.msg_id(),
                            expected_last_seq=expected, stream_last_seq=seen, epoch=self.epoch)
                expected = seen
                continue
            self.last_seq = max(expected, int(ack.seq))   # a duplicate ack is our own earlier write
            return int(ack.seq)
        raise Fenced(f"{ev.msg_id()}: refused by the server ({self.max_conflicts + 1} attempts): WEIGHTS "
                     f"moved on since this publisher's last write")

    async def publish_keyframe(self, state, version: int, model_config, *, set_version: bool = True) -> events.KeyframeEvent:
        kf = delta_codec.make_keyframe(state, version=version)
        config = _config_dict(model_config)
        kf.extra = signed_fields(self.epoch, self.trainer_id, config)
        payload = kf.to_bytes()
        inline, blob = await self._place(f"keyframe-e{self.epoch}-v{version}", payload)
        ev = events.KeyframeEvent(version=int(version), epoch=self.epoch, codec=CODEC, size=len(payload),
                                  digest=kf.digest, model_config=config, signature=self._sign(payload),
                                  payload=inline, blob=blob, trainer_id=self.trainer_id)
        await self._write(topo.KEYFRAME_SUBJECT, ev)
        metrics.published("keyframe", len(payload), int(version))
        if set_version:
            await self.set_version(version)
        log.info("keyframe published", version=version, epoch=self.epoch, bytes=len(payload), inline=blob == "")
        return ev

    async def publish_delta(self, delta: "delta_codec.Delta", epoch: int | None = None, *,
                            set_version: bool = True) -> events.DeltaEvent:
        epoch = self.epoch if epoch is None else int(epoch)
        signed = delta_codec.Delta(delta.from_version, delta.to_version, delta.records,
                                   extra=signed_fields(epoch, self.trainer_id))
        payload = signed.to_bytes()
        inline, blob = await self._place(f"delta-e{epoch}-v{delta.to_version}", payload)
        stats = delta.stats
        changed_frac = stats.changed / stats.total if stats.total else 0.0
        ev = events.DeltaEvent(from_version=int(delta.from_version), to_version=int(delta.to_version), epoch=epoch,
                               codec=CODEC, size=len(payload), base_digest=delta.base_digest,
                               new_digest=delta.new_digest, signature=self._sign(payload), payload=inline,
                               blob=blob, changed_frac=changed_frac, trainer_id=self.trainer_id)
        await self._write(topo.DELTA_SUBJECT, ev)
        metrics.published("delta", len(payload), int(delta.to_version))
        if set_version:
            await self.set_version(delta.to_version)
        log.debug("delta published", to_version=delta.to_version, epoch=epoch, bytes=len(payload),
                  inline=blob == "", changed_frac=round(changed_frac, 5))
        return ev

    async def set_version(self, v: int) -> int:
        return await self.bus.kv_put(topo.KEY_VERSION, encode_version(v))


def _lease_epoch(value: bytes | None) -> int:
    """The epoch recorded in the KV `leader` value (trainer/lease.py writes it); 0 if unreadable."""
    try:
        e = json.loads(value).get("epoch") if value else 0
    except (ValueError, AttributeError):
        return 0
    return e if isinstance(e, int) and not isinstance(e, bool) and e > 0 else 0


class WeightTarget(Protocol):
    """What a weight follower drives: an engine, or `StateTarget` (a plain state dict)."""
    version: int
    epoch: int

    async def load_keyframe(self, state, version: int, epoch: int) -> None: ...
    async def apply_delta(self, delta: "delta_codec.Delta", epoch: int) -> None: ...
    # optional: async apply_parts(manifest, parts, epoch), a version published from shards
    # (bus/weight_manifest.py), all-or-nothing; a target without it follows keyframes only


class StateTarget:
    """A bf16 state dict kept up to date by a weight follower (calibrate-cost, tests, tools)."""

    def __init__(self) -> None:
        self.state: dict | None = None
        self.version, self.epoch = -1, -1
        self.model_config: dict | None = None     # set by WeightFollower.latest_state from the keyframe

    async def load_keyframe(self, state, version: int, epoch: int) -> None:
        self.state, self.version, self.epoch = state, version, epoch

    async def apply_delta(self, delta, epoch: int) -> None:
        delta_codec.apply_delta(self.state, delta)
        self.version, self.epoch = delta.to_version, epoch

    async def apply_parts(self, manifest, parts: dict[int, bytes], epoch: int) -> None:
        apply_parts(self.state, manifest, parts, expect_from=self.version)    # all-or-nothing
        self.version, self.epoch = manifest.to_version, epoch


@dataclass
class KeyframeUpdate:
    event: events.KeyframeEvent
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


class WeightFollower:
    """Verified policy updates for one reader, in stream order, from its own position."""

    def __init__(self, bus, public_key=None, poll_s: float = 1.0, name: str = ""):
        self.bus, self.public_key, self.poll_s, self.name = bus, public_key, poll_s, name
        self.issued_epoch = 0                        # highest epoch the KV leader lease is known to have issued
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
                log.warning("weights read failed; retrying", error=str(e), follower=self.name)
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

    def _check_signed(self, ev: events.WeightEvent, container) -> None:
        """The event's fields must be the ones inside the payload's (signed) container header.
        With a public key this stops forgery; without one it still catches mismatches."""
        x = container.extra or {}
        want = signed_fields(ev.epoch, ev.trainer_id,
                             ev.model_config if isinstance(ev, (events.KeyframeEvent, events.ManifestEvent)) else None)
        got = {k: x.get(k) for k in want}
        if got != want:
            diff = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
            raise Refused("fields", f"{ev.msg_id()}: event fields disagree with the payload's signed header "
                                    f"(event, payload): {str(diff)[:300]}", resync=False)

    async def _check_epoch(self, ev: events.WeightEvent) -> None:
        """An epoch ahead of what this follower has seen issued is verified against the KV leader
        lease before anything acts on it: epochs the lease never issued are refused."""
        if ev.epoch <= self.issued_epoch:
            return
        try:
            value, rev = await self.bus.kv_entry(topo.KEY_LEADER)
        except Exception as e:
            raise Refused("epoch", f"{ev.msg_id()}: cannot read the leader lease to verify epoch "
                                   f"{ev.epoch}: {e}", resync=True) from None
        if value is None and rev == 0:       # no lease in use (a publisher without a trainer: tools, tests)
            return
        issued = _lease_epoch(value) or rev
        self.issued_epoch = max(self.issued_epoch, issued)
        if ev.epoch > self.issued_epoch:
            raise Refused("epoch", f"{ev.msg_id()}: epoch {ev.epoch} was never issued by the leader lease "
                                   f"(lease epoch {issued}, revision {rev})", resync=False)

    async def _load_keyframe(self, ev: events.KeyframeEvent, seq: int) -> KeyframeUpdate:
        data = await self._payload(ev)
        try:
            kf = delta_codec.Keyframe.from_bytes(data)
            if kf.version != ev.version or (ev.digest and kf.digest != ev.digest):
                raise ValueError(f"payload is v{kf.version} digest {kf.digest}, event says v{ev.version} {ev.digest}")
        except Exception as e:
            raise Refused("corrupt", f"keyframe v{ev.version}: {e}", resync=False) from None
        self._check_signed(ev, kf)
        await self._check_epoch(ev)
        try:
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
                ev = events.decode(raw.data, events.KeyframeEvent)
                return await self._load_keyframe(ev, raw.seq)
            except NotFoundError:
                pass
            except (events.EventError, Refused) as e:
                self._refuse(getattr(e, "reason", "malformed"), str(e))
            except Exception as e:
                log.warning("keyframe read failed; retrying", error=str(e), follower=self.name)
            if not wait:
                return None
            await self._wait(self.poll_s, stop)
        return None

    def _refuse(self, reason: str, detail: str) -> None:
        self.refused[reason] += 1
        metrics.DELTAS_REFUSED.labels(reason).inc()
        self.last_refusal = f"{reason}: {detail}"
        log.warning("weight update refused", reason=reason, detail=detail, follower=self.name)

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
            log.info("resynced from keyframe", version=kf.version, epoch=kf.epoch, follower=self.name)
        else:
            log.info("no newer keyframe yet; waiting for one", version=target.version, follower=self.name)

    async def _step(self, target: WeightTarget, raw) -> None:
        try:
            ev = events.decode(raw.data)
        except events.EventError as e:
            raise Refused("malformed", str(e), resync=False) from None
        if isinstance(ev, events.KeyframeEvent):
            if ev.epoch > target.epoch or (ev.epoch == target.epoch and ev.version > target.version):
                kf = await self._load_keyframe(ev, raw.seq)
                try:
                    await target.load_keyframe(kf.state, kf.version, kf.epoch)
                except Exception as e:   # e.g. a keyframe for another model: refused, state unchanged
                    raise Refused("apply", f"{ev.msg_id()}: {type(e).__name__}: {e}", resync=False) from None
                self.applied["keyframe"] += 1
                metrics.applied("keyframe", raw)
            return
        if isinstance(ev, events.ManifestEvent):          # a version published from shards
            from .weight_manifest import step_manifest
            return await step_manifest(self, target, ev, raw)
        if not isinstance(ev, events.DeltaEvent):
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
        self._check_signed(ev, d)
        if ev.epoch > target.epoch:
            await self._check_epoch(ev)
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
