"""The rollout worker on a real nats-server: tasks -> rollouts with hot-patched weights,
staleness gating, sync-mode min_version, and a corrupted delta that must not stop generation."""

from __future__ import annotations

import asyncio

import torch

import delta_codec
import policy
from bus import BusConfig
from bus import topology as topo
from bus.events import DeltaEvent, Heartbeat, Rollout, Task, decode
from bus.weights.publisher import WeightPublisher
from delta_codec.signing import generate_keypair, sign
from rollout_worker.worker import Worker
from tests.helpers.engine import reference_logprobs
from tests.helpers.tolerance import forward_tol
from tests.helpers.weights import delta, same, until
from tests.helpers.worker import CFG, TOK, publish_tasks, read_stream, states_for, worker_cfg


async def generating_worker(bus, url: str, pub: WeightPublisher, state0: dict, tasks: int, tag: str, **cfg):
    """Version 0 published, a worker running, `tasks` tasks queued and tokens flowing."""
    await pub.publish_keyframe(state0, 0, CFG)
    worker, stop = Worker(worker_cfg(url, **cfg), bus), asyncio.Event()
    run = asyncio.create_task(worker.run(stop, handle_signals=False))
    ids = await publish_tasks(bus, tasks, tag, max_tokens=60)
    await until(lambda: worker.engine is not None and worker.engine.stats()["tokens"] > 20)
    return worker, stop, run, ids


def check_replay(r: Rollout, states: dict) -> None:
    """Each token's behaviour logprob is what a fresh model at the token's version gives."""
    assert len(r.completion_ids) == len(r.logprobs) == len(r.token_versions) == r.cost_tokens > 0
    assert r.token_versions == sorted(r.token_versions)
    ref = reference_logprobs(states, r.prompt_ids, r.completion_ids, r.token_versions, cfg=CFG)
    # why: decoded token by token (KV cache) vs the whole sequence: another reduction order, logprobs' size
    tol = forward_tol(CFG, scale=float(ref.abs().max()))
    torch.testing.assert_close(torch.tensor(r.logprobs), ref, **tol)


async def test_worker_generates_with_hot_patched_weights(bus, fresh_server):
    states = states_for(3, seed=7)
    pub = WeightPublisher(bus, epoch=1, trainer_id="t")
    worker, stop, run, ids = await generating_worker(bus, fresh_server.url, pub, states[0], 8, "hot")
    await pub.publish_delta(delta(states, 0, 1))
    await until(lambda: worker.engine.version == 1)
    await until(lambda: worker.engine.stats()["tokens"] > 150)
    await pub.publish_delta(delta(states, 1, 2))
    await until(lambda: worker.tasks_done == len(ids), timeout=120)
    stop.set()
    await run

    rollouts = await read_stream(bus, topo.ROLLOUTS, Rollout)
    assert sorted(r.rollout_id for r in rollouts) == sorted(f"{t}-{i}" for t in ids for i in range(2))
    by_version = {0: states[0], 1: states[1], 2: states[2]}
    for r in rollouts:
        check_replay(r, by_version)
        assert r.prompt_ids == TOK.encode(r.prompt, bos=True) and r.completion_text == TOK.decode(
            r.completion_ids
        )
        assert r.finish_reason in ("stop", "length") and r.worker_id == "w1" and r.epoch == 1
        assert r.group_size == 2 and r.sampling["max_tokens"] == 60 and r.wall_s > 0
        assert policy.SamplingMask.from_wire(r.sampling_mask).counts.size == len(r.completion_ids)
    assert any(len(set(r.token_versions)) > 1 for r in rollouts)  # a delta landed mid-sequence
    assert worker.engine.version == 2 and same(worker.engine.state, states[2])
    st = worker.snapshot()
    assert st["tokens_per_s"] > 0 and st["update_stall_ms_p99"] > 0 and st["lag"] == 0
    consumer = await bus.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)
    assert consumer.num_pending == 0 and consumer.num_ack_pending == 0  # every task acked
    beats = await read_stream(bus, topo.TELEMETRY, None)
    assert any(isinstance(b, Heartbeat) and b.component_id == "w1" for b in beats)
    assert any(
        isinstance(b, Heartbeat) and b.metrics.get("beat") == "patched" and b.version == 2 for b in beats
    )


