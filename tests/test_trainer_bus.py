"""Trainer against a real nats-server: one step publishes a bit-exact delta, stale samples are
dropped, duplicates and bad rollouts never reach the learner, the lease fences epochs."""

import asyncio
import dataclasses
import random

import pytest
import torch

import delta_codec
from asyncrl.nats_server import EmbeddedServer
from bus import BusConfig, connect
from bus import topology as topo
from bus.weights.follower import WeightFollower
from delta_codec import signing
from policy.config import ModelConfig
from policy.model import Transformer, inference_state
from policy.sampling import SamplingConfig, SamplingMask
from tests.helpers.tolerance import forward_tol
from tests.helpers.trainer import MODEL, make_scored, publish_groups, trainer_config
from trainer import checkpoint
from trainer.batcher import Batch, Batcher, ConsumedIds, Sample
from trainer.config import TrainerConfig
from trainer.factory import build_learner, build_model, build_optimizer
from trainer.leader import Trainer
from trainer.learner import pack
from trainer.lease import LeaderLease, LeaseLost


async def test_step_lowers_loss_and_publishes_bit_exact_delta(bus, fresh_server, tmp_path):
    sk, pk = signing.generate_keypair()
    (tmp_path / "sk.hex").write_text(sk.hex())
    cfg = trainer_config(
        fresh_server.url, tmp_path, run={"max_steps": 1}, publish={"signing_key": str(tmp_path / "sk.hex")}
    )
    model, mcfg = build_model(cfg)
    learner = build_learner(model, build_optimizer(model, cfg), cfg)
    await publish_groups(bus, model, 2, 4)
    # the fixed batch, read back the way the trainer reads it, to measure the loss around the step
    probe = Batcher(bus, cfg, ConsumedIds(), mcfg.vocab_size)
    await probe.start()
    batch = await probe.next_batch(0)
    packed = pack(batch)
    for s in batch.samples:
        await s.msg.nak()  # hand them back to the trainer
    before = float(learner.loss(packed, grad=False)[0])
    tr = Trainer(cfg, bus, learner, mcfg)
    assert await asyncio.wait_for(tr.lead(asyncio.Event()), 120) == 0
    after = float(learner.loss(packed, grad=False)[0])
    assert tr.version == 1 and after < before
    # a worker-side state following WEIGHTS reproduces the trainer's bf16 bits exactly
    feed = WeightFollower(bus, public_key=pk)  # signed by the trainer's key
    target = await feed.latest_state()
    await feed.close()
    assert target.version == 1 and feed.applied["delta"] == 1 and not feed.refused
    stranger = WeightFollower(bus, public_key=signing.generate_keypair()[1])
    assert await stranger.latest_keyframe(wait=False) is None and stranger.refused["signature"] == 1
    await stranger.close()
    mine = inference_state(model)
    assert all(torch.equal(target.state[k].view(torch.int16), mine[k].view(torch.int16)) for k in mine)
    assert int((await bus.kv_get(topo.KEY_VERSION)).decode()) == 1
    # acked only after the checkpoint: nothing pending, and the checkpoint lists the used ids
    info = await bus.js.consumer_info(topo.SCORED, topo.TRAINER_CONSUMER)
    assert info.num_pending == 0 and info.num_ack_pending == 0
    st = checkpoint.load_latest(cfg.checkpoint.dir)
    assert st.version == 1 and sorted(st.consumed) == sorted(batch.rollout_ids)
    assert st.digest == delta_codec.state_digest(mine)


