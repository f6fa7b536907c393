"""The reward, priced once (policy/reward.py): the member's price and every penalty mode against the
formulas the scorer and the trainer used before they shared one module (kept here verbatim as the
reference), on random groups: the linear mode bit for bit, the others within float64."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch

from bus.events import EventError, Scored, decode, encode
from policy import ModelConfig, Transformer
from policy.reward import PENALTIES, price, trained_rewards
from tests.helpers.trainer import MODEL, make_scored
from trainer.batcher import Batch, Sample
from trainer.learner import Learner, pack
from trainer.loss import LossConfig, group_advantages

REF_EPS = 1e-6


def reference_price(success: float, cost: float, lam: float, shaping: float = 0.0) -> tuple[float, float]:
    """The scorer's compute_reward before: (penalty, reward), inputs already checked."""
    penalty = lam * cost + shaping
    return penalty, success - penalty


def reference_penalty(reward, success, cost, lam, penalty, group, mode="linear", cap=0.25, live=None):
    """The trainer's apply_penalty before: the score rebuilt as r + λ·c and priced again (torch)."""
    if mode == "linear":
        return reward
    r, c, lam = reward.double(), cost.double(), lam.double()
    linear = lam * c
    base = r + linear
    if mode == "success_only":
        return (base - linear * (success >= 1.0)).to(reward.dtype)
    live = torch.ones_like(group, dtype=torch.bool) if live is None else live.bool()
    on = live.double()
    G = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(G, dtype=torch.float64).index_add_(0, group, on)
    mean = torch.zeros(G, dtype=torch.float64).index_add_(0, group, c * on) / count.clamp_min(1)
    dev = (c - mean[group]) * on
    var = torch.zeros(G, dtype=torch.float64).index_add_(0, group, dev**2) / count.clamp_min(1)
    std = var.sqrt()[group]
    z = torch.where(std > REF_EPS, dev / (std + REF_EPS), torch.zeros_like(dev)).clamp(-1.0, 1.0)
    scale = (lam * mean[group]).clamp(max=cap)
    return (base - scale * z).to(reward.dtype)


def random_groups(rng: np.random.Generator, n_groups: int):
    """Members of `n_groups` groups as the scorer priced them: per member score, success, cost,
    the group's λ, shaping, and its (penalty, reward) from the reference price."""
    sizes = rng.integers(1, 9, n_groups)
    group = np.repeat(np.arange(n_groups), sizes)
    n = group.size
    episode = rng.random(n) < 0.5  # an episode's score is a fraction; a completion's its success
    success = (rng.random(n) < 0.5).astype(np.float64)
    score = np.where(episode, np.where(success == 1.0, 1.0, rng.integers(0, 8, n) / 8), success)
    cost = np.where(rng.random(n) < 0.5, rng.integers(0, 4000, n), rng.random(n) * 300.0)
    cost[rng.random(n) < 0.1] = cost[0]  # ties: groups of equal cost (std 0)
    lam = np.array([0.0, 1e-4, 3e-3, 0.05])[rng.integers(0, 4, n_groups)][group]
    shaping = np.where(episode | (rng.random(n) < 0.5), 0.0, rng.random(n))
    penalty, reward = zip(*(reference_price(*x) for x in zip(score, cost, lam, shaping)))
    live = rng.random(n) < 0.85
    return dict(
        score=score,
        success=success,
        cost=cost,
        lam=lam,
        shaping=shaping,
        penalty=np.array(penalty),
        reward=np.array(reward),
        group=group,
        live=live,
    )


def test_price_is_the_scorers_reward_bit_for_bit():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        x = (
            float(rng.random()),
            float(rng.integers(0, 5000)),
            float(rng.random() * 0.01),
            float(rng.random()),
        )
        assert price(*x) == reference_price(*x)
    for bad in ((math.nan, 1.0, 0.1), (1.0, math.nan, 0.1), (1.0, -1.0, 0.1), (1.0, 1e300, 1e300)):
        with pytest.raises(ValueError, match="bad reward input|not finite"):
            price(*bad)