async def test_max_lag_stops_admission_and_min_version_waits(bus, fresh_server):
    states = states_for(6, seed=8, frac=0.01, scale=0.02)
    pub = WeightPublisher(bus, epoch=1, trainer_id="t")
    await pub.publish_keyframe(states[0], 0, CFG)
    worker, stop = Worker(worker_cfg(fresh_server.url, admission={"max_lag": 1}), bus), asyncio.Event()
    run = asyncio.create_task(worker.run(stop, handle_signals=False))
    await until(lambda: worker.engine is not None and worker.loop is not None)
    await pub.set_version(3)  # the trainer is 3 versions ahead
    await until(lambda: worker.paused)
    await publish_tasks(bus, 3, "lag", max_tokens=8)
    await asyncio.sleep(1.5)  # give a (wrong) worker time to take them
    assert worker.tasks_done == 0 and worker.loop.stats.fetched == 0
    consumer = await bus.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)
    assert consumer.num_pending == 3  # left on the stream for fresher workers
    await pub.publish_delta(delta(states, 0, 1), set_version=False)
    await pub.publish_delta(delta(states, 1, 2), set_version=False)  # lag 1: admission resumes
    await until(lambda: worker.tasks_done == 3, timeout=60)
    assert not worker.paused
    await publish_tasks(bus, 1, "sync", max_tokens=8, min_version=5)  # sync mode: needs v5
    await until(lambda: worker.loop.stats.fetched == 4)
    await pub.publish_delta(delta(states, 2, 3))
    await pub.publish_delta(delta(states, 3, 4))
    await pub.publish_delta(delta(states, 4, 5))
    await until(lambda: worker.tasks_done == 4, timeout=60)
    stop.set()
    await run
    rollouts = {r.rollout_id: r for r in await read_stream(bus, topo.ROLLOUTS, Rollout)}
    assert len(rollouts) == 8
    assert all(min(r.token_versions) >= 2 for k, r in rollouts.items() if k.startswith("lag"))
    assert all(min(r.token_versions) >= 5 for k, r in rollouts.items() if k.startswith("sync"))


async def test_corrupted_delta_is_refused_and_generation_continues(bus, fresh_server):
    sk, pk = generate_keypair()
    states = states_for(3, seed=9, frac=0.01, scale=0.02)
    pub = WeightPublisher(bus, epoch=1, trainer_id="t", signing_key=sk)
    worker, stop, run, _ = await generating_worker(
        bus, fresh_server.url, pub, states[0], 6, "a", weights={"public_key": pk.hex()}
    )
    d = delta(states, 0, 1)
    blob = bytearray(d.to_bytes())
    blob[-100] ^= 0x01  # one flipped bit near the end
    await bus.publish(
        topo.DELTA_SUBJECT,
        DeltaEvent(
            from_version=0,
            to_version=1,
            epoch=1,
            codec=delta_codec.CODEC,
            size=len(blob),
            base_digest=d.base_digest,
            new_digest=d.new_digest,
            signature=sign(sk, bytes(blob)),
            payload=bytes(blob),
        ),
    )
    await pub.set_version(1)
    await until(lambda: worker.weights.refused["corrupt"] == 1)
    tokens_at_refusal = worker.engine.stats()["tokens"]
    await until(lambda: worker.engine.stats()["tokens"] > tokens_at_refusal + 20)  # still generating
    assert worker.engine.version == 0 and same(worker.engine.state, states[0])
    await pub.publish_keyframe(states[1], 1, CFG)  # resync point
    await until(lambda: worker.engine.version == 1)
    await pub.publish_delta(delta(states, 1, 2))
    await until(lambda: worker.engine.version == 2)
    await publish_tasks(bus, 2, "b", max_tokens=10)
    await until(lambda: worker.tasks_done == 8, timeout=120)
    stop.set()
    await run
    assert same(worker.engine.state, states[2]) and worker.weights.resyncs >= 1
    rollouts = {r.rollout_id: r for r in await read_stream(bus, topo.ROLLOUTS, Rollout)}
    assert len(rollouts) == 16
    for k, r in rollouts.items():
        if k.startswith("b-"):
            assert set(r.token_versions) == {2}
            check_replay(r, {2: states[2]})


