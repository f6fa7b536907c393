"""Observers of a running fleet: the version line (gaps, forks, late epochs), the leader lease,
first publications after a death, and what processes wrote to their logs and heartbeats."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

from nats.js.errors import NotFoundError

from bus import topology as topo
from bus.events import DeltaEvent, Heartbeat, KeyframeEvent, ManifestEvent, decode
from trainer.lease import parse_lease

from .fleet import ChaosError, Fleet
from .params import BATCH_GROUPS


def version_line(events) -> dict:
    """No gap, no fork: every version 1..max reached by some delta, and each version has one
    digest across all epochs' deltas and keyframes. Deltas from an epoch older than a keyframe
    already in the stream are 'late' (a deposed leader woke up): workers refuse them. A manifest
    (a version published from shards) counts as a delta; its digest is per part, so a fork
    between manifests shows as manifests of one version from two epochs."""
    digests: dict[int, set] = {}
    manifests: dict[int, set] = {}
    newest_epoch, late = 0, 0
    for e in events:
        if isinstance(e, KeyframeEvent):
            digests.setdefault(e.version, set()).add(e.digest)
            newest_epoch = max(newest_epoch, e.epoch)
        elif isinstance(e, DeltaEvent):
            digests.setdefault(e.to_version, set()).add(e.new_digest)
            late += e.epoch < newest_epoch
        elif isinstance(e, ManifestEvent):
            manifests.setdefault(e.to_version, set()).add(e.epoch)
            late += e.epoch < newest_epoch
    top = max([*digests, *manifests], default=0)
    # a version is out once a delta or a keyframe carries it (a new leader's first keyframe can be
    # the only announcement of a version its deposed predecessor checkpointed but never published)
    reached = {e.to_version for e in events if isinstance(e, (DeltaEvent, ManifestEvent))} | {
        e.version for e in events if isinstance(e, KeyframeEvent)
    }
    first = min(
        (e.from_version for e in events if isinstance(e, (DeltaEvent, ManifestEvent))), default=0
    )  # WEIGHTS keeps the last N
    return {
        "top": top,
        "gaps": sorted(set(range(first + 1, top + 1)) - reached),
        "forks": sorted(
            {v for v, d in digests.items() if len(d) > 1} | {v for v, ep in manifests.items() if len(ep) > 1}
        ),
        "late_old_epoch": late,
        "epochs": sorted({e.epoch for e in events}),
    }


async def holder(fleet: Fleet) -> str | None:
    value, _ = await fleet.bus.kv_entry(topo.KEY_LEADER)
    return (parse_lease(value) or {}).get("holder")


async def wait_leader(fleet: Fleet, not_: str | None, timeout_s: float) -> tuple[str, float]:
    t0 = time.monotonic()
    while True:
        h = await holder(fleet)
        if h is not None and h != not_ and h in fleet.alive("trainer"):
            return h, time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise ChaosError(f"no new leader after {timeout_s}s (holder {h})")
        await asyncio.sleep(0.1)


async def first_version_by(
    fleet: Fleet, trainer_id: str, t_death: float, timeout_s: float
) -> tuple[float, int]:
    """(seconds from t_death (wall clock) until `trainer_id` has published a delta, its version):
    the failover as workers see it, lease handover + resume + keyframe + a first step. Timed by
    the server's store time of that delta (same host clock), not by when we polled."""
    padded, seq = time.time(), 0
    while True:
        try:
            raw = await fleet.bus.js.get_msg(topo.WEIGHTS, seq=seq + 1, subject=topo.DELTA_SUBJECT, next=True)
        except NotFoundError:
            raw = None
        if raw is not None:
            seq = raw.seq
            e = decode(raw.data)
            if isinstance(e, DeltaEvent) and e.trainer_id == trainer_id and raw.time.timestamp() >= t_death:
                return raw.time.timestamp() - t_death, e.to_version
            continue
        if time.time() - t_death > timeout_s:
            raise ChaosError(f"{trainer_id} published no version {timeout_s}s after the leader's death")
        if time.time() - padded > 15:  # a short run may have no work left: give it some (not in the books)
            await fleet.publish_tasks(BATCH_GROUPS)
            padded = time.time()
        await asyncio.sleep(0.1)


def first_trained_on(fleet: Fleet, trainer_id: str, version: int, t_death: float) -> float | None:
    """Seconds from t_death until `trainer_id` logged a step with a rollout generated on `version`
    or later (None: none by the end of the run)."""
    p = fleet.run_dir / f"trainer-{trainer_id}" / "metrics" / "trainer.jsonl"
    if not p.exists():
        return None
    ts = [
        d["ts"]
        for d in map(json.loads, filter(str.strip, p.read_text().splitlines()))
        if d.get("newest_token_version", -1) >= version and "ts" in d
    ]
    return round(min(ts) - t_death, 2) if ts else None


async def wait_log(log_path: Path, text: str, timeout_s: float) -> bool:
    t0 = time.monotonic()
    while text not in log_path.read_text(errors="replace"):
        if time.monotonic() - t0 > timeout_s:
            return False
        await asyncio.sleep(0.2)
    return True


def refused_stale(log_path: Path) -> int:
    return sum(
        1
        for line in log_path.read_text(errors="replace").splitlines()
        if "weight update refused" in line and "stale_epoch" in line
    )


def refusal_reasons(log_path: Path) -> Counter:
    out = Counter()
    for line in log_path.read_text(errors="replace").splitlines():
        if "weight update refused" in line:
            try:
                out[json.loads(line).get("reason", "?")] += 1
            except ValueError:
                out["?"] += 1
    return out


def deposed_publishes(log_path: Path) -> dict:
    """A deposed leader's publication attempts, from its log: each must be refused by the server."""
    text = log_path.read_text(errors="replace")
    refused = text.count("weights write refused by the server")  # every refused write (probe included)
    other = text.count("deposed leader publish ACCEPTED") + text.count("deposed leader publish failed")
    return {"attempts": refused + other, "refused": refused}


async def worker_beats(fleet: Fleet) -> dict[str, dict]:
    """The latest heartbeat metrics of every live worker (version, epoch, ...)."""
    out = {}
    for name in fleet.alive("rollout_worker"):
        try:
            raw = await fleet.bus.js.get_last_msg(
                topo.TELEMETRY, topo.heartbeat_subject("rollout_worker", name)
            )
            hb = decode(raw.data, Heartbeat)
        except Exception:
            continue
        out[name] = {**hb.metrics, "version": hb.version}
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")
