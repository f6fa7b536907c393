"""The loss a real model needs: lambda survives the advantage, rejected tokens
leave the denominator, the KL term has the gradient of KL(pi || ref) under mu's samples, no PPO
clip pretending to be a trust region, chunked logprobs bounded in memory with the same gradient,
and a sample dropped as stale is out of its group's baseline."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from policy import ModelConfig, SamplingConfig, SamplingMask, Transformer, sequence_logprobs
from policy.logprobs import masked_is_weight
from trainer.buckets import length_buckets
from trainer.config import TrainerConfig
from trainer.learner import Learner, PackedSample
from trainer.loss import LossConfig, group_advantages, pg_loss

V = 97  # no other dimension of the model is 97: a [..., 97] tensor is a vocabulary tensor


def tiny(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(
        ModelConfig.tiny(vocab_size=V, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64)
    )


def samples_for(
    model, n: int = 8, seed: int = 0, sampling=None, rewards=None, lens=(3, 9, 17)
) -> list[PackedSample]:
    """Groups of 2 with the model's own behaviour logprobs (ratio 1 until a test moves them)."""
    rng = random.Random(seed)
    sampling = sampling or {"temperature": 1.0}
    out = []
    for i in range(n):
        T = rng.choice(lens)
        prompt, comp = [1, rng.randrange(2, V), rng.randrange(2, V)], [rng.randrange(2, V) for _ in range(T)]
        with torch.no_grad():
            lp = sequence_logprobs(model, [prompt], [comp], SamplingConfig.from_dict(sampling)).logprobs[0]
        r = rng.random() if rewards is None else rewards[i]
        out.append(
            PackedSample(f"r{i}", i // 2, r, 1.0, 0, prompt, comp, [float(x) for x in lp], sampling, {}, {})
        )
    return out


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


# -- 1: lambda must survive the advantage ------------------------------------------------------------


def test_advantages_scale_linearly_with_lambda_in_a_group_of_uniform_success():
    """Every member succeeds; rewards 1 - lambda * L differ only by length. The default advantage
    must scale with lambda (under std normalisation lambda cancels: 1e-4 and 1e-2 give the same)."""
    L = torch.tensor([10.0, 20.0, 30.0, 45.0])
    g = torch.zeros(4, dtype=torch.long)
    norm = TrainerConfig().loss.adv_norm
    small = group_advantages(1 - 1e-4 * L, g, norm)
    big = group_advantages(1 - 1e-2 * L, g, norm)
    assert (small.abs() > 0).all()
    torch.testing.assert_close(big, 100 * small, rtol=1e-3, atol=1e-7)
    # ... and the learner's own default does the same (its advantages are in its stats)
    model = tiny()
    base = samples_for(model, n=4, rewards=[0.0] * 4)
    for s in base:
        s.group = 0
    advs = []
    for lam in (1e-4, 1e-2):
        batch = [dataclasses.replace(s, reward=float(1 - lam * n)) for s, n in zip(base, L)]
        learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.0), LossConfig())
        advs.append(learner.loss(batch, grad=False)[1]["adv"])
    torch.testing.assert_close(advs[1], 100 * advs[0], rtol=1e-3, atol=1e-7)


# -- 2: rejected tokens leave the denominator -------------------------------------------------------


