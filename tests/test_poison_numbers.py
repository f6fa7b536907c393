"""One bad number must not poison the fleet.

Every number of a Rollout and a Scored is validated on decode, whole lists (a reason naming the
field and the index); the trainer checks ids against its vocabulary and parks a bad scored
rollout at once without losing the rest of its batch; the scorer parks a rollout whose cost is
not finite at once; a consumer loop parks bad input on its first delivery; workers refuse a
delta or keyframe whose result is NaN/±inf (state untouched) even when it is validly signed; and
the short `poison_numbers` chaos scenario (real processes) holds the books.
"""

from __future__ import annotations

import asyncio
import math
import random

import msgpack
import msgspec
import numpy as np
import pytest
import torch

import delta_codec
from bench.chaoskit.scenarios_poison import (
    base_rollout,
    poison_numbers,
    rollout_poisons,
    scored_of,
    scored_poisons,
)
from bus import BusConfig, ConsumerLoop, TopologyConfig, connect
from bus import topology as topo
from bus.events import EventError, Rollout, Scored, decode
from bus.weights.follower import StateTarget, WeightFollower
from bus.weights.publisher import WeightPublisher
from delta_codec import signing
from delta_codec.errors import NonFiniteError
from policy.config import ModelConfig
from policy.model import Transformer
from policy.reward import price
from policy.sampling import SamplingMask
from rollout_worker.torch_engine import TorchEngine
from scorer.config import ScorerConfig
from scorer.service import Scorer
from tests.helpers.engine import CFG as ENGINE_CFG
from tests.helpers.trainer import MODEL, make_scored, trainer_config
from tests.helpers.weights import CFG as WEIGHTS_CFG
from tests.helpers.weights import same, trajectory, until
from trainer.batcher import Batcher, ConsumedIds, check_rollout

VOCAB = 128


# -- events: every field, every bad value ------------------------------------------------------
@pytest.mark.parametrize(
    "field,bad,named",
    rollout_poisons(VOCAB, short=False),
    ids=lambda x: str(x)[:30] if isinstance(x, str) else None,
)
def test_every_bad_rollout_number_is_refused_naming_its_field(field, bad, named):
    """Bare (what the scorer decodes) and inside a Scored (what the trainer decodes); an id out of
    the vocabulary passes decode (it knows no vocabulary) and is refused by check_rollout."""
    ro = {**base_rollout("poison-r-0"), **bad}
    for body, cls in ((ro, Rollout), (scored_of(ro), Scored)):
        with pytest.raises(EventError) as e:
            ev = decode(msgpack.packb(body), cls)
            check_rollout(ev if cls is Rollout else ev.get_rollout(), VOCAB)
        assert named in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "field,bad,named", scored_poisons(short=False), ids=lambda x: str(x)[:30] if isinstance(x, str) else None
)
def test_every_bad_score_is_refused_naming_its_field(field, bad, named):
    with pytest.raises(EventError, match=named):
        decode(msgpack.packb(scored_of(base_rollout("poison-s-0"), **bad)), Scored)


def test_whole_lists_are_checked_not_a_prefix():
    """The old decode type-checked the first 8 elements only: a string at 10,000 went through."""
    n = 20_000
    ro = {
        **base_rollout("long-0"),
        "completion_ids": [5] * n,
        "logprobs": [-0.5] * n,
        "token_versions": [3] * n,
    }
    good = decode(msgpack.packb(ro), Rollout)
    check_rollout(good, VOCAB)
    for field, at, value, why in (
        ("logprobs", 10_000, "x", r"logprobs\[10000\] is a str"),
        ("logprobs", n - 1, math.nan, r"logprobs\[19999\] = nan is not finite"),
        ("logprobs", 17, -math.inf, r"logprobs\[17\] = -inf is not finite"),
        ("logprobs", 9, 0.25, r"logprobs\[9\] = 0.25 is outside"),
        ("completion_ids", 12_345, True, r"completion_ids\[12345\] is a bool"),
        ("completion_ids", 9_000, 1.0, r"completion_ids\[9000\] is a float"),
        ("completion_ids", 15_000, -4, r"completion_ids\[15000\] = -4 is outside"),
        ("token_versions", 11_111, 2, r"token_versions\[11111\] = 2 goes back from 3"),
    ):
        lst = list(ro[field])
        lst[at] = value
        with pytest.raises(EventError, match=why):
            decode(msgpack.packb({**ro, field: lst}), Rollout)


