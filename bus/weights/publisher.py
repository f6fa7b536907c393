"""Trainer side of the weight path: `WeightPublisher`, the fenced writer of WEIGHTS, and its one
interface for a trained version, `publish(EncodedVersion)`.

An `EncodedVersion` is what the trainer's encoder made of version v: `GatheredVersion` (here: one
delta_codec Delta of the whole state, v-1 -> v) or `ShardedVersion` (bus/weights/manifest.py: one
delta part per trainer rank and a signed manifest); either may carry the full state as well, to go
out as a keyframe of v right after it. The trainer reads the same fields of both (`new_digest`,
`changed_frac`) and the bytes `publish` returns, and never asks which kind it holds.

Every write is conditional on the server (expected last sequence of WEIGHTS): a deposed leader's
write is refused, see `WeightPublisher._write`. The rules a follower checks: bus/weights/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from nats.js.errors import APIError

import delta_codec
from bus import events
from bus import topology as topo
from bus.errors import PublishError
from bus.weights.rules import CODEC, config_dict, encode_version, signed_fields
from delta_codec import signing
from delta_codec.sharded import Manifest
from kernel import metrics
from kernel.log import get_logger

log = get_logger(__name__)


EXPECTED_LAST_SEQ = "Nats-Expected-Last-Sequence"
WRONG_LAST_SEQUENCE = 10071  # JetStream API error code: the stream's last sequence differs


class Fenced(PublishError):
    """The server refused a WEIGHTS write: the stream moved on since this publisher last wrote
    (a newer leader published), and the publisher may not retry (no fence, or out of tries).
    A PublishError: the trainer goes back to standby on it."""


class EncodedVersion(Protocol):
    """Version `to_version` as the trainer publishes it, whatever its encoding: the fields the
    trainer reads, and `write`, which `WeightPublisher.publish` calls to put the update on WEIGHTS."""

    @property
    def from_version(self) -> int: ...

    @property
    def to_version(self) -> int: ...

    @property
    def new_digest(self) -> str:
        """The digest of version v's bf16 state the trainer records (checkpoint, resume check)."""
        ...

    @property
    def changed_frac(self) -> float:
        """The fraction of the weights that changed from v-1."""
        ...

    @property
    def keyframe(self) -> dict | None:
        """The full state of v when it also goes out as a keyframe, else None."""
        ...

    async def write(self, pub: WeightPublisher, model_config, *, set_version: bool) -> int:
        """The update v-1 -> v on WEIGHTS through `pub`'s fenced write (the KV version bumped when
        `set_version`); -> the bytes of the update (a delta's payload, a sharded version's parts)."""
        ...


@dataclass
class GatheredVersion:
    """A version encoded from the whole state on one process: one delta_codec Delta (v-1 -> v),
    and the state itself when v is also a keyframe."""

    delta: delta_codec.Delta
    keyframe: dict | None = None

    @property
    def from_version(self) -> int:
        return int(self.delta.from_version)

    @property
    def to_version(self) -> int:
        return int(self.delta.to_version)

    @property
    def new_digest(self) -> str:
        return self.delta.new_digest  # the codec hashed every tensor of v: no second pass

    @property
    def changed_frac(self) -> float:
        return self.delta.stats.changed_frac

    async def write(self, pub: WeightPublisher, model_config, *, set_version: bool) -> int:
        return (await pub.publish_delta(self.delta, set_version=set_version)).size


