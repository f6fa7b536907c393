"""Fencing is a conditional write on the server, not a check.

A leader's publication is (1) a compare-and-set on its lease, then (2) a WEIGHTS write that
expects the stream's last sequence to be the one this leader last wrote. A leader paused between
its lease check and its write, deposed meanwhile, has its write refused by the server once the new
leader has published, and no worker ever applies it."""

from __future__ import annotations

import asyncio

import pytest

from bus import topology as topo
from bus.weights.follower import StateTarget, WeightFollower
from bus.weights.publisher import Fenced, WeightPublisher
from tests.helpers.weights import CFG, delta, same, trajectory, until
from trainer.lease import LeaderLease, LeaseLost

TTL = 1.0


async def stream_events(bus) -> list:
    from bench.chaoskit.streams import weights_history

    return await weights_history(bus)


async def following(bus, name: str):
    target, stop, seen = StateTarget(), asyncio.Event(), []

    async def on_update(v, e):
        seen.append((v, e))

    feed = WeightFollower(bus, name=name)
    task = asyncio.create_task(feed.follow(target, stop, on_update=on_update))
    return target, stop, seen, feed, task


async def test_leader_paused_between_its_lease_check_and_its_write_is_refused_by_the_server(bus):
    a = LeaderLease(bus, "A", ttl_s=TTL, renew_s=0.3)
    assert await a.try_acquire()
    states, states_b = trajectory(3, seed=31), trajectory(3, seed=32)
    paused, resume = asyncio.Event(), asyncio.Event()

    async def hold_v2(ev):  # the deterministic pause: after the CAS, before the write
        if ev.version == 2:
            paused.set()
            await resume.wait()

    pub_a = WeightPublisher(bus, a.epoch, "A", fence=a.confirm, before_write=hold_v2)
    await pub_a.publish_keyframe(states[0], 0, CFG)
    target, stop, seen, feed, task = await following(bus, "w")
    await pub_a.publish_delta(delta(states, 0, 1))
    await until(lambda: target.version == 1)

    late = asyncio.create_task(pub_a.publish_delta(delta(states, 1, 2)))
    await asyncio.wait_for(paused.wait(), 10)  # A passed its lease CAS and is frozen
    b = LeaderLease(bus, "B", ttl_s=TTL, renew_s=0.3)
    assert await asyncio.wait_for(b.acquire(poll_s=0.1), 30) > a.epoch  # A stopped renewing: B takes over
    pub_b = WeightPublisher(bus, b.epoch, "B", fence=b.confirm)
    await pub_b.publish_keyframe(states_b[1], 1, CFG)
    await until(lambda: target.epoch == b.epoch)

    resume.set()  # A wakes up and writes v2
    with pytest.raises(LeaseLost):
        await late
    assert pub_a.refusals == 1  # the server refused the write itself
    # even skipping every check of its own, the deposed publisher cannot write: it never adopted
    # the stream's new position (that happens only after its fence passed)
    pub_a.fence, pub_a.before_write, pub_a.max_conflicts = None, None, 0
    with pytest.raises(Fenced):
        await pub_a.publish_delta(delta(states, 1, 2))
    assert pub_a.refusals == 2
    written = [(e.KIND, e.epoch, e.version) for e in await stream_events(bus)]
    assert ("Delta", a.epoch, 2) not in written

    await pub_b.publish_delta(delta(states_b, 1, 2))
    await until(lambda: target.version == 2)
    assert (target.epoch, same(target.state, states_b[2])) == (b.epoch, True)
    assert (2, a.epoch) not in seen and seen[-2:] == [(1, b.epoch), (2, b.epoch)]
    stop.set()
    await task
    await feed.close()


async def test_leader_deposed_before_its_lease_cas_writes_nothing(bus):
    a = LeaderLease(bus, "A", ttl_s=TTL, renew_s=0.3)
    assert await a.try_acquire()
    states = trajectory(2, seed=33)
    pub_a = WeightPublisher(bus, a.epoch, "A", fence=a.confirm)
    await pub_a.publish_keyframe(states[0], 0, CFG)
    b = LeaderLease(bus, "B", ttl_s=TTL, renew_s=0.3)
    assert await asyncio.wait_for(b.acquire(poll_s=0.1), 30)
    before = (await bus.js.stream_info(topo.WEIGHTS)).state.last_seq
    with pytest.raises(LeaseLost):  # the CAS on the lease is refused by the server
        await pub_a.publish_delta(delta(states, 0, 1))
    assert (await bus.js.stream_info(topo.WEIGHTS)).state.last_seq == before and pub_a.refusals == 0


async def test_a_lost_ack_is_retried_without_a_duplicate(bus):
    """The server checks the expected sequence before Nats-Msg-Id dedupe: a leader whose ack got
    lost is refused on its retry, confirms its lease, and gets the dedupe ack for its own write."""
    lease = LeaderLease(bus, "A", ttl_s=10.0, renew_s=3.0)
    assert await lease.try_acquire()
    states = trajectory(2, seed=34)
    pub = WeightPublisher(bus, lease.epoch, "A", fence=lease.confirm)
    await pub.publish_keyframe(states[0], 0, CFG)
    start = pub.last_seq
    ev = await pub.publish_delta(delta(states, 0, 1))
    pub.last_seq = start  # as if the ack of that write never arrived
    await pub._write(topo.DELTA_SUBJECT, ev)
    assert pub.refusals == 1 and pub.last_seq == start + 1
    assert (await bus.js.stream_info(topo.WEIGHTS)).state.last_seq == start + 1


async def test_renewals_and_publication_fences_do_not_race(bus):
    """The keeper's renewals and the publisher's CAS share the lease revision: serialised."""
    lease = LeaderLease(bus, "A", ttl_s=10.0, renew_s=3.0)
    assert await lease.try_acquire()
    await asyncio.gather(*(lease.confirm() for _ in range(20)), *(lease.renew() for _ in range(20)))
    assert lease.valid()
