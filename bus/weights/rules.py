"""What the publisher and the follower agree on (the rules themselves: bus/weights/__init__.py):
the subjects, the codec, the version key, the fields a payload's signed header repeats, and the
version rules a delta or a manifest meets before its payload is read."""

from __future__ import annotations

from typing import Any

import delta_codec
from bus import events

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


def config_dict(model_config: Any) -> dict:
    return model_config.to_dict() if hasattr(model_config, "to_dict") else dict(model_config)


def signed_fields(epoch: int, trainer_id: str, model_config: dict | None = None) -> dict:
    """The event fields a publisher also puts inside the payload's signed container header."""
    d = {"epoch": int(epoch), "trainer_id": trainer_id}
    if model_config is not None:
        d["model_config"] = model_config
    return d


class Refused(Exception):
    """A weight update a follower will not apply: `reason` (a metrics label), and whether the
    follower must resync from the latest keyframe."""

    def __init__(self, reason: str, detail: str, resync: bool):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.resync = reason, detail, resync


def is_replay(ev: events.WeightEvent, target) -> bool:
    """The version rules a delta or a manifest meets before its payload is read: an older epoch
    is refused, a version the target has (same epoch) is a replay to skip (True), and one that
    does not start at the target's version is a gap (resync)."""
    if ev.epoch < target.epoch:
        raise Refused("stale_epoch", f"{ev.msg_id()} from epoch {ev.epoch} < {target.epoch}", resync=False)
    if ev.to_version <= target.version and ev.epoch == target.epoch:
        return True
    if ev.from_version != target.version:
        raise Refused(
            "gap", f"{ev.msg_id()} starts at v{ev.from_version}, target at v{target.version}", resync=True
        )
    return False