def test_observation_tokens_and_episode_rollouts_still_pass():
    """-1 versions on observation tokens (loss mask 0) are not a decrease; 0.0 logprobs are fine."""
    ro = {
        **base_rollout("ep-0"),
        "completion_ids": [4, 5, 6, 7],
        "logprobs": [-1.0, 0.0, 0.0, -2.0],
        "token_versions": [2, -1, -1, 3],
        "loss_mask": [1, 0, 0, 1],
        "turns": 2,
    }
    check_rollout(decode(msgpack.packb(ro), Rollout), VOCAB)
    with pytest.raises(EventError, match=r"token_versions\[3\] = 1 goes back from 2"):
        decode(msgpack.packb({**ro, "token_versions": [2, -1, -1, 1]}), Rollout)


def test_validate_refuses_what_numpy_would_coerce():
    """An event built in this process is checked as decode checks it (a Struct's constructor checks
    no types); numpy scalars are refused too (the wire carries none)."""
    ro = Rollout(**{k: v for k, v in base_rollout("c-0").items() if k not in ("schema", "kind")})
    ro.validate()
    for field, value, why in (
        ("completion_ids", [4, True, 6], r"completion_ids\[1\] is a bool \(True\), expected `int`"),
        ("completion_ids", [4, 2**64 - 1, 6], r"completion_ids\[1\] = 18446744073709551615 is outside"),
        ("completion_ids", [4, np.int64(5), 6], r"completion_ids\[1\] is a int64"),
        ("logprobs", [-0.1, -(10**400), -0.3], r"logprobs\[1\] = -1000.* is outside its bounds"),
        ("wall_s", math.nan, r"wall_s = nan is not finite"),
    ):
        with pytest.raises(EventError, match=why):
            msgspec.structs.replace(ro, **{field: value}).validate()


# -- the trainer's arrival check ---------------------------------------------------------------
def test_check_rollout_knows_the_vocabulary_and_the_kept_sets():
    ro = Rollout(**{k: v for k, v in base_rollout("c-0").items() if k not in ("schema", "kind")})
    check_rollout(ro, VOCAB)
    with pytest.raises(EventError, match=r"completion_ids\[2\] = 6 outside the vocabulary \[0, 6\)"):
        check_rollout(ro, 6)
    keeps = SamplingMask([1, 2, -1], [4, 9, 77])  # row 1 keeps 9, 77 but sampled 5
    with pytest.raises(EventError, match="sampling_mask row 1 does not keep the sampled token"):
        check_rollout(msgspec.structs.replace(ro, sampling_mask=keeps.to_wire()), VOCAB)
    wide = SamplingMask([1, 2, -1], [4, 5, 500])
    with pytest.raises(EventError, match="sampling_mask keeps id 500 outside the vocabulary"):
        check_rollout(msgspec.structs.replace(ro, sampling_mask=wide.to_wire()), VOCAB)
    kept = SamplingMask([1, 2, -1], [4, 5, 9])
    check_rollout(msgspec.structs.replace(ro, sampling_mask=kept.to_wire()), VOCAB)
    # int(inf) raises OverflowError, which the old check let through to crash the leader
    with pytest.raises(EventError, match="OverflowError|cannot convert float infinity"):
        check_rollout(msgspec.structs.replace(ro, sampling={"top_k": math.inf}), VOCAB)
    # a Rollout built in-process (no decode) is validated too
    with pytest.raises(EventError, match=r"logprobs\[1\] is a str"):
        check_rollout(msgspec.structs.replace(ro, logprobs=[-0.1, "x", -0.3]), VOCAB)