class WeightPublisher:
    """Publishes keyframes and deltas for one trainer epoch (the leader lease revision).

    Every write is conditional on the server (Nats-Expected-Last-Sequence = the WEIGHTS sequence
    this publisher last wrote or read), so once a newer leader has published, a deposed one's
    write is refused by the server however long it was paused. A refused write is retried only
    after `fence()` (the lease's compare-and-set) confirms this publisher still leads; without
    a fence (tools, tests: no lease) it re-reads the stream's position and retries."""

    def __init__(
        self,
        bus,
        epoch: int,
        trainer_id: str,
        signing_key=None,
        inline_max: int = 256 * 1024,
        fence=None,
        before_write=None,
        max_conflicts: int = 5,
    ):
        self.bus, self.epoch, self.trainer_id = bus, int(epoch), trainer_id
        self.signing_key, self.inline_max = signing_key, inline_max
        self.fence = fence  # async (): raises unless we still lead (a server-side CAS)
        self.before_write = before_write  # async (event): test hook, between the fence and the write
        self.max_conflicts = max_conflicts
        self.last_seq: int | None = None  # WEIGHTS sequence this publisher last wrote or read
        self.refusals = 0  # writes the server refused (wrong last sequence)

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
                await self.fence()  # raises once deposed: a refused write is not retried
            if self.before_write is not None:
                await self.before_write(ev)
            try:
                ack = await self.bus.publish(subject, ev, headers={EXPECTED_LAST_SEQ: str(expected)})
            except APIError as e:
                if e.err_code != WRONG_LAST_SEQUENCE:
                    raise
                self.refusals += 1
                seen = await self._stream_last_seq()
                log.warning(
                    "weights write refused by the server: the stream moved on",
                    msg=ev.msg_id(),
                    expected_last_seq=expected,
                    stream_last_seq=seen,
                    epoch=self.epoch,
                )
                expected = seen
                continue
            self.last_seq = max(expected, int(ack.seq))  # a duplicate ack is our own earlier write
            return int(ack.seq)
        raise Fenced(
            f"{ev.msg_id()}: refused by the server ({self.max_conflicts + 1} attempts): WEIGHTS "
            f"moved on since this publisher's last write"
        )

    async def publish(self, version: EncodedVersion, model_config, *, set_version: bool = True) -> int:
        """The one way a trained version goes out, gathered or sharded: its update (a delta, or the
        parts and their manifest), then its keyframe when it carries one (the KV version is bumped
        once, by the update). -> the bytes of the update."""
        nbytes = await version.write(self, model_config, set_version=set_version)
        if version.keyframe is not None:
            await self.publish_keyframe(version.keyframe, version.to_version, model_config, set_version=False)
        return nbytes

    async def publish_keyframe(
        self, state, version: int, model_config, *, set_version: bool = True
    ) -> events.KeyframeEvent:
        kf = delta_codec.make_keyframe(state, version=version)
        config = config_dict(model_config)
        kf.extra = signed_fields(self.epoch, self.trainer_id, config)
        payload = kf.to_bytes()
        inline, blob = await self._place(f"keyframe-e{self.epoch}-v{version}", payload)
        ev = events.KeyframeEvent(
            version=int(version),
            epoch=self.epoch,
            codec=CODEC,
            size=len(payload),
            digest=kf.digest,
            model_config=config,
            signature=self._sign(payload),
            payload=inline,
            blob=blob,
            trainer_id=self.trainer_id,
        )
        await self._write(topo.KEYFRAME_SUBJECT, ev)
        metrics.published("keyframe", len(payload), int(version))
        if set_version:
            await self.set_version(version)
        log.info(
            "keyframe published", version=version, epoch=self.epoch, bytes=len(payload), inline=blob == ""
        )
        return ev

    async def publish_delta(
        self, delta: delta_codec.Delta, epoch: int | None = None, *, set_version: bool = True
    ) -> events.DeltaEvent:
        epoch = self.epoch if epoch is None else int(epoch)
        signed = delta_codec.Delta(
            delta.from_version,
            delta.to_version,
            delta.records,
            extra=signed_fields(epoch, self.trainer_id),
            base_digest=delta.base_digest,
            new_digest=delta.new_digest,
        )
        payload = signed.to_bytes()
        inline, blob = await self._place(f"delta-e{epoch}-v{delta.to_version}", payload)
        stats = delta.stats
        changed_frac = stats.changed / stats.total if stats.total else 0.0
        ev = events.DeltaEvent(
            from_version=int(delta.from_version),
            to_version=int(delta.to_version),
            epoch=epoch,
            codec=CODEC,
            size=len(payload),
            base_digest=delta.base_digest,
            new_digest=delta.new_digest,
            signature=self._sign(payload),
            payload=inline,
            blob=blob,
            changed_frac=changed_frac,
            trainer_id=self.trainer_id,
        )
        await self._write(topo.DELTA_SUBJECT, ev)
        metrics.published("delta", len(payload), int(delta.to_version))
        if set_version:
            await self.set_version(delta.to_version)
        log.debug(
            "delta published",
            to_version=delta.to_version,
            epoch=epoch,
            bytes=len(payload),
            inline=blob == "",
            changed_frac=round(changed_frac, 5),
        )
        return ev

    async def publish_manifest(
        self, manifest: Manifest, model_config: dict, *, changed_frac: float = 0.0, set_version: bool = True
    ) -> events.ManifestEvent:
        """A version published from shards: its manifest, whose parts are already in the object store
        (bus/weights/manifest.py), signed and written like a delta."""
        from_version, to_version = manifest.from_version, manifest.to_version
        payload = manifest.to_bytes()  # signed as a whole by the event's signature, like a delta
        inline, blob = await self._place(f"manifest-e{self.epoch}-v{to_version}", payload)
        part_bytes = sum(p["nbytes"] for p in manifest.parts)
        ev = events.ManifestEvent(
            from_version=int(from_version),
            to_version=int(to_version),
            epoch=self.epoch,
            codec=CODEC,
            size=len(payload),
            signature=self._sign(payload),
            payload=inline,
            blob=blob,
            trainer_id=self.trainer_id,
            parts=len(manifest.parts),
            part_bytes=part_bytes,
            model_config=model_config,
            changed_frac=float(changed_frac),
        )
        await self._write(topo.MANIFEST_SUBJECT, ev)
        metrics.published("manifest", len(payload) + part_bytes, int(to_version))
        if set_version:
            await self.set_version(to_version)
        log.debug(
            "sharded version published",
            to_version=to_version,
            epoch=self.epoch,
            parts=len(manifest.parts),
            bytes=part_bytes,
        )
        return ev

    async def set_version(self, v: int) -> int:
        return await self.bus.kv_put(topo.KEY_VERSION, encode_version(v))