def test_masked_loss_is_the_loss_over_kept_tokens_only():
    """Masked IS rejects some tokens: loss and gradient equal -sum_kept w A grad log pi / N_kept,
    computed here by hand over the kept tokens alone (the old code divided by every live token)."""
    model = tiny(1)
    samples = samples_for(model, n=6, seed=3)
    gen = torch.Generator().manual_seed(0)
    for s in samples:  # push about a third of the tokens outside [1/2, 2]
        shift = torch.where(torch.rand(len(s.logprobs), generator=gen) < 0.35, 2.0, 0.1)
        s.logprobs = [float(x) for x in torch.tensor(s.logprobs) - shift]
    cfg = LossConfig(is_mode="masked", is_clip=2.0)
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg, micro_batch=2)
    model.zero_grad(set_to_none=True)
    loss, st = learner.loss(samples, grad=True, backward=True)
    g_learner = grads(model)
    assert 0 < st["kept_tokens"] < st["n_tokens"]  # the test really rejects something
    # by hand: one forward of everything, the kept tokens only
    model.zero_grad(set_to_none=True)
    res = sequence_logprobs(
        model,
        [s.prompt_ids for s in samples],
        [s.completion_ids for s in samples],
        [SamplingConfig.from_dict(s.sampling) for s in samples],
    )
    logp = torch.cat([res.logprobs[k][res.valid[k]] for k in range(len(samples))])
    behav = torch.tensor([x for s in samples for x in s.logprobs])
    adv = group_advantages(
        torch.tensor([s.reward for s in samples]), torch.tensor([s.group for s in samples]), learner.adv_norm
    )
    a = adv.repeat_interleave(torch.tensor([len(s.completion_ids) for s in samples]))
    w = masked_is_weight(logp.detach() - behav, 2.0)
    kept = w > 0
    ref = -(w[kept] * a[kept] * logp[kept]).sum() / kept.sum()
    ref.backward()
    want = float(-(w[kept] * a[kept]).sum() / kept.sum())
    assert math.isclose(float(loss), want, rel_tol=1e-5, abs_tol=1e-7)
    torch.testing.assert_close(g_learner, grads(model), rtol=1e-4, atol=1e-7)


# -- 3: the KL term ------------------------------------------------------------------------------------


def test_kl_term_expected_gradient_is_the_gradient_of_kl_pi_ref_under_mu():
    """Enumerable vocabulary: the expected gradient of the KL term over tokens y ~ mu (every y,
    weighted by mu(y)) must equal autograd of the exact KL(pi || ref) = sum pi (log pi - log ref).
    k3 differentiated as it is gives grad KL(ref || pi), and without the IS weight E_mu, not E_pi."""
    torch.manual_seed(0)
    n = 7
    theta = torch.randn(n, dtype=torch.float64, requires_grad=True)
    log_ref = torch.randn(n, dtype=torch.float64).log_softmax(-1)
    log_mu = torch.randn(n, dtype=torch.float64).log_softmax(-1)  # the behaviour policy: neither
    logp = theta.log_softmax(-1)
    cfg = LossConfig(is_mode="truncated", is_clip=1e6, kl_coef=1.0)  # C never reached: w = pi/mu
    loss, _ = pg_loss(logp, log_mu, torch.zeros(n, dtype=torch.float64), log_mu.exp(), 1.0, cfg, ref=log_ref)
    (g_est,) = torch.autograd.grad(loss, theta)
    p = theta.log_softmax(-1)
    (g_exact,) = torch.autograd.grad((p.exp() * (p - log_ref)).sum(), theta)
    torch.testing.assert_close(g_est, g_exact, rtol=1e-9, atol=1e-12)
    # its value estimates KL(pi || ref) as well (E_mu[w k3] = E_pi[k3])
    kl = float((p.exp() * (p - log_ref)).sum().detach())
    assert math.isclose(float(loss.detach()), kl, rel_tol=1e-9)


# -- 4: no PPO clip ----------------------------------------------------------------------------------


def test_ppo_clip_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="trust region"):
        TrainerConfig(loss={"ppo_clip": 0.2})
    assert TrainerConfig(loss={"ppo_clip": 0.0}).loss.ppo_clip == 0.0  # old configs that set 0 still load


# -- 5: chunked logprobs, token-budget micro-batches -------------------------------------------------


