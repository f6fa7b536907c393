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


def test_a_dithered_master_publishes_the_same_point_and_rounds_without_bias():
    from trainer.published_point import dither_master

    torch.manual_seed(0)
    m = torch.nn.Linear(256, 256)
    with torch.no_grad():
        m.weight.copy_(m.weight.to(torch.bfloat16).float())  # a bf16 checkpoint: on the grid
        m.bias.add_(1e-4)  # off the grid: left as it is
    w0, b0 = m.weight.detach().clone(), m.bias.detach().clone()
    moved = dither_master(m, seed=3)
    assert moved > 0.99 * w0.numel() and torch.equal(m.bias, b0)
    assert torch.equal(m.weight.to(torch.bfloat16), w0.to(torch.bfloat16))  # v0 is the same policy
    assert not torch.equal(m.weight, w0)
    _, e = torch.frexp(w0)
    step = torch.ldexp(torch.full_like(w0, torch.finfo(torch.bfloat16).eps), e - 1)
    drift = 0.1 * step  # a tenth of a grid step of learning in every weight
    seen = lambda master: float((((master + drift).to(torch.bfloat16).float() - w0) / drift).mean())  # noqa: E731
    assert abs(seen(m.weight.detach()) - 1.0) < 0.05  # the published point moved with the master
    assert seen(w0) == 0.0  # undithered: it did not move at all
    flipped = ((m.weight + drift).to(torch.bfloat16) != w0.to(torch.bfloat16)).float().mean()
    assert 0.05 < float(flipped) < 0.15  # ~a tenth of the weights flip: the delta stays sparse
    again = torch.nn.Linear(256, 256)
    with torch.no_grad():
        again.weight.copy_(w0)
    dither_master(again, seed=3)
    assert torch.equal(again.weight, m.weight)  # seeded: every rank of a group alike


def test_the_trainer_dithers_only_when_asked():
    from trainer.config import TrainerConfig
    from trainer.factory import build_model

    def weights(**loss):
        model, _ = build_model(TrainerConfig(policy={"model": {"preset": "tiny"}}, loss=loss))
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    plain, dithered = weights(), weights(master_dither=True)
    off = weights(master_dither=True, published_point=False)
    assert all(torch.equal(plain[k], off[k]) for k in plain)  # no published point: nothing to dither
    assert all(torch.equal(plain[k].to(torch.bfloat16), dithered[k].to(torch.bfloat16)) for k in plain)
    # a fresh fp32 init is off the grid (but for ~1 in 2^16 elements by chance); its norm gains start
    # at 1.0, on it: those move
    norms = [k for k in plain if "norm" in k]
    assert norms and all(not torch.equal(plain[k], dithered[k]) for k in norms)
    rest = [k for k in plain if k not in norms]
    changed = sum(int((plain[k] != dithered[k]).sum()) for k in rest)
    assert changed < 1e-3 * sum(plain[k].numel() for k in rest)
