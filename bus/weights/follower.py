"""The worker side of the weight path (bus/weights/__init__.py has the rules): `WeightFollower` walks
WEIGHTS from its own cursor and hands each verified update to a target (an engine, or
`StateTarget`, a plain state dict); a refused update never touches the target."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from nats.js.errors import NotFoundError

import delta_codec
from bus import events
from bus import topology as topo
from bus.weights.manifest import apply_manifest, read_manifest
from bus.weights.rules import CODEC, WEIGHTS_SUBJECTS, Refused, is_replay, signed_fields
from delta_codec import signing
from delta_codec.errors import NonFiniteError
from delta_codec.sharded import apply_parts
from kernel import metrics
from kernel.log import get_logger

log = get_logger(__name__)


def _lease_epoch(value: bytes | None) -> int:
    """The epoch recorded in the KV `leader` value (trainer/lease.py writes it); 0 if unreadable."""
    try:
        e = json.loads(value).get("epoch") if value else 0
    except (ValueError, AttributeError):
        return 0
    return e if isinstance(e, int) and not isinstance(e, bool) and e > 0 else 0


def _apply_reason(e: BaseException, default: str) -> str:
    """The refusal reason of an update that failed to apply: `nonfinite` when its result held
    NaN or ±inf (delta_codec.NonFiniteError), else `default`."""
    return "nonfinite" if isinstance(e, NonFiniteError) else default


class WeightTarget(Protocol):
    """What a weight follower drives: an engine, or `StateTarget` (a plain state dict)."""

    version: int
    epoch: int

    async def load_keyframe(self, state, version: int, epoch: int) -> None: ...
    async def apply_delta(self, delta: delta_codec.Delta, epoch: int) -> None: ...

    # optional: async apply_parts(manifest, parts, epoch), a version published from shards
    # (bus/weights/manifest.py), all-or-nothing; a target without it follows keyframes only


class StateTarget:
    """A bf16 state dict kept up to date by a weight follower (calibrate-cost, tests, tools)."""

    def __init__(self) -> None:
        self.state: dict | None = None
        self.version, self.epoch = -1, -1
        self.model_config: dict | None = None  # set by WeightFollower.latest_state from the keyframe

    async def load_keyframe(self, state, version: int, epoch: int) -> None:
        self.state, self.version, self.epoch = state, version, epoch

    async def apply_delta(self, delta, epoch: int) -> None:
        delta_codec.apply_delta(self.state, delta, finite=True)  # NaN/±inf result: refused, unchanged
        self.version, self.epoch = delta.to_version, epoch

    async def apply_parts(self, manifest, parts: dict[int, bytes], epoch: int) -> None:
        apply_parts(self.state, manifest, parts, expect_from=self.version, finite=True)  # all-or-nothing
        self.version, self.epoch = manifest.to_version, epoch


@dataclass
class KeyframeUpdate:
    event: events.KeyframeEvent
    state: dict
    seq: int  # stream sequence of the keyframe message

    @property
    def version(self) -> int:
        return self.event.version

    @property
    def epoch(self) -> int:
        return self.event.epoch

    @property
    def model_config(self) -> dict:
        return self.event.model_config


class WeightFollower:
    """Verified policy updates for one reader, in stream order, from its own position."""

    def __init__(self, bus, public_key=None, poll_s: float = 1.0, name: str = ""):
        self.bus, self.public_key, self.poll_s, self.name = bus, public_key, poll_s, name
        # unsigned: whoever can publish on WEIGHTS decides this process's weights; say so loudly
        metrics.WEIGHTS_UNSIGNED.set(0 if public_key is not None else 1)
        if public_key is None:
            log.warning(
                "following weights WITHOUT signature checks: no public key configured "
                "(workers: [worker.weights] public_key / ASYNCRL_WEIGHTS__PUBLIC_KEY)",
                follower=name,
            )
        self.issued_epoch = 0  # highest epoch the KV leader lease is known to have issued
        self.refused: Counter[str] = Counter()  # reason -> count
        self.applied = Counter()  # "delta" / "keyframe" / "replay"
        self.resyncs = 0
        self.last_refusal = ""
        self.cursor = 0  # last stream sequence consumed
        self._wake = asyncio.Event()
        self._sub = None

    # -- reading the stream ------------------------------------------------------------
    async def _ensure_wakeup(self) -> None:
        if self._sub is None:

            async def on_msg(_msg):
                self._wake.set()

            # a regional source (bus.weights.regions.WeightSource) wakes us when its mirror stores a message
            subscribe = getattr(self.bus, "subscribe_weights", None)
            self._sub = await (
                subscribe(on_msg)
                if subscribe is not None
                else self.bus.nc.subscribe(WEIGHTS_SUBJECTS, cb=on_msg)
            )

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

    LAG_RETRY_S = 0.005  # first re-read after a wake-up that found nothing; doubles up to poll_s

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
                return await self.bus.js.get_msg(
                    topo.WEIGHTS, seq=self.cursor + 1, subject=WEIGHTS_SUBJECTS, next=True
                )
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
            raise Refused(
                "codec", f"{ev.msg_id()} uses codec {ev.codec!r}, this build reads {CODEC!r}", resync=True
            )
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
        want = signed_fields(
            ev.epoch,
            ev.trainer_id,
            ev.model_config if isinstance(ev, (events.KeyframeEvent, events.ManifestEvent)) else None,
        )
        got = {k: x.get(k) for k in want}
        if got != want:
            diff = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
            raise Refused(
                "fields",
                f"{ev.msg_id()}: event fields disagree with the payload's signed header "
                f"(event, payload): {str(diff)[:300]}",
                resync=False,
            )

    async def _check_epoch(self, ev: events.WeightEvent) -> None:
        """An epoch ahead of what this follower has seen issued is verified against the KV leader
        lease before anything acts on it: epochs the lease never issued are refused."""
        if ev.epoch <= self.issued_epoch:
            return
        try:
            value, rev = await self.bus.kv_entry(topo.KEY_LEADER)
        except Exception as e:
            raise Refused(
                "epoch",
                f"{ev.msg_id()}: cannot read the leader lease to verify epoch {ev.epoch}: {e}",
                resync=True,
            ) from None
        if value is None and rev == 0:  # no lease in use (a publisher without a trainer: tools, tests)
            return
        issued = _lease_epoch(value) or rev
        self.issued_epoch = max(self.issued_epoch, issued)
        if ev.epoch > self.issued_epoch:
            raise Refused(
                "epoch",
                f"{ev.msg_id()}: epoch {ev.epoch} was never issued by the leader lease "
                f"(lease epoch {issued}, revision {rev})",
                resync=False,
            )

    async def _load_keyframe(self, ev: events.KeyframeEvent, seq: int) -> KeyframeUpdate:
        data = await self._payload(ev)
        try:
            kf = delta_codec.Keyframe.from_bytes(data)
            if kf.version != ev.version or (ev.digest and kf.digest != ev.digest):
                raise ValueError(
                    f"payload is v{kf.version} digest {kf.digest}, event says v{ev.version} {ev.digest}"
                )
        except Exception as e:
            raise Refused("corrupt", f"keyframe v{ev.version}: {e}", resync=False) from None
        self._check_signed(ev, kf)
        await self._check_epoch(ev)
        try:
            state = delta_codec.load_keyframe(kf, finite=True)  # every tensor's digest; no NaN/±inf
        except Exception as e:
            raise Refused(_apply_reason(e, "corrupt"), f"keyframe v{ev.version}: {e}", resync=False) from None
        return KeyframeUpdate(ev, state, seq)

    async def latest_keyframe(
        self, wait: bool = True, stop: asyncio.Event | None = None
    ) -> KeyframeUpdate | None:
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
        if kf is not None and (
            kf.epoch > target.epoch or (kf.epoch == target.epoch and kf.version > target.version)
        ):
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
                except Exception as e:  # e.g. a keyframe for another model: refused, state unchanged
                    raise Refused("apply", f"{ev.msg_id()}: {type(e).__name__}: {e}", resync=False) from None
                self.applied["keyframe"] += 1
                metrics.applied("keyframe", raw)
            return
        if isinstance(ev, events.ManifestEvent):  # a version published from shards
            return await self._step_manifest(target, ev, raw)
        if not isinstance(ev, events.DeltaEvent):
            raise Refused("malformed", f"unexpected {ev.KIND} on WEIGHTS", resync=False)
        if is_replay(ev, target):
            self.applied["replay"] += 1
            return
        data = await self._payload(ev)
        try:
            d = delta_codec.Delta.from_bytes(data)
        except Exception as e:
            raise Refused("corrupt", f"{ev.msg_id()}: {e}", resync=True) from None
        if (d.from_version, d.to_version) != (ev.from_version, ev.to_version):
            raise Refused(
                "corrupt", f"{ev.msg_id()}: payload says v{d.from_version}->v{d.to_version}", resync=True
            )
        if ev.base_digest and (d.base_digest, d.new_digest) != (ev.base_digest, ev.new_digest):
            raise Refused(
                "digest", f"{ev.msg_id()}: payload digests differ from the announced ones", resync=True
            )
        self._check_signed(ev, d)
        if ev.epoch > target.epoch:
            await self._check_epoch(ev)
        try:
            await target.apply_delta(d, ev.epoch)
        except Exception as e:  # base digest mismatch, NaN/±inf result, engine refusal: state unchanged
            raise Refused(
                _apply_reason(e, "apply"), f"{ev.msg_id()}: {type(e).__name__}: {e}", resync=True
            ) from None
        self.applied["delta"] += 1
        metrics.applied("delta", raw)

    async def _step_manifest(self, target: WeightTarget, ev: events.ManifestEvent, raw) -> None:
        """A version published from shards (bus/weights/manifest.py): a delta's checks, then its parts."""
        if is_replay(ev, target):
            self.applied["replay"] += 1
            return
        m = read_manifest(ev, await self._payload(ev))  # codec, size, signature over the manifest bytes
        self._check_signed(ev, m)
        if ev.epoch > target.epoch:
            await self._check_epoch(ev)
        await apply_manifest(self.bus, target, ev, m)
        self.applied["manifest"] += 1
        metrics.applied("manifest", raw)

    async def follow(
        self,
        target: WeightTarget,
        stop: asyncio.Event,
        start: KeyframeUpdate | None = None,
        resume: bool = False,
        on_update=None,
    ) -> None:
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
                raw = await self.bus.js.get_msg(
                    topo.WEIGHTS, seq=self.cursor + 1, subject=WEIGHTS_SUBJECTS, next=True
                )
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
        return {
            "refused": dict(self.refused),
            "applied": dict(self.applied),
            "resyncs": self.resyncs,
            "cursor": self.cursor,
            "last_refusal": self.last_refusal,
        }

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
            self._sub = None