async def test_batcher_parks_poisoned_scored_at_once_and_trains_the_rest(bus, fresh_server, tmp_path):
    """A string in a logprob list crashed the leader on each redelivery: now it is parked on its
    first delivery with the field named, and the good group beside it forms the batch."""
    cfg = trainer_config(fresh_server.url, tmp_path, batch={"groups": 1, "group_size": 2})
    model = Transformer(ModelConfig.from_dict(MODEL))
    rng = random.Random(3)
    good = [make_scored(model, "g0", i, 2, 0, rng) for i in range(2)]
    poisoned = []
    for k, (field, value) in enumerate(
        (("logprobs", "x"), ("logprobs", math.nan), ("completion_ids", 500), ("wall_s", math.inf))
    ):
        sc = make_scored(model, f"p{k}", 0, 2, 0, rng).to_dict()
        ro = sc["rollout"]
        ro[field] = value if not isinstance(ro[field], list) else [ro[field][0], value, *ro[field][2:]]
        poisoned.append((sc, field))
    await bus.publish(topo.scored_subject("arith"), good[0])
    for sc, field in poisoned:
        await bus.publish(topo.scored_subject("arith"), msgpack.packb(sc), msg_id=f"poison-{field}-{id(sc)}")
    await bus.publish(topo.scored_subject("arith"), good[1])
    b = Batcher(bus, cfg, ConsumedIds(), VOCAB)
    await b.start()
    try:
        batch = await b.next_batch(0, max_wait_s=20)
        assert sorted(batch.rollout_ids) == ["g0-0", "g0-1"]
        assert b.counters["invalid"] == len(poisoned)
    finally:
        await b.close()
    sub = await bus.js.pull_subscribe(topo.dlq_subject(topo.SCORED), stream=topo.DLQ)
    dead = await sub.fetch(len(poisoned), timeout=5)
    reasons = sorted(m.headers["Rl-Reason"] for m in dead)
    assert all(m.headers["Rl-Deliveries"] == "1" for m in dead)
    for _, field in poisoned:
        assert sum(field in r for r in reasons) >= 1, (field, reasons)


# -- the scorer --------------------------------------------------------------------------------
def test_price_names_the_bad_input():
    with pytest.raises(ValueError, match="bad reward input cost"):
        price(1.0, math.nan, 0.1)
    with pytest.raises(ValueError, match="bad reward input success"):
        price(math.nan, 1.0, 0.1)
    with pytest.raises(ValueError, match="penalty .* is not finite"):
        price(1.0, 1e300, 1e300)


async def test_scorer_parks_a_non_finite_cost_at_once(tmp_path):
    """A rollout built in-process (the decode path refuses NaN wall_s earlier): the cost is not
    finite, and the scorer raises EventError (parked at once), not ValueError (retried)."""
    sc = Scorer(ScorerConfig(reward={"cost_unit": "wall_s"}))
    ro = Rollout(
        **{
            **{k: v for k, v in base_rollout("w-0").items() if k not in ("schema", "kind")},
            "wall_s": math.nan,
        }
    )
    try:
        with pytest.raises(EventError, match="bad reward input cost.*wall_s=nan"):
            await sc.handle(ro, None)  # verified (arith), then the reward: before any publish
    finally:
        sc.pool.shutdown(wait=False)


async def test_consumer_loop_parks_bad_numbers_on_first_delivery_and_acks_the_rest(fresh_server):
    """ROLLOUTS through a real ConsumerLoop: a NaN logprob (decode) and a handler's EventError
    (a non-finite cost) each parked once, with no retry; the good ones beside them acked."""
    b = await connect(
        BusConfig(
            servers=[fresh_server.url], name="c", topology=TopologyConfig(ack_wait_s=2.0, max_deliver=3)
        )
    )
    await b.provision()
    try:
        bodies = {f"ok{i}-0": base_rollout(f"ok{i}-0") for i in range(4)}
        bodies["nan-0"] = {**base_rollout("nan-0"), "logprobs": [-0.1, math.nan, -0.3]}
        bodies["cost-0"] = base_rollout("cost-0")
        for rid, body in bodies.items():
            await b.publish(topo.rollout_subject("arith"), msgpack.packb(body), msg_id=rid)
        seen: list[str] = []

        async def handler(ev, ctx):
            seen.append(ev.rollout_id)
            if ev.rollout_id == "cost-0":
                raise EventError("Rollout cost-0: bad reward input cost")

        loop = ConsumerLoop(b, topo.ROLLOUTS, topo.SCORER_CONSUMER, handler, Rollout, handle_signals=False)
        stop = asyncio.Event()
        runner = asyncio.create_task(loop.run(stop))
        await until(lambda: loop.stats.dlq == 2 and loop.stats.acked == 4, timeout=20)
        await asyncio.sleep(2.5)  # past ack_wait: nothing comes back
        stop.set()
        await asyncio.wait_for(runner, 15)
        assert sorted(seen) == sorted(r for r in bodies if r != "nan-0")  # each handled once
        sub = await b.js.pull_subscribe(topo.dlq_subject(topo.ROLLOUTS), stream=topo.DLQ)
        dead = {m.headers["Rl-Reason"]: m.headers["Rl-Deliveries"] for m in await sub.fetch(2, timeout=5)}
        assert set(dead.values()) == {"1"}, dead
        assert any("logprobs[1] = nan is not finite" in r for r in dead), dead
        assert (await b.js.stream_info(topo.ROLLOUTS)).state.messages == 0
    finally:
        await b.close()