async def test_stale_dropped_duplicates_and_bad_rollouts_refused(bus, fresh_server, tmp_path):
    cfg = trainer_config(fresh_server.url, tmp_path, batch={"groups": 1, "group_size": 4, "max_lag": 2})
    model = Transformer(ModelConfig.from_dict(MODEL))
    rng = random.Random(1)
    versions = [10, 9, 7, 3]  # lags 0, 1, 3, 7 at version 10
    group = [make_scored(model, "s0", i, 4, v, rng) for i, v in enumerate(versions)]
    for sc in group:
        await bus.publish(topo.scored_subject("arith"), sc)
    await bus.publish(topo.scored_subject("arith"), group[0], msg_id="dup-of-s0-0")  # a second copy
    bad = make_scored(model, "s1", 0, 4, 10, rng, mask={"format": "full", "rows": 99})
    await bus.publish(topo.scored_subject("arith"), bad)
    consumed = ConsumedIds(["old-0"])
    old = make_scored(model, "old", 0, 4, 10, rng)  # already used before a restart
    await bus.publish(topo.scored_subject("arith"), old)
    b = Batcher(bus, cfg, consumed, 128)
    await b.start()
    batch = await b.next_batch(10)
    assert [s.lag for s in batch.samples] == [0, 1, 3, 7]
    assert [s.weight for s in batch.samples] == [1.0, 1.0, 0.0, 0.0]
    assert await b.next_batch(10, max_wait_s=1.5) is None  # drains the rest: nothing else forms a group
    assert b.counters["duplicates"] == 2 and b.counters["invalid"] == 1
    dlq = await bus.js.stream_info(topo.DLQ)
    assert dlq.state.messages == 1
    # the dropped samples change nothing in the loss
    learner = build_learner(model, build_optimizer(model, cfg), cfg)
    packed = pack(batch)
    # dropped samples are out of their group's baseline and their tokens weigh nothing
    scrambled = [
        s
        if s.weight > 0
        else dataclasses.replace(
            s, completion_ids=[5] * 9, logprobs=[-1.0] * 9, sampling_mask=SamplingMask.full(9).to_wire()
        )
        for s in packed
    ]
    l_all, st = learner.loss(packed, grad=False)
    l_live, _ = learner.loss(scrambled, grad=False)
    # why: other sequences in the micro-batches change their padding, so the live tokens' logprobs come from
    # other matmul shapes (another reduction order); the loss is their mean: forward_tol at its size
    tol = forward_tol(model.cfg, scale=float(l_all.abs()))
    assert st["n_tokens"] == 12 and torch.allclose(l_all, l_live, **tol)
    cfg.batch.stale = "downweight"
    b.groups.clear()
    assert [s.weight for s in (await _regroup(b, batch)).samples] == [1.0, 1.0, 0.5, 0.5**5]


async def _regroup(b, batch):
    for s in batch.samples:
        b.groups.setdefault(s.rollout.task_id, {})[s.rollout.rollout_id] = s
    return await b.next_batch(10)


async def test_lease_takeover_fences_epochs(bus):
    a = LeaderLease(bus, "A", ttl_s=1.5, renew_s=0.5)
    b = LeaderLease(bus, "B", ttl_s=1.5, renew_s=0.5)
    assert await a.try_acquire() and a.valid()
    assert not await b.try_acquire()
    await a.renew()
    t0 = asyncio.get_running_loop().time()
    e2 = await asyncio.wait_for(b.acquire(poll_s=0.1), 10)  # A stops renewing (paused)
    waited = asyncio.get_running_loop().time() - t0
    assert e2 > a.epoch and 1.0 < waited < 4.0
    with pytest.raises(LeaseLost):
        await a.renew()
    await b.release()  # graceful hand-over: immediate
    c = LeaderLease(bus, "C", ttl_s=1.5, renew_s=0.5)
    assert await c.try_acquire() and c.epoch > e2


