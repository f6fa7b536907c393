"""The weight protocol on a real nats-server: publisher -> feed -> target, and every refusal."""

from __future__ import annotations

import asyncio

import delta_codec
import policy
from bus import topology as topo
from bus.events import DeltaEvent
from bus.weights.follower import StateTarget, WeightFollower
from bus.weights.publisher import WeightPublisher
from bus.weights.rules import parse_version
from delta_codec.signing import generate_keypair, sign
from tests.helpers.weights import CFG, delta, same, trajectory, until


async def test_follow_and_late_reader_are_bit_exact(bus):
    sk, pk = generate_keypair()
    states = trajectory(4)
    pub = WeightPublisher(bus, epoch=1, trainer_id="t1", signing_key=sk, inline_max=1 << 20)
    kf = await pub.publish_keyframe(states[0], 0, CFG)
    assert kf.blob == "keyframe-e1-v0" and kf.model_config == CFG.to_dict()
    target, stop = StateTarget(), asyncio.Event()
    feed = WeightFollower(bus, public_key=pk, name="f1")
    task = asyncio.create_task(feed.follow(target, stop))
    await until(lambda: target.version == 0)
    ev1 = await pub.publish_delta(delta(states, 0, 1))
    pub.inline_max = 1024  # the next ones travel through the object store
    ev2 = await pub.publish_delta(delta(states, 1, 2))
    ev3 = await pub.publish_delta(delta(states, 2, 3))
    assert ev1.payload is not None and ev2.payload is None and ev3.blob == "delta-e1-v3"
    await until(lambda: target.version == 3)
    assert same(target.state, states[3]) and target.epoch == 1
    assert feed.applied["delta"] == 3 and not feed.refused
    assert parse_version(await bus.kv_get(topo.KEY_VERSION)) == 3
    late = await WeightFollower(bus, public_key=pk).latest_state()  # keyframe + deltas after it
    assert late.version == 3 and same(late.state, states[3]) and late.model_config == CFG.to_dict()
    stop.set()
    await task
    await feed.close()


