"""The epoch (and trainer id, model config) that workers act on travel inside the
payload's signed container header. An event whose fields disagree with it is refused, an epoch the
KV leader lease never issued is refused, and the worker keeps following the real leader."""

from __future__ import annotations

import asyncio
import json
import time

import msgpack
import msgspec
import pytest

import delta_codec
import policy
from bus import topology as topo
from bus.events import DeltaEvent, EventError, Heartbeat, KeyframeEvent, decode, encode
from bus.weights.follower import StateTarget, WeightFollower
from bus.weights.publisher import WeightPublisher
from bus.weights.rules import signed_fields
from delta_codec.signing import generate_keypair, sign
from tests.helpers.weights import CFG, delta, same, trajectory, until
from trainer.lease import LeaderLease

HUGE = 10**9


async def leader(bus, holder: str = "real") -> LeaderLease:
    lease = LeaderLease(bus, holder, ttl_s=30.0, renew_s=10.0)
    assert await lease.try_acquire()
    return lease


def forged_delta(states, a: int, b: int, epoch: int, trainer_id: str, sk=None, **over) -> DeltaEvent:
    """A delta event built by hand (a hostile publisher): header fields as given, event fields `over`."""
    d = delta(states, a, b)
    payload = delta_codec.Delta(
        d.from_version, d.to_version, d.records, extra=signed_fields(epoch, trainer_id)
    ).to_bytes()
    fields = dict(
        from_version=a,
        to_version=b,
        epoch=epoch,
        codec=delta_codec.CODEC,
        size=len(payload),
        base_digest=d.base_digest,
        new_digest=d.new_digest,
        payload=payload,
        trainer_id=trainer_id,
        signature=sign(sk, payload) if sk is not None else b"",
    )
    return DeltaEvent(**(fields | over))


def test_extra_header_fields_round_trip_inside_the_checksummed_header():
    states = trajectory(2, seed=11)
    d = delta(states, 0, 1)
    x = {"epoch": 7, "trainer_id": "t"}
    back = delta_codec.Delta.from_bytes(delta_codec.Delta(0, 1, d.records, extra=x).to_bytes())
    assert back.extra == x and not delta_codec.Delta.from_bytes(d.to_bytes()).extra
    kf = delta_codec.make_keyframe(states[0], version=3)
    kf.extra = x
    assert delta_codec.Keyframe.from_bytes(kf.to_bytes()).extra == x
    blob = bytearray(delta_codec.Delta(0, 1, d.records, extra=x).to_bytes())
    i = 12 + int.from_bytes(blob[8:12], "little") // 2  # inside the (zstd'd) header, where the fields are
    blob[i] ^= 0x01  # the header checksum catches it
    with pytest.raises(delta_codec.DeltaError, match="header checksum"):
        delta_codec.Delta.from_bytes(bytes(blob))


def test_old_schema_weight_events_are_refused_with_a_clear_error():
    ev = forged_delta(trajectory(2, seed=12), 0, 1, 1, "t")
    body = msgpack.unpackb(encode(ev), raw=False)
    assert body["schema"] == 2 and Heartbeat.SCHEMA_VERSION == 1  # only the weight events moved on
    body["schema"] = 1
    with pytest.raises(EventError, match=r"unsupported schema version 1 \(this build speaks 2\).*signature"):
        decode(msgpack.packb(body, use_bin_type=True))
    assert isinstance(decode(encode(ev)), DeltaEvent)