async def test_incomplete_group_used_after_timeout(bus, fresh_server, tmp_path):
    cfg = trainer_config(
        fresh_server.url, tmp_path, batch={"groups": 1, "group_size": 4, "group_timeout_s": 1.0}
    )
    model = Transformer(ModelConfig.from_dict(MODEL))
    rng = random.Random(2)
    for i in range(2):  # two of four siblings ever arrive
        await bus.publish(topo.scored_subject("arith"), make_scored(model, "lonely", i, 4, 0, rng))
    await bus.publish(topo.scored_subject("arith"), make_scored(model, "single", 0, 4, 0, rng))
    b = Batcher(bus, cfg, ConsumedIds(), 128)
    await b.start()
    assert await b.next_batch(0, max_wait_s=0.5) is None  # still waiting for siblings
    batch = await b.next_batch(0, max_wait_s=10)
    assert sorted(batch.rollout_ids) == ["lonely-0", "lonely-1"] and [s.weight for s in batch.samples] == [
        1.0,
        1.0,
    ]
    batch = await b.next_batch(0, max_wait_s=10)  # a group of one: no baseline, consumed untrained
    assert batch.rollout_ids == ["single-0"] and batch.samples[0].weight == 0.0


def test_replay_uses_each_rollouts_fp8_sites_and_kept_sets(tmp_path):
    """Behaviour logprobs made under fp8 linear activations and top-k: the trainer's replay
    reproduces them exactly (ratio 1, k3 0); without replay the mismatch shows."""
    from policy import QuantConfig, SamplingMask, sample

    cfg = trainer_config("nats://unused", tmp_path)
    model, _ = build_model(cfg)
    quant = QuantConfig(sites=("linear_act",))
    sampling = SamplingConfig(temperature=0.8, top_k=5)
    g = torch.Generator().manual_seed(0)
    prompt, comp, lps, masks = [1, 20, 30, 40], [], [], []
    model.quant = quant
    with torch.no_grad():  # sample like a worker: fp8 sites on, top-k 5
        for _ in range(6):
            out = sample(model(torch.tensor([prompt + comp]))[0, -1][None], sampling, g)
            comp.append(int(out.tokens[0]))
            lps.append(float(out.logprobs[0]))
            masks.append(out.mask)
    model.quant = QuantConfig()
    sc = make_scored(model, "q", 0, 2, 0, random.Random(0))
    sc.rollout.update(
        prompt_ids=prompt,
        completion_ids=comp,
        logprobs=lps,
        quant=quant.to_wire(),
        sampling={"temperature": 0.8, "top_k": 5},
        sampling_mask=SamplingMask.concat(masks).to_wire(),
        token_versions=[0] * 6,
    )
    other = make_scored(model, "q", 1, 2, 0, random.Random(1), reward=0.0)  # a sibling: non-zero advantage
    packed = pack(Batch([Sample(s.get_rollout(), s, msg=None) for s in (sc, other)], n_groups=1, version=0))
    _, st = build_learner(model, build_optimizer(model, cfg), cfg).loss(packed, grad=False)
    assert st["k3_mean"] < 1e-9 and abs(st["ratio_mean"] - 1) < 1e-5
    naive = build_learner(
        model,
        build_optimizer(model, cfg),
        TrainerConfig(**{**cfg.__dict__, "loss": dataclasses.replace(cfg.loss, replay=False)}),
    )
    _, st2 = naive.loss(packed, grad=False)
    assert st2["k3_mean"] > 1e-4


