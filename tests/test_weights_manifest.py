"""Versions published from shards on a real nats-server (bus/weights/manifest.py): parts in the
object store, one signed ManifestEvent on WEIGHTS through the fenced write. A follower applies a
good version bit-exact; every bad input (missing part, wrong digest, forged manifest, a part of
another version, parts that don't cover the state) is refused with its reason and leaves the
state untouched; a deposed leader cannot get a manifest onto WEIGHTS."""

from __future__ import annotations

import asyncio

import pytest
import torch
from nats.js.errors import NotFoundError

from bus import topology as topo
from bus.events import ManifestEvent, SamplingParams
from bus.weights.follower import StateTarget, WeightFollower
from bus.weights.manifest import part_blob_name, publish_sharded
from bus.weights.publisher import Fenced, WeightPublisher
from bus.weights.rules import parse_version, signed_fields
from delta_codec import CODEC
from delta_codec.sharded import encode_part, make_manifest, shard_rows
from delta_codec.signing import generate_keypair, sign
from tests.test_weights_follower import CFG, same, trajectory, until
from trainer.lease import LeaderLease, LeaseLost

WORLD = 2


def rank_parts(states, a: int, b: int, world: int = WORLD) -> list[bytes]:
    """What `world` FSDP2 ranks publish for version a -> b: each the delta of the rows it owns."""
    out = []
    for r in range(world):
        rows = {n: shard_rows(t.shape[0], r, world) for n, t in states[a].items()}
        # B023: the lambda is called in this iteration only
        cut = lambda st: {n: st[n][r0:r1] for n, (r0, r1) in rows.items()}  # noqa: E731, B023
        out.append(encode_part(cut(states[a]), cut(states[b]), rows, from_version=a, to_version=b).to_bytes())
    return out


async def hand_made(
    bus,
    pub: WeightPublisher,
    parts: list[bytes],
    a: int,
    b: int,
    *,
    sk=None,
    tag: str,
    store: dict[int, bytes] | None = None,
    manifest_parts=None,
    **over,
) -> ManifestEvent:
    """A manifest event built by hand (a hostile or broken publisher): `parts` are listed in the
    manifest, `store` (default: the same) is what goes to the object store under their names."""
    names = [f"{tag}-r{i}" for i in range(len(parts))]
    for i, data in (store if store is not None else dict(enumerate(parts))).items():
        await bus.put_blob(names[i], data)
    m = make_manifest(
        parts,
        from_version=a,
        to_version=b,
        names=names,
        extra=signed_fields(pub.epoch, pub.trainer_id, CFG.to_dict()),
    )
    if manifest_parts is not None:
        m.parts = manifest_parts(m.parts)
    payload = m.to_bytes()
    fields = dict(
        from_version=a,
        to_version=b,
        epoch=pub.epoch,
        codec=CODEC,
        size=len(payload),
        payload=payload,
        trainer_id=pub.trainer_id,
        parts=len(m.parts),
        model_config=CFG.to_dict(),
        signature=sign(sk, payload) if sk is not None else b"",
    )
    ev = ManifestEvent(**(fields | over))
    await pub._write(topo.MANIFEST_SUBJECT, ev)
    return ev


async def test_sharded_versions_apply_bit_exact_and_late_readers_agree(bus):
    sk, pk = generate_keypair()
    states = trajectory(4, seed=41)
    pub = WeightPublisher(bus, epoch=1, trainer_id="t1", signing_key=sk)
    await pub.publish_keyframe(states[0], 0, CFG)
    target, stop = StateTarget(), asyncio.Event()
    feed = WeightFollower(bus, public_key=pk, name="m1")
    task = asyncio.create_task(feed.follow(target, stop))
    await until(lambda: target.version == 0)
    for v in (1, 2, 3):
        ev = await publish_sharded(
            pub, rank_parts(states, v - 1, v), from_version=v - 1, to_version=v, model_config=CFG
        )
        assert ev.parts == WORLD and ev.payload is not None and ev.msg_id() == f"manifest-e1-v{v}"
    await until(lambda: target.version == 3)
    assert same(target.state, states[3]) and target.epoch == 1
    assert feed.applied["manifest"] == 3 and not feed.refused
    assert parse_version(await bus.kv_get(topo.KEY_VERSION)) == 3
    assert await bus.get_blob(part_blob_name(1, 2, 1)) == rank_parts(states, 1, 2)[1]
    late = await WeightFollower(bus, public_key=pk).latest_state()
    assert late.version == 3 and same(late.state, states[3])
    stop.set()
    await task
    await feed.close()