class LargestVocabTemporary(TorchDispatchMode):
    """Rows of the largest [..., V] tensor any op allocates (forward and backward; views allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == V:
                self.rows = max(self.rows, t.numel() // V)
        return out


def run_loss(model, samples, chunk, sampling_masks=False, micro_tokens=0):
    learner = Learner(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        LossConfig(entropy_coef=0.01),
        micro_batch=64,
        micro_batch_tokens=micro_tokens,
        logit_chunk_tokens=chunk,
    )
    model.zero_grad(set_to_none=True)
    with LargestVocabTemporary() as probe:
        loss, _ = learner.loss(samples, grad=True, backward=True)
    return float(loss), grads(model), probe.rows


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9, "top_k": 20}])
def test_chunked_logprobs_same_loss_and_gradient_with_bounded_vocab_temporaries(sampling):
    model = tiny(2)
    samples = samples_for(model, n=8, seed=5, sampling=sampling, lens=(5, 30, 60))
    n_tok = sum(len(s.completion_ids) for s in samples)
    full_loss, full_g, full_rows = run_loss(model, samples, chunk=0)
    loss, g, rows = run_loss(model, samples, chunk=16)
    assert math.isclose(loss, full_loss, rel_tol=1e-5, abs_tol=1e-7)
    torch.testing.assert_close(g, full_g, rtol=1e-4, atol=1e-7)
    # no [rows, V] tensor larger than one chunk, forward or backward (unchunked: a micro-batch's
    # completion tokens at once)
    assert rows <= 16 and full_rows > 4 * 16 and n_tok > 4 * 16


def test_chunked_logprobs_replay_shipped_masks_per_chunk():
    """Shipped kept sets cut across chunk borders: the same logprobs as one chunk."""
    model = tiny(3)
    rng = random.Random(0)
    prompts, comps, masks = [], [], []
    for T in (7, 12, 5):
        comp = [rng.randrange(2, V) for _ in range(T)]
        rows = [(int(k), torch.randperm(V)[:k].sort().values.numpy()) for k in torch.randint(4, 20, (T,))]
        rows = [
            (k, ids if c in ids else torch.tensor(sorted(set(ids.tolist()) | {c})).numpy())
            for (k, ids), c in zip(rows, comp)
        ]
        masks.append(SamplingMask.from_rows([(len(ids), ids) for _, ids in rows]))
        prompts.append([1, 2])
        comps.append(comp)
    cfg = [SamplingConfig(temperature=0.7, top_k=20)] * 3
    a = sequence_logprobs(model, prompts, comps, cfg, masks)
    b = sequence_logprobs(model, prompts, comps, cfg, masks, chunk_tokens=4)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.entropy, b.entropy, rtol=1e-5, atol=1e-6)


def test_token_budget_micro_batches():
    lens = [30, 12, 110, 25, 31, 14, 29, 13]
    runs = length_buckets(lens, max_batch=32, overhead_tokens=1000, max_tokens=64)  # overhead: pack hard
    assert sorted(i for r in runs for i in r) == list(range(len(lens)))
    assert all(len(r) == 1 or len(r) * max(lens[i] for i in r) <= 64 for r in runs)
    assert [2] in runs  # longer than the budget: alone
    model = tiny(4)
    samples = samples_for(model, n=8, seed=6, lens=(4, 20, 40))
    l0, g0, _ = run_loss(model, samples, chunk=0)
    l1, g1, _ = run_loss(model, samples, chunk=0, micro_tokens=48)
    assert math.isclose(l0, l1, rel_tol=1e-5, abs_tol=1e-7)
    torch.testing.assert_close(g0, g1, rtol=1e-4, atol=1e-7)


# -- 6: a dropped stale sample is out of the baseline ---------------------------------------------------


def test_dropped_stale_sample_is_out_of_its_group_baseline():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    g = torch.zeros(4, dtype=torch.long)
    live = torch.tensor([True, True, False, False])
    torch.testing.assert_close(group_advantages(r, g, "mean", live=live), torch.tensor([0.5, -0.5, 0.0, 0.0]))
    torch.testing.assert_close(
        group_advantages(r, g, "std", live=live), torch.tensor([1.0, -1.0, 0.0, 0.0]), rtol=1e-4, atol=1e-5
    )
    # one live member left: no baseline, no signal
    alone = torch.tensor([True, False, False, False])
    assert torch.equal(group_advantages(r, g, "mean", live=alone), torch.zeros(4))
    # in the learner: the reward of a dropped sample changes nothing
    model = tiny(5)
    samples = samples_for(model, n=4, rewards=[1.0, 0.0, 0.0, 0.0])
    for s in samples:
        s.group = 0
    samples[2].weight = samples[3].weight = 0.0  # stale: dropped
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.0), LossConfig())
    before = learner.loss(samples, grad=False)[0]
    samples[2].reward = samples[3].reward = 1.0
    assert torch.equal(learner.loss(samples, grad=False)[0], before)


# -- 1 (skip_uniform_groups): what "uniform" compares ---------------------------------------------------


@pytest.mark.parametrize("by", ["reward", "success"])
async def test_skip_uniform_by_success_skips_groups_that_differ_by_cost_alone(
    bus, fresh_server, tmp_path, by
):
    """A group that always succeeds, rewards 1 - lambda * length: skipped with skip_uniform_by =
    "success" (its signal is lambda * length alone), kept with "reward" (its rewards differ)."""
    from bus import topology as topo
    from tests.helpers.trainer import MODEL, make_scored, trainer_config
    from trainer.batcher import Batcher, ConsumedIds

    cfg = trainer_config(fresh_server.url, tmp_path, batch={"skip_uniform": True, "skip_uniform_by": by})
    model = Transformer(ModelConfig.from_dict(MODEL))
    rng = random.Random(0)
    for tid, success in (("lenonly", [1, 1, 1, 1]), ("mixA", [0, 1, 0, 1]), ("mixB", [1, 0, 0, 0])):
        for i, s in enumerate(success):
            sc = make_scored(model, tid, i, 4, 0, rng, reward=float(s) - 0.01 * (10 + 5 * i))
            sc.success = float(s)
            await bus.publish(topo.scored_subject("arith"), sc)
    b = Batcher(bus, cfg, ConsumedIds(), 128)
    await b.start()
    batch = None
    try:
        batch = await b.next_batch(0, max_wait_s=30)
    finally:
        await b.close(held_back=batch)
    tasks = {s.rollout.task_id for s in batch.samples}
    if by == "success":
        assert tasks == {"mixA", "mixB"} and {s.rollout.task_id for s in batch.skipped} == {"lenonly"}
    else:
        assert "lenonly" in tasks and not batch.skipped


# -- mismatch under control: the lag cap follows k3 -----------------------------------------------------


def test_lag_cap_moves_one_version_at_a_time_with_the_mismatch():
    from trainer.lag_control import next_lag_cap

    cap, caps = 4, []
    for k3 in (0.05, 0.05, 0.05, 0.05, 0.05, 0.012, 0.004, None, 0.004, 0.004, 0.004):
        cap = next_lag_cap(cap, k3, max_k3=0.01, max_lag=4)
        caps.append(cap)
    # down to 1 (never 0) while above target, held between target/2 and target, back up below it
    assert caps == [3, 2, 1, 1, 1, 1, 2, 2, 3, 4, 4]
    assert next_lag_cap(1, 0.5, max_k3=0.0, max_lag=4) == 4  # off: always max_lag
    assert next_lag_cap(0, 0.5, max_k3=0.01, max_lag=0) == 0  # max_lag 0 stays 0
    with pytest.raises(ValueError, match="max_k3"):
        TrainerConfig(batch={"max_k3": -1.0})


async def test_batcher_weighs_staleness_with_the_lag_cap_it_is_given(bus, fresh_server, tmp_path):
    from bus import topology as topo
    from tests.helpers.trainer import MODEL, make_scored, trainer_config
    from trainer.batcher import Batcher, ConsumedIds

    cfg = trainer_config(fresh_server.url, tmp_path, batch={"groups": 1, "max_lag": 4, "max_k3": 0.01})
    model = Transformer(ModelConfig.from_dict(MODEL))
    rng = random.Random(0)
    for i, v in enumerate([10, 9, 8, 7]):  # lags 0..3 at version 10
        await bus.publish(topo.scored_subject("arith"), make_scored(model, "g", i, 4, v, rng))
    b = Batcher(bus, cfg, ConsumedIds(), 128)
    await b.start()
    b.max_lag = 1  # what next_lag_cap set after a bad k3
    batch = None
    try:
        batch = await b.next_batch(10, max_wait_s=30)
    finally:
        await b.close(held_back=batch)
    assert [s.lag for s in batch.samples] == [0, 1, 2, 3]
    assert [s.weight for s in batch.samples] == [1, 1, 0, 0]