async def test_overlapped_publication_checkpoints_the_right_digest_after_a_dropped_batch(
    bus, fresh_server, tmp_path
):
    """Version v publishes in the background while the next batch is handled; a batch whose
    samples are all dropped changes no weights, and its checkpoint must carry v's digest even
    though it was prepared before v's publication had finished."""
    from bus.weights.publisher import WeightPublisher

    cfg = trainer_config(fresh_server.url, tmp_path, batch={"groups": 1, "group_size": 4, "max_lag": 0})
    model, mcfg = build_model(cfg)
    tr = Trainer(cfg, bus, build_learner(model, build_optimizer(model, cfg), cfg), mcfg)
    epoch = await tr.lease.acquire(asyncio.Event())
    await asyncio.to_thread(tr.prepare)
    publisher = WeightPublisher(bus, epoch, cfg.trainer_id, None)
    await publisher.publish_keyframe(tr.published, 0, mcfg)
    rng = random.Random(3)
    for task in ("a", "b"):
        for i in range(4):
            await bus.publish(topo.scored_subject("arith"), make_scored(model, task, i, 4, 0, rng))
    batcher = Batcher(bus, cfg, tr.consumed, mcfg.vocab_size)
    await batcher.start()
    live, stale = await batcher.next_batch(0), await batcher.next_batch(1)  # lag 1 > max_lag 0
    assert all(s.weight == 0 for s in stale.samples)
    lost = asyncio.Event()
    first = await tr.train_on(live, batcher, publisher, lost)
    second = await tr.train_on(stale, batcher, publisher, lost, first)
    await second
    st = checkpoint.load_latest(cfg.checkpoint.dir)
    assert tr.version == st.version == 1
    assert st.digest == delta_codec.state_digest(inference_state(model))
    assert sorted(st.consumed) == sorted(live.rollout_ids + stale.rollout_ids)
    # acks are one-way messages: the server may count them a moment after (fsync'd consumer state)
    for _ in range(100):
        info = await bus.js.consumer_info(topo.SCORED, topo.TRAINER_CONSUMER)
        if info.num_ack_pending == 0:
            break
        await asyncio.sleep(0.1)
    assert info.num_ack_pending == 0 and info.num_pending == 0
    await batcher.close()


async def test_checkpoint_every_k_acks_only_after_the_checkpoint_and_a_crash_retrains_the_rest(
    bus, fresh_server, tmp_path
):
    """checkpoint_every = 3: versions 1, 2 and 4 go out uncheckpointed and their batches stay
    unacked until a checkpoint records them (v3 acks 1-3); the leader then dies before v4's
    checkpoint: the next leader resumes from v3, trains the redelivered batch of v4 again (the
    only one re-trained) and the last one, checkpoints its final version on a clean end, and
    every rollout is recorded consumed once, nothing left pending."""
    import json

    from bus.weights.publisher import WeightPublisher

    cfg = trainer_config(
        fresh_server.url,
        tmp_path,
        batch={"groups": 1, "group_size": 4, "max_lag": 1000},
        checkpoint={"every": 3},
    )
    model, mcfg = build_model(cfg)
    tr = Trainer(cfg, bus, build_learner(model, build_optimizer(model, cfg), cfg), mcfg)
    epoch = await tr.lease.acquire(asyncio.Event())
    await asyncio.to_thread(tr.prepare)
    publisher = WeightPublisher(bus, epoch, cfg.trainer_id, None)
    await publisher.publish_keyframe(tr.published, 0, mcfg)
    await publish_groups(bus, model, 5, 4, prefix="g")
    batcher = Batcher(bus, cfg, tr.consumed, mcfg.vocab_size)
    await batcher.start()
    lost, ids = asyncio.Event(), []

    async def pending(want: int = 0) -> int:
        # acks are one-way messages the server counts a moment after (fsync'd consumer state): wait
        # up to 10 s for `want`; acks only ever lower the count, so an early ack still shows
        for _ in range(100):
            n = (await bus.js.consumer_info(topo.SCORED, topo.TRAINER_CONSUMER)).num_ack_pending
            if n <= want:
                return n
            await asyncio.sleep(0.1)
        return n

    for v in range(1, 5):
        batch = await batcher.next_batch(tr.version)
        ids.append(sorted(batch.rollout_ids))
        await (await tr.train_on(batch, batcher, publisher, lost))
        st = checkpoint.load_latest(cfg.checkpoint.dir)
        assert int((await bus.kv_get(topo.KEY_VERSION)).decode()) == v  # published at once
        assert st.version == (3 if v >= 3 else 0), (v, st.version)
        assert await pending(4 * (v % 3)) == 4 * (v % 3), v  # unacked until a checkpoint records them
    assert sorted(st.consumed) == sorted(x for b in ids[:3] for x in b)
    await batcher.close()  # the leader dies: what it held comes back (nak: at once)
    await tr.lease.release()
    cfg2 = trainer_config(
        fresh_server.url,
        tmp_path,
        trainer_id="T2",
        batch={"groups": 1, "group_size": 4, "max_lag": 1000},
        checkpoint={"every": 3},
        run={"max_steps": 5},
    )
    model2, _ = build_model(cfg2)
    tr2 = Trainer(cfg2, bus, build_learner(model2, build_optimizer(model2, cfg2), cfg2), mcfg)
    assert await asyncio.wait_for(tr2.lead(asyncio.Event()), 120) == 0
    st = checkpoint.load_latest(cfg.checkpoint.dir)
    assert tr2.version == st.version == 5 and st.epoch > epoch  # the clean end checkpoints v5
    assert sorted(st.consumed) == sorted(f"g{g}-{i}" for g in range(5) for i in range(4))
    assert await pending() == 0
    info = await bus.js.consumer_info(topo.SCORED, topo.TRAINER_CONSUMER)
    assert info.num_pending == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics" / "trainer.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "rollout_ids" in r]
    second = [r for r in rows if r["epoch"] > epoch]
    assert [r["version"] for r in second] == [4, 5]  # v4 re-trained, once more
    assert sorted(second[0]["rollout_ids"]) == ids[3]
    assert [r["checkpointed"] for r in rows] == [False, False, True, False, False, False]
    assert all(r["checkpoint_s"] >= 0 and r["publish_s"] > 0 for r in rows)