async def test_every_bad_sharded_version_is_refused_and_the_state_is_untouched(bus):
    sk, pk = generate_keypair()
    wrong_sk, _ = generate_keypair()
    states, other = trajectory(3, seed=42), trajectory(3, seed=43)
    pub = WeightPublisher(bus, epoch=1, trainer_id="t1", signing_key=sk)
    await pub.publish_keyframe(states[0], 0, CFG)
    target, stop = StateTarget(), asyncio.Event()
    feed = WeightFollower(bus, public_key=pk, name="m2")
    task = asyncio.create_task(feed.follow(target, stop))
    await until(lambda: target.version == 0)
    good, next_parts = rank_parts(states, 0, 1), rank_parts(states, 1, 2)
    corrupt = bytearray(good[1])
    corrupt[len(corrupt) // 2] ^= 0xFF
    cases = [  # (what is wrong, reason it must be refused with, how the bad version is published)
        ("missing part", "part", dict(store={0: good[0]})),
        ("wrong digest", "part", dict(store={0: good[0], 1: bytes(corrupt)})),
        (
            "part of another version (stored under the name)",
            "part",
            dict(store={0: good[0], 1: next_parts[1]}),
        ),
        ("part of another version (listed, signed)", "part", dict(parts=[good[0], next_parts[1]])),
        ("forged: another key", "signature", dict(sk=wrong_sk)),
        ("forged: unsigned", "signature", dict(sk=None)),
        ("forged: event fields != signed header", "fields", dict(epoch=99, trainer_id="mallory")),
        ("parts that don't cover the state", "apply", dict(parts=[good[0]])),
        ("another model's parts", "apply", dict(parts=rank_parts(other, 0, 1))),
    ]
    for n, (what, reason, kw) in enumerate(cases):
        before = feed.refused[reason]
        # each from an epoch of its own: a message id is per (epoch, version), the server dedupes it
        bad = WeightPublisher(bus, epoch=10 + n, trainer_id="t1")
        await hand_made(bus, bad, kw.pop("parts", good), 0, 1, tag=f"bad{n}", **({"sk": sk} | kw))
        await until(lambda: feed.refused[reason] == before + 1)  # noqa: B023  (called in this iteration only)
        assert (target.version, same(target.state, states[0])) == (0, True), what
        assert reason in feed.last_refusal, (what, feed.last_refusal)
    assert feed.applied["manifest"] == 0
    # the feed goes on: the real version 1 applies whole
    await publish_sharded(pub, good, from_version=0, to_version=1, model_config=CFG)
    await until(lambda: target.version == 1)
    assert same(target.state, states[1]) and feed.applied["manifest"] == 1
    stop.set()
    await task
    await feed.close()


async def test_a_failing_part_rolls_back_the_parts_already_applied(bus):
    """Part 0 applies, part 1 meets rows that are not its base: part 0's rows are restored."""
    states = trajectory(2, seed=44)
    pub = WeightPublisher(bus, epoch=1, trainer_id="t1")
    target = StateTarget()
    await target.load_keyframe({k: v.clone() for k, v in states[0].items()}, 0, 1)
    name = next(n for n, t in states[0].items() if t.dim() == 2 and t.shape[0] > 1)
    target.state[name][-1, 0] += 1  # a row of rank 1's part differs from its base
    before = {k: v.clone() for k, v in target.state.items()}
    await publish_sharded(pub, rank_parts(states, 0, 1), from_version=0, to_version=1, model_config=CFG)
    feed = WeightFollower(bus, name="m3")
    raw = await bus.js.get_last_msg(topo.WEIGHTS, topo.MANIFEST_SUBJECT)
    await feed._apply_or_refuse(target, raw)
    assert feed.refused["apply"] == 1 and "base digest" in feed.last_refusal
    assert target.version == 0 and same(target.state, before)


async def test_a_deposed_leader_cannot_publish_a_manifest(bus):
    a = LeaderLease(bus, "A", ttl_s=1.0, renew_s=0.3)
    assert await a.try_acquire()
    states, states_b = trajectory(2, seed=45), trajectory(2, seed=46)
    pub_a = WeightPublisher(bus, a.epoch, "A", fence=a.confirm)
    await pub_a.publish_keyframe(states[0], 0, CFG)
    b = LeaderLease(bus, "B", ttl_s=1.0, renew_s=0.3)
    assert await asyncio.wait_for(b.acquire(poll_s=0.1), 30) > a.epoch  # A stopped renewing: B takes over
    pub_b = WeightPublisher(bus, b.epoch, "B", fence=b.confirm)
    await pub_b.publish_keyframe(states_b[0], 0, CFG)
    parts = rank_parts(states, 0, 1)
    with pytest.raises(LeaseLost):  # its own lease CAS refuses first
        await publish_sharded(pub_a, parts, from_version=0, to_version=1, model_config=CFG)
    # skipping its own check, the server's expected-last-sequence refuses the write
    pub_a.fence, pub_a.max_conflicts = None, 0
    with pytest.raises(Fenced):
        await publish_sharded(pub_a, parts, from_version=0, to_version=1, model_config=CFG)
    assert pub_a.refusals == 1
    with pytest.raises(NotFoundError):  # no manifest on WEIGHTS at all
        await bus.js.get_last_msg(topo.WEIGHTS, topo.MANIFEST_SUBJECT)
    late = await WeightFollower(bus).latest_state()
    assert (late.epoch, late.version, same(late.state, states_b[0])) == (b.epoch, 0, True)
    await publish_sharded(pub_b, rank_parts(states_b, 0, 1), from_version=0, to_version=1, model_config=CFG)
    late = await WeightFollower(bus).latest_state()
    assert (late.epoch, late.version, same(late.state, states_b[1])) == (b.epoch, 1, True)


async def test_the_torch_engine_takes_a_sharded_version_whole_or_not_at_all(bus):
    from rollout_worker.torch_engine import TorchEngine

    states = trajectory(2, seed=47)
    pub = WeightPublisher(bus, epoch=1, trainer_id="t1")
    await pub.publish_keyframe(states[0], 0, CFG)
    eng = TorchEngine(CFG, slots=1, max_len=32)
    feed = WeightFollower(bus, name="eng")
    kf = await feed.latest_keyframe()
    await eng.load_keyframe(kf.state, 0, 1)
    bad = WeightPublisher(bus, epoch=2, trainer_id="t1")  # a lone part (rows that do not cover the state);
    # an epoch of its own: the server dedupes a message id (per epoch and version)
    await hand_made(bus, bad, rank_parts(states, 0, 1)[:1], 0, 1, tag="lone")
    await feed._apply_or_refuse(eng, await bus.js.get_last_msg(topo.WEIGHTS, topo.MANIFEST_SUBJECT))
    assert feed.refused["apply"] == 1 and eng.version == 0 and same(eng.state, states[0])
    await publish_sharded(
        pub, rank_parts(states, 0, 1), from_version=0, to_version=1, model_config=CFG, set_version=False
    )
    await feed._apply_or_refuse(eng, await bus.js.get_last_msg(topo.WEIGHTS, topo.MANIFEST_SUBJECT))
    assert feed.applied["manifest"] == 1 and eng.version == 1 and same(eng.state, states[1])
    live = {n: p.data for n, p in eng.model.named_parameters()} if hasattr(eng, "model") else eng.params
    assert all(torch.equal(live[n], states[1][n]) for n in states[1] if n in live)  # the live weights moved
    g = await eng.generate([1, 5], SamplingParams(max_tokens=3))
    assert g.token_versions == [1] * 3
    await eng.close()
