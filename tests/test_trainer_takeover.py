"""Two real trainer processes: SIGKILL the leader, the standby leads within TTL + 5 s, resumes from
the checkpoint; the version sequence has no gap or fork, no rollout is used twice, and a delta
published afterwards under the old epoch is refused by a worker-side feed."""

import asyncio
import json
import random
import signal
import time
from pathlib import Path

import delta_codec
from bench.chaoskit.streams import weights_history as weights_events  # every Delta/Keyframe, in order
from bus import topology as topo
from bus.events import DeltaEvent as Delta
from bus.events import KeyframeEvent as Keyframe
from bus.weights.follower import WeightFollower
from bus.weights.publisher import WeightPublisher
from bus.weights.rules import parse_version
from policy.config import ModelConfig
from policy.model import Transformer
from tests.helpers.trainer import MODEL, make_scored
from tests.helpers.trainer_process import TTL, start
from trainer import checkpoint
from trainer.lease import parse_lease


async def wait_for(pred, timeout: float, what: str):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = await pred()
        if v:
            return v
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def test_standby_takes_over_without_gap_fork_or_reuse(bus, fresh_server, tmp_path):
    model = Transformer(ModelConfig.from_dict(MODEL))
    rng = random.Random(7)
    published: list[str] = []

    async def feed(n, prefix):
        for g in range(n):
            for i in range(2):
                sc = make_scored(model, f"{prefix}{g}", i, 2, 0, rng)
                published.append(sc.rollout["rollout_id"])
                await bus.publish(topo.scored_subject("arith"), sc)

    async def version():
        return parse_version(await bus.kv_get(topo.KEY_VERSION))

    async def holder():
        value, rev = await bus.kv_entry(topo.KEY_LEADER)
        return (parse_lease(value) or {}).get("holder"), rev

    procs = {t: start(tmp_path, fresh_server.url, t) for t in ("A", "B")}  # both start; one wins
    try:
        lead = await wait_for(lambda: _holder_in(holder(), procs), 120, "a leader")
        spare = "B" if lead == "A" else "A"
        await wait_for(lambda: _standby(tmp_path / f"{spare}.log"), 120, f"{spare} on standby")
        await feed(4, "a")
        await wait_for(lambda: _ge(version(), 3), 120, f"3 versions from {lead}")
        procs[lead].send_signal(signal.SIGKILL)
        procs[lead].wait()
        t_kill = time.monotonic()
        await wait_for(lambda: _eq(holder(), spare), TTL + 60, f"{spare} to lead")
        await wait_for(lambda: _new_keyframe(bus), TTL + 60, f"{spare}'s keyframe")
        took = time.monotonic() - t_kill
        assert took < TTL + 5, f"standby led {took:.1f}s after the kill"
        await feed(4, "b")
        await wait_for(lambda: _ge(version(), 8), 120, "all 8 groups trained")
        procs[spare].send_signal(signal.SIGTERM)
        assert procs[spare].wait(60) == 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    events = await weights_events(bus)
    kfs = [e for e in events if isinstance(e, Keyframe)]
    deltas = [e for e in events if isinstance(e, Delta)]
    e1, e2 = sorted({e.epoch for e in events})
    assert [(k.epoch, k.version) for k in kfs][0] == (e1, 0) and kfs[-1].epoch == e2
    takeover = kfs[-1].version
    for ep in (e1, e2):  # each epoch: consecutive versions, no gap
        vs = [(d.from_version, d.to_version) for d in deltas if d.epoch == ep]
        start_v = 0 if ep == e1 else takeover
        assert vs == [(v, v + 1) for v in range(start_v, start_v + len(vs))], (ep, vs)
    old_last = max(d.to_version for d in deltas if d.epoch == e1)
    assert old_last <= takeover <= old_last + 1  # resumed from the newest checkpoint
    same = [d for d in deltas if d.epoch == e1 and d.to_version == takeover]
    assert all(d.new_digest == kfs[-1].digest for d in same)  # no fork at the seam
    assert max(d.to_version for d in deltas) == 8
    # every scored rollout was used exactly once across both trainers
    used = []
    for tid in ("A", "B"):
        p = tmp_path / f"run-{tid}" / "metrics" / "trainer.jsonl"
        if p.exists():
            used += [rid for line in p.read_text().splitlines() for rid in json.loads(line)["rollout_ids"]]
    st = checkpoint.load_latest(tmp_path / "ckpt")
    assert st.epoch == e2 and st.version == 8
    assert sorted(st.consumed) == sorted(published)
    assert len(used) == len(set(used)) and set(used) <= set(published)

    # a paused old leader waking up: its delta (epoch e1) is refused by a worker-side feed
    feed_ = WeightFollower(bus)
    target = await feed_.latest_state()
    assert target.version == 8 and target.epoch == e2
    forked = {k: v.clone() for k, v in target.state.items()}
    name = next(iter(forked))
    forked[name].view(-1)[0] += 1
    d = delta_codec.encode_delta(target.state, forked, from_version=8, to_version=9)
    await WeightPublisher(bus, e1, "A").publish_delta(d, set_version=False)
    await asyncio.sleep(0.2)
    feed2 = WeightFollower(bus)
    t2 = await feed2.latest_state()
    assert feed2.refused["stale_epoch"] == 1 and t2.version == 8 and t2.epoch == e2
    await feed_.close()
    await feed2.close()


async def _eq(coro, want):
    h, _ = await coro
    return h == want


async def _ge(coro, want):
    return (await coro) >= want


async def _holder_in(coro, procs):
    h, _ = await coro
    return h if h in procs else None


async def _standby(log: Path):
    return b"waiting for the leader lease" in log.read_bytes()


async def _new_keyframe(bus):
    kfs = [e for e in await weights_events(bus) if isinstance(e, Keyframe)]
    return len({k.epoch for k in kfs}) >= 2