async def test_bad_updates_are_refused_and_the_feed_resyncs(bus):
    sk, pk = generate_keypair()
    wrong_sk, _ = generate_keypair()
    states = trajectory(8, seed=1)
    pub = WeightPublisher(bus, epoch=2, trainer_id="t1", signing_key=sk, inline_max=1 << 20)
    await pub.publish_keyframe(states[0], 0, CFG)
    target, stop = StateTarget(), asyncio.Event()
    feed = WeightFollower(bus, public_key=pk, name="f2")
    task = asyncio.create_task(feed.follow(target, stop))
    await pub.publish_delta(delta(states, 0, 1))
    await until(lambda: target.version == 1)

    await bus.publish(topo.DELTA_SUBJECT, b"\x93garbage", msg_id="junk-1")  # malformed body
    await until(lambda: feed.refused["malformed"] == 1)
    await WeightPublisher(bus, 2, "evil", signing_key=wrong_sk).publish_delta(delta(states, 1, 2))
    await until(lambda: feed.refused["signature"] == 1)
    d12 = delta(states, 1, 2)
    blob = bytearray(d12.to_bytes())
    blob[len(blob) // 2] ^= 0xFF  # flipped bit in a record
    bad = DeltaEvent(
        from_version=1,
        to_version=2,
        epoch=2,
        codec=delta_codec.CODEC,
        size=len(blob),
        base_digest=d12.base_digest,
        new_digest=d12.new_digest,
        signature=sign(sk, bytes(blob)),
        payload=bytes(blob),
    )
    await bus.publish(topo.DELTA_SUBJECT, bad, msg_id="corrupt-1")
    await until(lambda: feed.refused["corrupt"] == 1)
    await WeightPublisher(bus, 1, "deposed", signing_key=sk).publish_delta(delta(states, 1, 2))
    await until(lambda: feed.refused["stale_epoch"] == 1)
    await bus.publish(topo.DELTA_SUBJECT, await _event_of(pub, delta(states, 0, 1)), msg_id="again-0-1")
    await until(lambda: feed.applied["replay"] == 1)
    assert target.version == 1 and same(target.state, states[1])  # nothing bad touched the state

    resyncs = feed.resyncs
    await pub.publish_delta(delta(states, 2, 3))  # v1->v2 never arrived: a gap
    await until(lambda: feed.refused["gap"] == 1 and feed.resyncs > resyncs)
    assert target.version == 1  # no newer keyframe yet: keep walking
    await pub.publish_keyframe(states[3], 3, CFG)  # the trainer's periodic keyframe
    await until(lambda: target.version == 3)
    await pub.publish_delta(delta(states, 3, 4))
    await until(lambda: target.version == 4)
    assert same(target.state, states[4])

    # a gap while a newer keyframe already sits further down the stream: resync jumps straight to it
    stop.set()
    await task
    await pub.publish_delta(delta(states, 5, 6))  # v4->v5 lost
    await pub.publish_keyframe(states[6], 6, CFG)
    await pub.publish_delta(delta(states, 6, 7))
    stop = asyncio.Event()
    task = asyncio.create_task(feed.follow(target, stop, resume=True))
    await until(lambda: target.version == 7)
    assert feed.refused["gap"] == 2 and same(target.state, states[7])
    stop.set()
    await task
    await feed.close()


async def _event_of(pub: WeightPublisher, d) -> DeltaEvent:
    payload = d.to_bytes()
    return DeltaEvent(
        from_version=d.from_version,
        to_version=d.to_version,
        epoch=pub.epoch,
        codec=delta_codec.CODEC,
        size=len(payload),
        base_digest=d.base_digest,
        new_digest=d.new_digest,
        signature=pub._sign(payload),
        payload=payload,
    )


async def test_new_leader_epoch_takes_over_and_old_leader_is_refused(bus):
    old_states, new_states = trajectory(4, seed=2), trajectory(3, seed=3)
    old = WeightPublisher(bus, epoch=1, trainer_id="old")
    await old.publish_keyframe(old_states[0], 0, CFG)
    target, stop = StateTarget(), asyncio.Event()
    feed = WeightFollower(bus, name="f3")
    task = asyncio.create_task(feed.follow(target, stop))
    await old.publish_delta(delta(old_states, 0, 1))
    await old.publish_delta(delta(old_states, 1, 2))
    await until(lambda: target.version == 2)
    new = WeightPublisher(bus, epoch=5, trainer_id="new")  # resumed from an older checkpoint
    await new.publish_keyframe(new_states[1], 1, CFG)
    await until(lambda: target.epoch == 5)
    assert target.version == 1 and same(target.state, new_states[1])
    await old.publish_delta(delta(old_states, 2, 3))  # the deposed leader keeps talking
    await new.publish_delta(delta(new_states, 1, 2))
    await until(lambda: target.version == 2)
    assert feed.refused["stale_epoch"] == 1 and same(target.state, new_states[2])
    stop.set()
    await task
    await feed.close()


async def test_keyframe_for_another_model_is_refused_by_an_engine(bus):
    from rollout_worker.torch_engine import TorchEngine

    states = trajectory(2, seed=4)
    pub = WeightPublisher(bus, epoch=1, trainer_id="t")
    await pub.publish_keyframe(states[0], 0, CFG)
    engine, stop = TorchEngine(CFG, slots=1, max_len=32), asyncio.Event()
    feed = WeightFollower(bus, name="f4")
    task = asyncio.create_task(feed.follow(engine, stop))
    await until(lambda: engine.version == 0)
    other = policy.ModelConfig.tiny(vocab_size=32, max_seq_len=64)
    await pub.publish_keyframe(policy.inference_state(policy.Transformer(other)), 5, other)
    await until(lambda: feed.refused["apply"] == 1)
    await pub.publish_delta(delta(states, 0, 1))  # the feed carries on
    await until(lambda: engine.version == 1)
    assert same(engine.state, states[1]) and "shapes differ from the model" in feed.last_refusal
    stop.set()
    await task
    await engine.close()
    await feed.close()