# -- workers refuse non-finite weights --------------------------------------------------------
def nan_at(state: dict, name: str, index: int, value: float = math.nan) -> dict:
    out = {k: v.clone() for k, v in state.items()}
    out[name].view(-1)[index] = value
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_apply_delta_refuses_a_non_finite_result_and_rolls_back(dtype, dense, bad):
    g = torch.Generator().manual_seed(0)
    base = {
        "a": torch.randn(4096, generator=g).to(dtype),
        "b": torch.randn(64, 33, generator=g).to(dtype),
        "ids": torch.arange(10),
    }
    new = {k: v.clone() for k, v in base.items()}
    if dense:  # every element moves: a dense chunk
        new["b"] = (new["b"].float() * 1.5 + 0.25).to(dtype)
    new["a"][100] += 1
    new = nan_at(new, "b", 1234, bad)
    d = delta_codec.encode_delta(base, new, from_version=0, to_version=1)
    d = delta_codec.Delta.from_bytes(d.to_bytes())
    state = {k: v.clone() for k, v in base.items()}
    with pytest.raises(NonFiniteError, match=r"tensor 'b'.* element 1234 NaN or ±inf"):
        delta_codec.apply_delta(state, d, finite=True)
    assert same(state, base)  # bit for bit: the 'a' change rolled back too
    delta_codec.apply_delta(state, d)  # the codec itself stays lossless
    assert same(state, new) or torch.isnan(state["b"]).any()


def test_keyframe_with_nan_is_refused_and_into_untouched():
    s = trajectory(1)[0]
    name = next(iter(s))
    kf = delta_codec.make_keyframe(nan_at(s, name, 7), version=3).to_bytes()
    with pytest.raises(NonFiniteError, match=rf"{name}.*element 7"):
        delta_codec.load_keyframe(kf, finite=True)
    into = {k: v.clone() for k, v in s.items()}
    with pytest.raises(NonFiniteError):
        delta_codec.load_keyframe(kf, into=into, finite=True)
    assert same(into, s)
    assert torch.isnan(delta_codec.load_keyframe(kf)[name].view(-1)[7])  # lossless without the check


async def test_follower_refuses_a_signed_nan_delta_and_keyframe_then_follows(bus):
    """Signed with the run's key, right fields, right digests: only the finiteness check stops it.
    The state is untouched, the refusal is counted as `nonfinite`, the next good delta applies."""
    sk, pk = signing.generate_keypair()
    states = trajectory(3)
    pub = WeightPublisher(bus, epoch=1, trainer_id="T", signing_key=sk)
    await pub.publish_keyframe(states[0], 0, WEIGHTS_CFG)
    feed = WeightFollower(bus, public_key=pk, poll_s=0.05)
    start = await feed.latest_keyframe()
    name = next(iter(states[0]))
    poisoned = nan_at(states[0], name, 5)
    # (each version's Nats-Msg-Id is its own: the good deltas skip the NaN one's version)
    await pub.publish_delta(delta_codec.encode_delta(states[0], poisoned, from_version=0, to_version=1))
    await pub.publish_delta(delta_codec.encode_delta(states[0], states[1], from_version=0, to_version=2))
    await pub.publish_keyframe(nan_at(states[1], name, 9), 3, WEIGHTS_CFG, set_version=False)
    await pub.publish_delta(delta_codec.encode_delta(states[1], states[2], from_version=2, to_version=3))
    target, stop = StateTarget(), asyncio.Event()
    following = asyncio.create_task(feed.follow(target, stop, start=start))
    try:
        await until(lambda: target.version == 3, timeout=30)
    finally:
        stop.set()
        await asyncio.wait_for(following, 10)
        await feed.close()
    # the NaN delta, the NaN keyframe (and the resync after the delta finds that keyframe too)
    assert feed.refused["nonfinite"] >= 2 and set(feed.refused) == {"nonfinite"}, feed.stats()
    assert (target.version, target.epoch) == (3, 1) and same(target.state, states[2])
    assert all(torch.isfinite(v.float()).all() for v in target.state.values())
    # a fresh follower finds only the NaN keyframe as the latest: it refuses it and waits
    fresh = WeightFollower(bus, public_key=pk)
    assert await fresh.latest_keyframe(wait=False) is None and fresh.refused["nonfinite"] == 1