async def test_delta_context_publishes_classed_positions_a_follower_applies(bus, fresh_server, tmp_path):
    """`delta_context = true`: the leader codes sparse float chunks by base class (CLASSED); a
    follower applies the version bit-exact. Off, or "auto" (the default) on a freshly initialised
    model, no chunk is CLASSED. Each version's metrics carry the encode time and its share of the step."""
    import json

    from bus.events import DeltaEvent, decode
    from delta_codec.modes import CLASSED
    from delta_codec.record import chunks_of

    for on in (True, False, "auto"):
        async with EmbeddedServer(store_dir=tmp_path / f"nats-{on}") as srv:
            b = await connect(BusConfig(servers=[srv.url], name="t"))
            try:
                await b.provision()
                cfg = trainer_config(
                    srv.url,
                    tmp_path / f"run-{on}",
                    run={"max_steps": 1},
                    optim={"lr": 3e-5},
                    publish={"delta_context": on},
                )
                model, mcfg = build_model(cfg)
                learner = build_learner(model, build_optimizer(model, cfg), cfg)
                await publish_groups(b, model, 2, 4)
                tr = Trainer(cfg, b, learner, mcfg)
                assert await asyncio.wait_for(tr.lead(asyncio.Event()), 120) == 0 and tr.version == 1
                raw = await b.js.get_last_msg(topo.WEIGHTS, "rl.weights.delta")
                ev = decode(raw.data, DeltaEvent)
                data = ev.payload if ev.payload is not None else await b.get_blob(ev.blob)
                d = delta_codec.Delta.from_bytes(data)
                modes = {int(c[0]) for r in d.records for c in chunks_of(r)}
                assert (CLASSED in modes) == (on is True), modes
                row = json.loads(
                    (tmp_path / f"run-{on}" / "run" / "metrics" / "trainer.jsonl")
                    .read_text()
                    .splitlines()[-1]
                )
                assert row["version"] == 1 and 0 < row["encode_s"] and row["step_s"] > 0
                assert row["encode_frac"] == pytest.approx(row["encode_s"] / row["step_s"])
                assert row["threads"] == torch.get_num_threads()  # what the step computed with
                feed = WeightFollower(b)
                target = await feed.latest_state()
                await feed.close()
                mine = inference_state(model)
                assert target.version == 1
                assert all(
                    torch.equal(target.state[k].view(torch.int16), mine[k].view(torch.int16)) for k in mine
                )
            finally:
                await b.close()


