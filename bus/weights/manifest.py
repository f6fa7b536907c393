"""Versions published from shards: N delta parts (one per trainer rank) in the object store and
one signed manifest on WEIGHTS (a `ManifestEvent`).

Trainer side, `ShardedVersion`: the parts of version v (rank order) and what the trainer reads of
them (the digest it records, the changed fraction), published through the one publisher interface
(`WeightPublisher.publish`, bus/weights/publisher.py) by `publish_sharded`: every part is stored
first (`part-e<epoch>-v<version>-r<rank>`), then the manifest (each part's sha256, size and name;
versions; epoch, trainer id and model config in its signed header) goes out through the
publisher's fenced write: the lease CAS, then a write the server refuses once another leader wrote
(Nats-Expected-Last-Sequence). A deposed leader may leave orphan parts in the object store (they
expire with the bucket's TTL), never a manifest on WEIGHTS.

Worker side, WeightFollower checks a ManifestEvent as it checks a delta, with `read_manifest` and
`apply_manifest` from here, in order, nothing written until every check passed:

    epoch <  mine                      -> refused (deposed leader), no resync
    to_version <= mine, same epoch     -> replay, skipped
    from_version != mine               -> gap: resync from the latest keyframe
    payload size / signature / codec   -> refused: resync (as a delta's payload: follower.py)
    manifest malformed, versions or part count differ from the event -> refused: resync
    fields != the manifest's signed header (epoch, trainer id, model config) -> refused
    newer epoch the lease never issued -> refused
    a part missing from the object store, or not the size / sha256 the manifest lists, or
    encoded for another version       -> refused: resync
    then the target applies the parts (any order) all-or-nothing: its state is untouched when
    any part fails (the rows don't tile its tensors, a base digest differs).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from bus import events
from bus.weights.publisher import WeightPublisher
from bus.weights.rules import Refused, config_dict, signed_fields
from delta_codec import Delta, DeltaError, DeltaStats
from delta_codec.errors import NonFiniteError
from delta_codec.sharded import Manifest, check_part, make_manifest, parts_digest


def part_blob_name(epoch: int, version: int, index: int) -> str:
    return f"part-e{int(epoch)}-v{int(version)}-r{int(index)}"


async def publish_sharded(
    pub: WeightPublisher,
    parts: list[bytes],
    *,
    from_version: int,
    to_version: int,
    model_config,
    changed_frac: float = 0.0,
    set_version: bool = True,
) -> events.ManifestEvent:
    """Store the parts, then announce them with one signed manifest through the fenced write."""
    if not parts:
        raise ValueError("a sharded version needs at least one part")
    names = [part_blob_name(pub.epoch, to_version, i) for i in range(len(parts))]
    # every part is in the store before the manifest names it (workers fetch as soon as they see it)
    await asyncio.gather(*(pub.bus.put_blob(n, p) for n, p in zip(names, parts)))
    config = config_dict(model_config)
    manifest = make_manifest(
        parts,
        from_version=from_version,
        to_version=to_version,
        names=names,
        extra=signed_fields(pub.epoch, pub.trainer_id, config),
    )
    return await pub.publish_manifest(manifest, config, changed_frac=changed_frac, set_version=set_version)


@dataclass
class ShardedVersion:
    """A version encoded from shards, as the trainer publishes it (`WeightPublisher.publish`): the
    parts (rank order), the digest the trainer records (delta_codec.sharded.parts_digest), the
    parts' summed stats, and the full state when v is also a keyframe (gathered for it)."""

    parts: list[bytes]
    from_version: int
    to_version: int
    new_digest: str
    stats: DeltaStats
    keyframe: dict | None = None

    @classmethod
    def of(
        cls, parts: list[bytes], from_version: int, to_version: int, keyframe: dict | None = None
    ) -> ShardedVersion:
        deltas = [Delta.from_bytes(p) for p in parts]  # headers only: no tensor is decoded
        st = [d.stats for d in deltas]
        return cls(
            parts,
            from_version,
            to_version,
            parts_digest([d.new_digest for d in deltas]),
            DeltaStats(sum(s.changed for s in st), sum(s.total for s in st), sum(len(p) for p in parts)),
            keyframe,
        )

    @property
    def changed_frac(self) -> float:
        return self.stats.changed_frac

    async def write(self, pub: WeightPublisher, model_config, *, set_version: bool) -> int:
        ev = await publish_sharded(
            pub,
            self.parts,
            from_version=self.from_version,
            to_version=self.to_version,
            model_config=model_config,
            changed_frac=self.changed_frac,
            set_version=set_version,
        )
        return ev.part_bytes


async def fetch_parts(bus, manifest: Manifest) -> dict[int, bytes]:
    """Every part the manifest lists, checked against it (size, sha256, versions). Raises Refused."""
    want = {}
    for p in manifest.parts:
        if not isinstance(p.get("index"), int) or not isinstance(p.get("blob"), str) or p["index"] in want:
            raise Refused(
                "corrupt", f"manifest v{manifest.to_version}: bad part entry {str(p)[:200]}", resync=True
            )
        want[p["index"]] = p["blob"]
    got = await asyncio.gather(*(bus.get_blob(n) for n in want.values()), return_exceptions=True)
    blobs = {}
    for (i, name), data in zip(want.items(), got):
        if isinstance(data, BaseException):
            raise Refused(
                "part",
                f"manifest v{manifest.to_version}: part {i} ({name!r}) cannot be fetched: "
                f"{type(data).__name__}: {data}",
                resync=True,
            )
        try:
            check_part(manifest, i, data)
        except DeltaError as e:
            raise Refused("part", f"manifest v{manifest.to_version}: {e}", resync=True) from None
        blobs[i] = data
    return blobs


def read_manifest(ev: events.ManifestEvent, data: bytes) -> Manifest:
    """The manifest in a ManifestEvent's verified payload, if it is the version and part count the
    event announces; else Refused."""
    try:
        m = Manifest.from_bytes(data)
    except DeltaError as e:
        raise Refused("corrupt", f"{ev.msg_id()}: {e}", resync=True) from None
    if (m.from_version, m.to_version, len(m.parts)) != (ev.from_version, ev.to_version, ev.parts):
        raise Refused(
            "corrupt",
            f"{ev.msg_id()}: manifest says v{m.from_version}->v{m.to_version} in "
            f"{len(m.parts)} parts, the event {ev.parts}",
            resync=True,
        )
    return m


async def apply_manifest(bus, target, ev: events.ManifestEvent, m: Manifest) -> None:
    """The manifest's parts fetched, checked and applied to `target` all-or-nothing; else Refused."""
    mine = getattr(target, "model_config", None)
    if mine and mine != ev.model_config:
        raise Refused("model", f"{ev.msg_id()} is for another model config than the target's", resync=True)
    apply = getattr(target, "apply_parts", None)
    if apply is None:
        raise Refused(
            "unsupported",
            f"{ev.msg_id()}: {type(target).__name__} cannot apply a version published "
            f"from shards; it follows keyframes only",
            resync=True,
        )
    blobs = await fetch_parts(bus, m)
    try:
        await apply(m, blobs, ev.epoch)
    except Exception as e:  # rows that don't tile the state, a base digest, NaN: state unchanged
        reason = "nonfinite" if isinstance(e, NonFiniteError) else "apply"
        raise Refused(reason, f"{ev.msg_id()}: {type(e).__name__}: {e}", resync=True) from None