async def test_forged_epoch_version_and_swapped_payload_are_refused_signed(bus):
    """A signed run: every forgery is refused and the feed keeps following the real leader."""
    sk, pk = generate_keypair()
    lease = await leader(bus)
    e = lease.epoch
    states, other = trajectory(5, seed=13), trajectory(4, seed=14)
    pub = WeightPublisher(bus, e, "real", signing_key=sk, inline_max=1 << 20, fence=lease.confirm)
    kf0 = await pub.publish_keyframe(states[0], 0, CFG)
    target, stop = StateTarget(), asyncio.Event()
    seen: list[tuple[int, int]] = []

    async def on_update(v, ep):
        seen.append((v, ep))

    feed = WeightFollower(bus, public_key=pk, name="signed")
    task = asyncio.create_task(feed.follow(target, stop, on_update=on_update))
    await until(lambda: target.version == 0)
    await pub.publish_delta(delta(states, 0, 1))
    await pub.publish_delta(delta(states, 1, 2))
    await until(lambda: target.version == 2)

    # 1. the old, validly signed keyframe v0 re-wrapped with a huge epoch: roll back and wedge
    await bus.publish(topo.KEYFRAME_SUBJECT, msgspec.structs.replace(kf0, epoch=HUGE), msg_id="forged-epoch")
    await until(lambda: feed.refused["fields"] >= 1)
    # 2. forged version: the same keyframe claiming to be v9 of the real epoch
    await bus.publish(topo.KEYFRAME_SUBJECT, msgspec.structs.replace(kf0, version=9), msg_id="forged-version")
    await until(lambda: feed.refused["corrupt"] >= 1)
    # 3. swapped payload: the real epoch's v2->v3 announcement carrying a validly signed v2->v3 of a
    #    deposed epoch (other weights; digests made to match): only the signed epoch tells them apart
    old = forged_delta(other, 2, 3, e - 1, "real", sk)
    swapped = msgspec.structs.replace(old, epoch=e)
    await bus.publish(topo.DELTA_SUBJECT, swapped, msg_id="swapped")
    await until(lambda: feed.refused["fields"] >= 2)
    assert target.version == 2 and target.epoch == e and same(target.state, states[2])

    await pub.publish_delta(delta(states, 2, 3))  # the real leader carries on
    await pub.publish_delta(delta(states, 3, 4))
    await until(lambda: target.version == 4)
    assert target.epoch == e and same(target.state, states[4])
    assert seen == [(1, e), (2, e), (3, e), (4, e)]  # never acted on a forgery
    stop.set()
    await task
    await feed.close()


async def test_unsigned_fields_must_agree_and_unissued_epochs_are_refused(bus):
    """No keys: mismatches are still refused; a consistent forgery with an epoch the lease never
    issued is refused by the KV check (forging a consistent payload needs signing to stop)."""
    lease = await leader(bus)
    e = lease.epoch
    states = trajectory(4, seed=15)
    pub = WeightPublisher(bus, e, "real", inline_max=1 << 20, fence=lease.confirm)
    kf0 = await pub.publish_keyframe(states[0], 0, CFG)
    target, stop = StateTarget(), asyncio.Event()
    feed = WeightFollower(bus, name="unsigned")
    task = asyncio.create_task(feed.follow(target, stop))
    await until(lambda: target.version == 0)
    await pub.publish_delta(delta(states, 0, 1))
    await until(lambda: target.version == 1)

    await bus.publish(topo.KEYFRAME_SUBJECT, msgspec.structs.replace(kf0, epoch=HUGE), msg_id="mismatch")
    await until(lambda: feed.refused["fields"] == 1)
    # consistent but invented: header and event both say epoch HUGE
    kf = delta_codec.make_keyframe(states[0], version=0)
    kf.extra = signed_fields(HUGE, "evil", CFG.to_dict())
    payload = kf.to_bytes()
    await bus.put_blob("invented", payload)
    await bus.publish(
        topo.KEYFRAME_SUBJECT,
        KeyframeEvent(
            version=0,
            epoch=HUGE,
            codec=delta_codec.CODEC,
            size=len(payload),
            digest=kf.digest,
            model_config=CFG.to_dict(),
            blob="invented",
            trainer_id="evil",
        ),
        msg_id="invented",
    )
    await until(lambda: feed.refused["epoch"] == 1)
    assert "never issued by the leader lease" in feed.last_refusal
    await bus.publish(topo.DELTA_SUBJECT, forged_delta(states, 1, 2, HUGE, "evil"), msg_id="invented-delta")
    await until(lambda: feed.refused["epoch"] == 2)
    assert (target.version, target.epoch) == (1, e)

    await pub.publish_delta(delta(states, 1, 2))
    await pub.publish_delta(delta(states, 2, 3))
    await until(lambda: target.version == 3)
    assert target.epoch == e and same(target.state, states[3])
    stop.set()
    await task
    await feed.close()


async def test_a_new_leader_epoch_is_accepted_once_the_lease_issued_it(bus):
    """The KV check does not get in the way of a real takeover (the new epoch is verified)."""
    a = await leader(bus, "a")
    states = trajectory(3, seed=16)
    await WeightPublisher(bus, a.epoch, "a", fence=a.confirm).publish_keyframe(states[0], 0, CFG)
    target, stop = StateTarget(), asyncio.Event()
    feed = WeightFollower(bus, name="takeover")
    task = asyncio.create_task(feed.follow(target, stop))
    await until(lambda: target.version == 0)
    await a.release()
    b = await leader(bus, "b")
    assert b.epoch > a.epoch
    pub_b = WeightPublisher(bus, b.epoch, "b", fence=b.confirm)
    await pub_b.publish_keyframe(states[1], 1, CFG)
    await pub_b.publish_delta(delta(states, 1, 2))
    await until(lambda: target.version == 2)
    assert target.epoch == b.epoch and feed.issued_epoch >= b.epoch and not feed.refused
    stop.set()
    await task
    await feed.close()