async def test_uniform_groups_skipped_acked_at_once_and_recorded(bus, fresh_server, tmp_path):
    """skip_uniform_groups: a group whose rewards are all equal is acked at once and recorded with
    the next version; the step trains on the mixed groups only, and its success counts every episode."""
    cfg = trainer_config(fresh_server.url, tmp_path, run={"max_steps": 1}, batch={"skip_uniform": True})
    model, mcfg = build_model(cfg)
    learner = build_learner(model, build_optimizer(model, cfg), cfg)
    rng = random.Random(3)
    for tid, rewards in (
        ("zero", [0, 0, 0, 0]),
        ("mixA", [0, 1, 0, 1]),
        ("one", [1, 1, 1, 1]),
        ("mixB", [1, 0, 0, 0]),
    ):
        for i, r in enumerate(rewards):
            await bus.publish(
                topo.scored_subject("arith"), make_scored(model, tid, i, 4, 0, rng, reward=float(r))
            )
    tr = Trainer(cfg, bus, learner, mcfg)
    assert await asyncio.wait_for(tr.lead(asyncio.Event()), 120) == 0
    assert tr.version == 1
    st = checkpoint.load_latest(cfg.checkpoint.dir)
    assert sorted(st.consumed) == sorted(
        f"{t}-{i}" for t in ("zero", "mixA", "one", "mixB") for i in range(4)
    )
    info = await bus.js.consumer_info(topo.SCORED, topo.TRAINER_CONSUMER)
    assert info.num_pending == 0 and info.num_ack_pending == 0
    import json

    row = [json.loads(x) for x in (tmp_path / "run" / "metrics" / "trainer.jsonl").read_text().splitlines()][
        -1
    ]
    assert sorted(row["trained_ids"]) == sorted(f"{t}-{i}" for t in ("mixA", "mixB") for i in range(4))
    assert row["uniform_groups_skipped"] == 2 and row["groups"] == 2
    assert row["success_mean"] == pytest.approx(7 / 16)  # every episode the version consumed
    assert sorted(row["dropped_ids"]) == sorted(f"{t}-{i}" for t in ("zero", "one") for i in range(4))


def test_delta_context_auto_is_on_for_a_pretrained_start_only(tmp_path):
    """The default "auto" codes by context when the trainer starts from a pretrained checkpoint
    (deploy/smollm2.toml as shipped) and not for the toy's fresh weights; an explicit value wins;
    anything else is refused with the allowed values."""
    from kernel.config import ConfigError, load_config

    assert TrainerConfig().publish.delta_context == "auto" and not TrainerConfig().use_delta_context
    assert TrainerConfig(policy={"init_checkpoint": "/some/hf"}).use_delta_context
    assert not TrainerConfig(
        policy={"init_checkpoint": "/some/hf"}, publish={"delta_context": False}
    ).use_delta_context
    assert TrainerConfig(publish={"delta_context": True}).use_delta_context
    smol = load_config(TrainerConfig, "deploy/smollm2.toml", section="trainer", environ={})
    assert smol.policy.init_checkpoint and smol.publish.delta_context == "auto" and smol.use_delta_context
    toy = load_config(TrainerConfig, None, environ={"ASYNCRL_PUBLISH__DELTA_CONTEXT": "off"})
    assert toy.publish.delta_context is False
    (tmp_path / "t.toml").write_text('[publish]\ndelta_context = "sometimes"\n')
    with pytest.raises(ConfigError, match="delta_context.*auto"):
        load_config(TrainerConfig, tmp_path / "t.toml", environ={})


def test_skip_uniform_groups_refused_in_sync_mode():
    with pytest.raises(ValueError, match="skip_uniform"):
        TrainerConfig(run={"mode": "sync"}, batch={"skip_uniform": True})