async def test_a_sharded_version_with_nan_rows_is_refused_whole(bus):
    """Rank 0's part is fine, rank 1's rows hold NaN: the version is refused (`nonfinite`) and
    rank 0's rows, already applied, are rolled back."""
    from bus.weights.manifest import publish_sharded
    from delta_codec.sharded import encode_part, shard_rows

    states = trajectory(2, seed=7)
    name = next(n for n, t in states[0].items() if t.dim() == 2 and t.shape[0] > 1)
    new = nan_at(states[1], name, states[1][name].numel() - 1)  # the last row: rank 1's
    parts = []
    for r in range(2):
        rows = {n: shard_rows(t.shape[0], r, 2) for n, t in states[0].items()}
        # B023: the lambda is called in this iteration only
        cut = lambda st: {n: st[n][a:b] for n, (a, b) in rows.items()}  # noqa: E731, B023
        parts.append(encode_part(cut(states[0]), cut(new), rows, from_version=0, to_version=1).to_bytes())
    pub = WeightPublisher(bus, epoch=1, trainer_id="t1")
    await pub.publish_keyframe(states[0], 0, WEIGHTS_CFG)
    await publish_sharded(pub, parts, from_version=0, to_version=1, model_config=WEIGHTS_CFG)
    feed = WeightFollower(bus, name="m")
    target = await feed.latest_state()
    assert feed.refused["nonfinite"] == 1, feed.stats()
    assert target.version == 0 and same(target.state, states[0])


@pytest.mark.parametrize("update_mode", ["swap", "inline"])
async def test_torch_engine_refuses_a_nan_delta_with_weights_and_version_untouched(update_mode):
    import policy

    torch.manual_seed(0)
    s0 = policy.inference_state(policy.Transformer(ENGINE_CFG))
    eng = TorchEngine(ENGINE_CFG, slots=1, max_len=32, update_mode=update_mode)
    try:
        await eng.load_keyframe(s0, version=0, epoch=1)
        before = {k: v.clone() for k, v in eng.state.items()}
        params = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
        name = next(k for k, v in s0.items() if v.is_floating_point())
        bad = delta_codec.encode_delta(s0, nan_at(s0, name, 3, math.inf), from_version=0, to_version=1)
        with pytest.raises(NonFiniteError):
            await eng.apply_delta(bad, epoch=1)
        assert eng.version == 0 and same(eng.state, before)
        assert all(torch.equal(v, params[k]) for k, v in eng.model.state_dict().items())
    finally:
        await eng.close()


# -- the chaos scenario, short form (the full one: tests/test_poison_numbers.py -m chaos) -----
@pytest.mark.timeout(500)
async def test_poison_numbers_short(tmp_path):
    r = await poison_numbers(tmp_path, tasks=16, short=True)
    assert r["lost"] == 0 and r["duplicates_trained"] == 0, r
    assert r["parked"] == r["bad_events"] and not r["missing"] and not r["unnamed"] and not r["retried"], r
    assert r["nonfinite_published"] == 0 and r["versions_checked"] >= 2 and r["nonfinite_sampled"] == 0, r
    assert all(w.get("nonfinite", 0) >= 1 for w in r["worker_refusals"].values()), r
    assert r["passed"], r


@pytest.mark.chaos
@pytest.mark.timeout(900)
async def test_poison_numbers_full(tmp_path):
    r = await poison_numbers(tmp_path, tasks=60, short=False)
    assert r["lost"] == 0 and r["duplicates_trained"] == 0, r
    assert r["parked"] == r["bad_events"] and not r["unnamed"] and not r["retried"], r
    assert r["passed"], r
