"""Versions published from shards: N delta parts (one per trainer rank) in the object store and
one signed manifest on WEIGHTS (a `ManifestEvent`).

Trainer side, `publish_sharded`: every part is stored first (`part-e<epoch>-v<version>-r<rank>`),
then the manifest (each part's sha256, size and name; versions; epoch, trainer id and model
config in its signed header) goes out through the publisher's fenced write: the lease CAS, then
a write the server refuses once another leader wrote (Nats-Expected-Last-Sequence). A deposed
leader may leave orphan parts in the object store (they expire with the bucket's TTL), never a
manifest on WEIGHTS.

Worker side, `step_manifest` (WeightFollower dispatches a ManifestEvent here), in order, nothing
written until every check passed:

    epoch <  mine                      -> refused (deposed leader), no resync
    to_version <= mine, same epoch     -> replay, skipped
    from_version != mine               -> gap: resync from the latest keyframe
    payload size / signature / codec   -> refused: resync (WeightFollower._payload)
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
from typing import TYPE_CHECKING

from delta_codec import DeltaError
from delta_codec.errors import NonFiniteError
from delta_codec.sharded import Manifest, check_part, make_manifest

from bus import events, metrics
from bus import topology as topo
from bus.log import get_logger
from bus.weights import CODEC, Refused, WeightPublisher, _config_dict, is_replay, signed_fields

if TYPE_CHECKING:
    from bus.weight_follower import WeightFollower

log = get_logger(__name__)


def part_blob_name(epoch: int, version: int, index: int) -> str:
    return f"part-e{int(epoch)}-v{int(version)}-r{int(index)}"


async def publish_sharded(pub: "WeightPublisher", parts: list[bytes], *, from_version: int, to_version: int,
                          model_config, changed_frac: float = 0.0, set_version: bool = True) -> events.ManifestEvent:
    """Store the parts, then announce them with one signed manifest through the fenced write."""
    if not parts:
        raise ValueError("a sharded version needs at least one part")
    names = [part_blob_name(pub.epoch, to_version, i) for i in range(len(parts))]
    # every part is in the store before the manifest names it (workers fetch as soon as they see it)
    await asyncio.gather(*(pub.bus.put_blob(n, p) for n, p in zip(names, parts)))
    config = _config_dict(model_config)
    manifest = make_manifest(parts, from_version=from_version, to_version=to_version, names=names,
                             extra=signed_fields(pub.epoch, pub.trainer_id, config))
    payload = manifest.to_bytes()           # signed as a whole by the event's signature, like a delta
    inline, blob = await pub._place(f"manifest-e{pub.epoch}-v{to_version}", payload)
    part_bytes = sum(len(p) for p in parts)
    ev = events.ManifestEvent(from_version=int(from_version), to_version=int(to_version), epoch=pub.epoch,
                              codec=CODEC, size=len(payload), signature=pub._sign(payload), payload=inline,
                              blob=blob, trainer_id=pub.trainer_id, parts=len(parts), part_bytes=part_bytes,
                              model_config=config, changed_frac=float(changed_frac))
    await pub._write(topo.MANIFEST_SUBJECT, ev)
    metrics.published("manifest", len(payload) + part_bytes, int(to_version))
    if set_version:
        await pub.set_version(to_version)
    log.debug("sharded version published", to_version=to_version, epoch=pub.epoch, parts=len(parts),
              bytes=part_bytes)
    return ev


async def fetch_parts(bus, manifest: Manifest) -> dict[int, bytes]:
    """Every part the manifest lists, checked against it (size, sha256, versions). Raises Refused."""
    want = {}
    for p in manifest.parts:
        if not isinstance(p.get("index"), int) or not isinstance(p.get("blob"), str) or p["index"] in want:
            raise Refused("corrupt", f"manifest v{manifest.to_version}: bad part entry {str(p)[:200]}", resync=True)
        want[p["index"]] = p["blob"]
    got = await asyncio.gather(*(bus.get_blob(n) for n in want.values()), return_exceptions=True)
    blobs = {}
    for (i, name), data in zip(want.items(), got):
        if isinstance(data, BaseException):
            raise Refused("part", f"manifest v{manifest.to_version}: part {i} ({name!r}) cannot be fetched: "
                                  f"{type(data).__name__}: {data}", resync=True)
        try:
            check_part(manifest, i, data)
        except DeltaError as e:
            raise Refused("part", f"manifest v{manifest.to_version}: {e}", resync=True) from None
        blobs[i] = data
    return blobs


async def step_manifest(f: "WeightFollower", target, ev: events.ManifestEvent, raw) -> None:
    """One ManifestEvent for `target`: applied whole, skipped as a replay, or Refused."""
    if is_replay(ev, target):
        f.applied["replay"] += 1
        return
    data = await f._payload(ev)             # codec, size, signature over the manifest bytes
    try:
        m = Manifest.from_bytes(data)
    except DeltaError as e:
        raise Refused("corrupt", f"{ev.msg_id()}: {e}", resync=True) from None
    if (m.from_version, m.to_version, len(m.parts)) != (ev.from_version, ev.to_version, ev.parts):
        raise Refused("corrupt", f"{ev.msg_id()}: manifest says v{m.from_version}->v{m.to_version} in "
                                 f"{len(m.parts)} parts, the event {ev.parts}", resync=True)
    f._check_signed(ev, m)
    if ev.epoch > target.epoch:
        await f._check_epoch(ev)
    mine = getattr(target, "model_config", None)
    if mine and mine != ev.model_config:
        raise Refused("model", f"{ev.msg_id()} is for another model config than the target's", resync=True)
    apply = getattr(target, "apply_parts", None)
    if apply is None:
        raise Refused("unsupported", f"{ev.msg_id()}: {type(target).__name__} cannot apply a version published "
                                     f"from shards; it follows keyframes only", resync=True)
    blobs = await fetch_parts(f.bus, m)
    try:
        await apply(m, blobs, ev.epoch)
    except Exception as e:                  # rows that don't tile the state, a base digest, NaN: state unchanged
        reason = "nonfinite" if isinstance(e, NonFiniteError) else "apply"
        raise Refused(reason, f"{ev.msg_id()}: {type(e).__name__}: {e}", resync=True) from None
    f.applied["manifest"] += 1
    metrics.applied("manifest", raw)
