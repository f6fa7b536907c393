"""A trainer that cannot publish a non-finite weight: the log-ratio is clamped
before any exponent, a step with a non-finite loss or gradient norm leaves parameters and
optimizer state bit-identical and parks what poisoned it, non-finite bf16 weights are refused."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from bench.chaoskit.streams import dlq_entries
from bus import topology as topo
from bus.weights.follower import WeightFollower
from kernel import metrics
from kernel.lifetime import cancel_and_wait
from policy import ModelConfig, SamplingConfig, Transformer, sequence_logprobs
from tests.helpers.trainer import publish_groups, trainer_config
from trainer import checkpoint
from trainer.batcher import Batcher
from trainer.factory import build_learner, build_model, build_optimizer
from trainer.leader import Trainer
from trainer.learner import Learner, PackedSample
from trainer.loss import LossConfig, pg_loss
from trainer.published import NonFiniteWeights, check_finite_state

V = 50


def test_far_off_policy_token_with_weight_zero_gives_a_finite_loss_and_gradient():
    """behav = -1e3: exp(logp - behav) overflows fp32 and inf * 0 is NaN; clamped it stays finite."""
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    behav = torch.tensor([-1e3, -2.1, -0.4])
    adv = torch.tensor([1.0, -1.0, 0.5])
    for mode in ("truncated", "masked", "none"):
        for weight in (torch.tensor([0.0, 1.0, 1.0]), torch.ones(3)):
            logp.grad = None
            loss, _ = pg_loss(
                logp,
                behav,
                adv,
                weight,
                3,
                LossConfig(is_mode=mode, kl_coef=0.1),
                entropy=torch.ones(3),
                ref=torch.tensor([-1e3, -2.0, -0.5]),
            )
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), (mode, weight)


def _model(seed=0):
    torch.manual_seed(seed)
    return Transformer(
        ModelConfig.tiny(vocab_size=V, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    )


def _batch(model, poison=None) -> list[PackedSample]:
    rng = random.Random(0)
    out = []
    for i in range(4):
        prompt, comp = [1, 2, 3], [rng.randrange(3, V) for _ in range(5)]
        with torch.no_grad():
            lp = sequence_logprobs(model, [prompt], [comp], SamplingConfig()).logprobs[0]
        out.append(
            PackedSample(
                f"r{i}",
                i // 2,
                float(i % 2),
                1.0,
                0,
                prompt,
                comp,
                [float(x) - 0.05 for x in lp],
                {"temperature": 1.0},
                {},
                {},
            )
        )
    if poison is not None:
        out[1].logprobs[2] = poison
    return out


def _snapshot(learner: Learner):
    params = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    opt = learner.opt.state_dict()
    state = {
        k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in st.items()}
        for k, st in opt["state"].items()
    }
    return params, state, [dict(g) for g in opt["param_groups"]]


def _identical(a, b) -> bool:
    pa, sa, ga = a
    pb, sb, gb = b
    return (
        pa.keys() == pb.keys()
        and all(torch.equal(pa[k].view(torch.int32), pb[k].view(torch.int32)) for k in pa)
        and sa.keys() == sb.keys()
        and all(
            torch.equal(sa[k][n], sb[k][n]) if torch.is_tensor(sa[k][n]) else sa[k][n] == sb[k][n]
            for k in sa
            for n in sa[k]
        )
        and ga == gb
    )


@pytest.mark.parametrize("poison", [float("nan"), float("-inf")])
def test_step_on_a_batch_with_a_nonfinite_logprob_leaves_parameters_and_optimizer_bit_identical(poison):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    learner = Learner(model, opt, LossConfig(), grad_clip=1.0)
    assert "skipped" not in learner.step(_batch(model))  # AdamW has moments and a step count now
    before = _snapshot(learner)
    out = learner.step(_batch(model, poison=poison))
    assert out["skipped"] in ("nonfinite_loss", "nonfinite_grad")
    assert _identical(before, _snapshot(learner))
    assert all(p.grad is None for p in model.parameters())  # no poisoned gradient left behind
    # the next good batch trains as usual
    assert "skipped" not in learner.step(_batch(model)) and not _identical(before, _snapshot(learner))


def test_nonfinite_bf16_weights_are_refused_before_encoding():
    model = _model()
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.0), LossConfig())
    state = learner.publication.published_state()
    check_finite_state(state, 1)  # finite: nothing to say
    learner.publication.mark_published()
    with torch.no_grad():
        model.layers[0].mlp.up_proj.weight[3, 4] = float("inf")
    with pytest.raises(NonFiniteWeights, match="refusing to publish"):
        check_finite_state(learner.publication.published_state(), 2)
    with pytest.raises(NonFiniteWeights, match="refusing to publish"):
        learner.publication.publish_parts(1, 2)  # the sharded path's encode, same guard


async def test_leader_parks_the_poisoning_rollout_and_trains_the_rest(bus, fresh_server, tmp_path):
    """Defence in depth: a NaN logprob that got past the edge checks (poked into a batch read from
    the bus) skips the step with the weights untouched; that rollout goes to DLQ with the reason,
    the other seven train as version 1, and nothing non-finite is ever published."""
    cfg = trainer_config(fresh_server.url, tmp_path)
    model, mcfg = build_model(cfg)
    learner = build_learner(model, build_optimizer(model, cfg), cfg)
    skipped = metrics.STEPS_SKIPPED.labels("nonfinite_loss")
    count0 = skipped._value.get() if hasattr(skipped, "_value") else None
    await publish_groups(bus, model, 2, 4)
    tr = Trainer(cfg, bus, learner, mcfg)
    stop, lost = asyncio.Event(), asyncio.Event()
    epoch = await tr.lease.acquire(stop)  # what Trainer.lead does before its loop
    keeper = asyncio.create_task(tr.lease.keep(stop, lost))
    await asyncio.to_thread(tr.prepare)
    publisher = tr.make_publisher(epoch)
    await publisher.publish_keyframe(tr.published, tr.version, mcfg)
    batcher = Batcher(bus, cfg, tr.consumed, mcfg.vocab_size)
    await batcher.start()
    try:
        batch = await batcher.next_batch(0)
        poisoned = batch.samples[1].rollout
        poisoned.logprobs[2] = float("nan")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        await (await tr.train_on(batch, batcher, publisher, lost))
    finally:
        await batcher.close()
        stop.set()
        await cancel_and_wait([keeper])
    assert tr.version == 1 and tr.steps_skipped == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    reasons = [r for _, r in await dlq_entries(bus)]
    assert len(reasons) == 1 and "nonfinite_loss" in reasons[0] and "logprobs at token 2" in reasons[0]
    st = checkpoint.load_latest(cfg.checkpoint.dir)
    assert st.version == 1 and poisoned.rollout_id not in st.consumed and len(st.consumed) == 7
    info = await bus.js.consumer_info(topo.SCORED, topo.TRAINER_CONSUMER)
    assert info.num_pending == 0 and info.num_ack_pending == 0  # parked or acked: nothing lost
    feed = WeightFollower(bus)
    state = await feed.latest_state()
    await feed.close()
    assert state.version == 1 and all(torch.isfinite(t).all() for t in state.state.values())
    if count0 is not None:
        assert skipped._value.get() == count0 + 1