async def test_bad_tasks_are_parked_with_a_reason_and_good_ones_still_run(bus, fresh_server):
    await WeightPublisher(bus, epoch=1, trainer_id="t").publish_keyframe(states_for(1, seed=4)[0], 0, CFG)
    worker, stop = Worker(worker_cfg(fresh_server.url), bus), asyncio.Event()
    run = asyncio.create_task(worker.run(stop, handle_signals=False))
    bad = {
        "vocab": dict(prompt="caf\u00e9 = ?"),
        "top_p": dict(sampling={"top_p": 0.0, "max_tokens": 4}),
        "keys": dict(sampling={"max_tokens": 4, "beams": 3}),
        "n": dict(sampling={"n": 0}),
        "long": dict(sampling={"max_tokens": 500}),
    }
    for name, kw in bad.items():
        await bus.publish(
            topo.task_subject("arith"),
            Task(
                task_id=f"bad-{name}", env="arith", **{"prompt": "1+1=", "sampling": {"max_tokens": 4}, **kw}
            ),
        )
    await publish_tasks(bus, 1, "good", max_tokens=6)
    await until(lambda: worker.tasks_done == 1 and worker.parked == len(bad), timeout=60)
    stop.set()
    await run
    info = await bus.js.stream_info(topo.DLQ)
    parked = {}
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        m = await bus.js.get_msg(topo.DLQ, seq)
        parked[decode(m.data, Task).task_id] = str(m.headers["Rl-Reason"])
    assert set(parked) == {f"bad-{n}" for n in bad}
    assert "CharTokenizer" in parked["bad-vocab"] and "top_p" in parked["bad-top_p"]
    assert "beams" in parked["bad-keys"] and "exceeds" in parked["bad-long"]
    consumer = await bus.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)
    assert consumer.num_pending == 0 and consumer.num_ack_pending == 0
    assert {r.task_id for r in await read_stream(bus, topo.ROLLOUTS, Rollout)} == {"good-0"}


async def test_worker_rides_out_a_broker_restart(fresh_server):
    from bus import connect

    bus = await connect(BusConfig(servers=[fresh_server.url], name="t"))
    await bus.provision()
    states = states_for(3, seed=11, frac=0.01, scale=0.02)
    pub = WeightPublisher(bus, epoch=1, trainer_id="t")
    worker, stop, run, ids = await generating_worker(bus, fresh_server.url, pub, states[0], 6, "r")
    await fresh_server.restart()  # file store: streams, KV and blobs survive
    await pub.publish_delta(delta(states, 0, 1))
    await until(lambda: worker.engine.version == 1 and worker.latest_version == 1, timeout=60)
    await pub.publish_delta(delta(states, 1, 2))
    await until(lambda: worker.engine.version == 2, timeout=60)
    await until(lambda: worker.rollouts >= 2 * len(ids), timeout=120)
    stop.set()
    await run
    rollouts = await read_stream(bus, topo.ROLLOUTS, Rollout)
    assert {r.rollout_id for r in rollouts} >= {f"{t}-{i}" for t in ids for i in range(2)}
    assert same(worker.engine.state, states[2])
    await bus.close()