@pytest.mark.parametrize("mode", PENALTIES)
def test_every_mode_matches_the_old_formulas_on_random_groups(mode):
    rng = np.random.default_rng(PENALTIES.index(mode))
    for trial in range(200):
        g = random_groups(rng, int(rng.integers(1, 12)))
        t = {k: torch.from_numpy(np.asarray(v)) for k, v in g.items()}
        live = None if trial % 5 == 0 else g["live"]
        cap = float(rng.choice([0.1, 0.25, 0.49]))
        new = trained_rewards(
            mode,
            g["reward"],
            g["score"],
            g["success"],
            g["cost"],
            g["lam"],
            g["shaping"],
            g["group"],
            cap,
            live,
        )
        args = (t["success"], t["cost"], t["lam"], t["penalty"], t["group"], mode, cap)
        live_t = None if live is None else t["live"]
        if mode == "linear":  # bit for bit, in the learner's float32 too
            old = reference_penalty(
                torch.tensor(g["reward"].tolist(), dtype=torch.float32), *args, live=live_t
            )
            assert torch.equal(torch.from_numpy(new).float(), old)
            assert np.array_equal(new, g["reward"])
        old = reference_penalty(t["reward"], *args, live=live_t)
        np.testing.assert_allclose(new, old.numpy(), rtol=1e-12, atol=1e-12)


def test_the_reward_module_loads_no_torch():
    """The scorer prices with policy.reward: importing it must not load torch (a second or more of
    start-up, and its memory, in every scorer)."""
    code = "import sys, policy.reward, scorer.service; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_scored_carries_the_parts_and_an_older_scorers_event_still_decodes():
    """Scored carries score and shaping (the penalty modes start from them); an older scorer's body,
    without them, decodes and gives the same parts back from its price (within float64)."""
    base = make_scored(Transformer(ModelConfig.from_dict(MODEL)), "t", 0, 2, 0, random.Random(0))
    score, cost, lam, shaping = 0.75, 321.0, 0.003, 0.125
    penalty, reward = price(score, cost, lam, shaping)
    fields = dict(rollout=base.rollout, success=0.0, cost=cost, lambda_=lam, penalty=penalty, reward=reward)
    new = decode(encode(Scored(**fields, score=score, shaping=shaping)), Scored)
    assert (new.score, new.shaping) == (score, shaping) and new.unpriced() == (score, shaping)
    body = Scored(**fields).to_dict()
    del body["score"], body["shaping"]  # an older scorer's body: no such keys
    old = decode(msgpack.packb(body), Scored)
    assert old.score is None and old.shaping is None
    np.testing.assert_allclose(old.unpriced(), (score, shaping), rtol=0, atol=1e-12)
    for bad in (dict(score=1.5, shaping=0.0), dict(score=0.5, shaping=math.inf)):
        with pytest.raises(EventError, match="score|shaping"):
            decode(encode(Scored(**fields, **bad)), Scored)


@pytest.mark.parametrize("mode", PENALTIES)
def test_the_learner_trains_on_the_same_rewards_as_before(mode):
    """Scored events (with their parts, and an older scorer's without) packed and passed through
    the learner: its advantages are those of the old formulas' rewards, in every mode."""
    rng = np.random.default_rng(7)
    g = random_groups(rng, 5)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_dict(MODEL))
    base = make_scored(model, "t", 0, 2, 0, random.Random(0))
    members = []
    for i in range(g["group"].size):
        sc = Scored(
            rollout=base.rollout,
            success=float(g["success"][i]),
            cost=float(g["cost"][i]),
            lambda_=float(g["lam"][i]),
            penalty=float(g["penalty"][i]),
            reward=float(g["reward"][i]),
            **({} if i % 3 == 0 else dict(score=float(g["score"][i]), shaping=float(g["shaping"][i]))),
        )
        sc = decode(encode(sc), Scored)  # every third: an older scorer's event, parts from its price
        weight = 1.0 if g["live"][i] else 0.0
        members.append(Sample(sc.get_rollout(), sc, None, group=int(g["group"][i]), weight=weight))
    samples = pack(Batch(members, n_groups=5, version=0))
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.0), LossConfig(), penalty=mode)
    _, stats = learner.loss(samples, grad=False)
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in g.items()}
    reward = t["reward"].float() if mode == "linear" else t["reward"]
    parts = (t["success"], t["cost"], t["lam"], t["penalty"], t["group"])
    old = reference_penalty(reward, *parts, mode, 0.25, t["live"])
    want = group_advantages(old, t["group"], live=t["live"])[t["live"]]
    if mode == "linear":
        assert torch.equal(stats["adv"], want)
    else:
        torch.testing.assert_close(stats["adv"], want, rtol=0, atol=1e-6)
