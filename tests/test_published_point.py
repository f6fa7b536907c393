"""The step's gradient is taken at the weights the workers sample from (the bf16 rounding of the
fp32 master) and the update lands on the master: a sample of the current version replays with
k3 = 0 however far the master sits from the bf16 grid, the master is restored bit for bit, and
the gradient is the one of a model holding the rounded weights."""

from __future__ import annotations

import torch

from policy import inference_state
from trainer.learner import Learner
from trainer.loss import LossConfig
from trainer.published_point import at_published_point

from .test_loss_fixes import grads, samples_for, tiny


def off_grid(seed: int = 0):
    """A tiny model whose master sits between bf16 values (as after a few small AdamW steps), and
    a copy holding its published bf16 rounding (what a worker samples from)."""
    master = tiny(seed)
    with torch.no_grad():
        for p in master.parameters():
            p.add_(torch.randn_like(p) * p.abs().clamp(min=1e-3) * 2e-3)
    published = tiny(seed)
    published.load_state_dict({k: v.float() for k, v in inference_state(master).items()}, strict=False)
    assert any(not torch.equal(a, b) for a, b in zip(master.parameters(), published.parameters()))
    return master, published


def test_a_same_version_sample_replays_on_policy_at_the_published_point():
    master, published = off_grid()
    batch = samples_for(published, n=8, seed=1)  # behaviour logprobs of the published weights
    k3 = {}
    for on in (True, False):
        model = tiny(0)
        model.load_state_dict(master.state_dict())
        sgd = torch.optim.SGD(model.parameters(), lr=0.0)
        learner = Learner(model, sgd, LossConfig(), published_point=on)
        k3[on] = learner.step(batch)["k3_mean"]
    assert k3[True] < 1e-9  # same weights, same numerics: exactly on-policy
    assert k3[False] > 1e3 * max(k3[True], 1e-12)  # on the master: a mismatch without any lag


def test_master_restored_bit_for_bit_and_the_gradient_is_the_published_ones():
    master, published = off_grid(2)
    before = {k: v.clone() for k, v in master.state_dict().items()}
    batch = samples_for(published, n=6, seed=4)
    learner = Learner(master, torch.optim.SGD(master.parameters(), lr=0.0), LossConfig())
    learner.step(batch)
    assert all(torch.equal(before[k], v) for k, v in master.state_dict().items())
    g_step = grads(master)
    sgd = torch.optim.SGD(published.parameters(), lr=0.0)
    ref = Learner(published, sgd, LossConfig(), published_point=False)
    ref.step(batch)
    # why equal: the same weights, the same ops in the same order
    torch.testing.assert_close(g_step, grads(published), rtol=0, atol=0)


def test_the_update_goes_to_the_master():
    master, published = off_grid(3)
    opt = torch.optim.SGD(master.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in master.parameters()]
    Learner(master, opt, LossConfig()).step(samples_for(published, n=6, seed=5))
    for b, p in zip(before, master.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(p.detach(), b - 1e-2 * p.grad, rtol=0, atol=1e-7)


def test_off_leaves_the_model_alone_and_restores_after_an_error():
    model = tiny(4)
    with torch.no_grad():
        next(model.parameters()).add_(1e-4)
    keep = [p.detach().clone() for p in model.parameters()]
    with at_published_point(model, on=False):
        assert all(torch.equal(a, b) for a, b in zip(keep, model.parameters()))
    try:
        with at_published_point(model):
            assert all(torch.equal(p, p.to(torch.bfloat16).float()) for p in model.parameters())
            raise RuntimeError("a pass failed")
    except RuntimeError:
        pass
    assert all(torch.equal(a, b) for a, b in zip(keep, model.parameters()))