def _latest_heartbeat(msgs: list, worker_id: str) -> Heartbeat | None:
    hbs = [m for m in msgs if isinstance(m, Heartbeat) and m.component_id == worker_id]
    return hbs[-1] if hbs else None


async def test_a_worker_process_refuses_forgeries_and_follows_the_real_leader(bus, fresh_server, tmp_path):
    """A real rollout-worker process (`python -m rollout_worker`) with the trainer's public key."""
    from asyncrl.launch import spawn

    sk, pk = generate_keypair()
    tok = policy.CharTokenizer.default()
    cfg = policy.ModelConfig.tiny(vocab_size=tok.vocab_size, max_seq_len=64)
    lease = await leader(bus)
    e = lease.epoch
    torch_states = trajectory_for(cfg, 4)
    pub = WeightPublisher(bus, e, "real", signing_key=sk, fence=lease.confirm)
    kf0 = await pub.publish_keyframe(torch_states[0], 0, cfg)
    (tmp_path / "config").mkdir()
    (tmp_path / "logs").mkdir()
    proc = spawn(
        tmp_path,
        "w-forged",
        "rollout_worker",
        "rollout_worker",
        {
            "worker_id": "w-forged",
            "engine": {"slots": 2, "max_len": 64},
            "run": {"threads": 1, "heartbeat_s": 0.3, "grace_s": 2.0},
            "weights": {"public_key": pk.hex()},
            "bus": {"servers": [fresh_server.url], "name": "w"},
        },
    )
    try:

        async def worker_at(version: int, timeout: float = 120.0) -> Heartbeat:
            t0 = time.monotonic()
            while time.monotonic() - t0 < timeout:
                assert proc.popen.poll() is None, proc.log_path.read_text()[-3000:]
                hb = _latest_heartbeat(await _telemetry(bus), "w-forged")
                if hb is not None and hb.version == version:
                    return hb
                await asyncio.sleep(0.3)
            raise AssertionError(f"worker never at v{version}:\n{proc.log_path.read_text()[-3000:]}")

        await pub.publish_delta(delta(torch_states, 0, 1))
        await worker_at(1)
        await bus.publish(
            topo.KEYFRAME_SUBJECT, msgspec.structs.replace(kf0, epoch=HUGE), msg_id="forged-epoch"
        )
        await bus.publish(
            topo.DELTA_SUBJECT,
            msgspec.structs.replace(
                forged_delta(trajectory_for(cfg, 3, seed=5), 1, 2, e - 1, "real", sk), epoch=e
            ),
            msg_id="swapped",
        )
        await pub.publish_delta(delta(torch_states, 1, 2))
        await pub.publish_delta(delta(torch_states, 2, 3))
        await worker_at(3)
        refusals = [
            json.loads(line)
            for line in proc.log_path.read_text().splitlines()
            if "weight update refused" in line
        ]
        assert [r["reason"] for r in refusals] == ["fields", "fields"], refusals
        assert all("disagree with the payload's signed header" in r["detail"] for r in refusals)
        assert "fault" not in proc.log_path.read_text().lower()
    finally:
        proc.popen.terminate()
        try:
            proc.popen.wait(15)
        except Exception:
            proc.popen.kill()


def trajectory_for(cfg, n: int, seed: int = 21) -> list[dict]:
    import torch

    from tests.helpers.engine import perturb

    torch.manual_seed(seed)
    out = [policy.inference_state(policy.Transformer(cfg))]
    for v in range(1, n):
        out.append(perturb(out[-1], 0.01, 0.02, seed=seed * 1000 + v))
    return out


async def _telemetry(bus) -> list:
    from nats.js.errors import NotFoundError

    info = await bus.js.stream_info(topo.TELEMETRY)
    out = []
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
        try:
            m = await bus.js.get_msg(topo.TELEMETRY, seq)
        except NotFoundError:
            continue
        try:
            out.append(decode(m.data))
        except EventError:
            continue
    return out
