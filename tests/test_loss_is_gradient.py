"""The importance correction acts on the gradient, not only on the stats: d loss / d logp_t must be
-s_t * w_t * A_t / N with w_t the truncated / masked IS weight. A loss that ignored the weights
(plain on-policy PG, or rho*A without truncation) fails these checks."""

import torch

from tests.helpers.tolerance import elementwise_rtol
from trainer.loss import LossConfig, pg_loss

# why: d loss/d logp_t is elementwise (exp of a logp difference, min, products, /N: ~8 roundings, each
# gradient one term), exp amplifying the difference's rounding by |logp| + |behav| <= 6 here
RTOL = elementwise_rtol(8, cond=6.0)

# ratios pi/mu per token: 1, 4, 0.2, 1.8, 0.4 (clip C = 2: 4 is truncated; 4 and 0.2 masked)
RATIOS = torch.tensor([1.0, 4.0, 0.2, 1.8, 0.4])


def grad_of(cfg: LossConfig, adv: torch.Tensor, weight: torch.Tensor, n: float) -> torch.Tensor:
    behav = torch.log(torch.full((5,), 0.1))
    logp = (behav + RATIOS.log()).clone().requires_grad_()
    loss, _ = pg_loss(logp, behav, adv, weight, n, cfg)
    loss.backward()
    return logp.grad


def test_truncated_is_gradient_is_min_rho_c_times_advantage():
    adv = torch.tensor([1.0, -2.0, 0.5, 1.5, -1.0])
    s = torch.tensor([1.0, 1.0, 1.0, 0.5, 1.0])  # one down-weighted sample's token
    g = grad_of(LossConfig(is_mode="truncated", is_clip=2.0), adv, s, 4.5)
    w = torch.minimum(RATIOS, torch.tensor(2.0))
    assert torch.allclose(g, -s * w * adv / 4.5, rtol=RTOL, atol=0)
    # the untruncated ratio would give -4 * (-2) / 4.5 at token 1: the truncation is visible
    # (why: the wrong formulas differ by O(1) at some token, 1e4x any rounding: a loose rtol still sees it)
    assert not torch.allclose(g, -s * RATIOS * adv / 4.5, rtol=1e-3)
    assert not torch.allclose(g, -s * adv / 4.5, rtol=1e-3)  # ...and so is the weighting itself


def test_masked_is_gradient_is_zero_outside_the_band():
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    g = grad_of(LossConfig(is_mode="masked", is_clip=2.0), adv, torch.ones(5), 5)
    inside = (RATIOS >= 0.5) & (RATIOS <= 2.0)
    assert torch.equal(g[~inside], torch.zeros(int((~inside).sum())))  # why equal: masked = multiplied by 0
    assert torch.allclose(g[inside], -RATIOS[inside] / 5, rtol=RTOL, atol=0)


def test_no_correction_is_the_on_policy_gradient():
    """is_mode=none: w = 1, so the gradient is -A (the on-policy PG), whatever rho is."""
    adv = torch.tensor([1.0, -1.0, 2.0, 0.5, 1.0])
    g = grad_of(LossConfig(is_mode="none"), adv, torch.ones(5), 5)
    assert torch.allclose(g, -adv / 5, rtol=RTOL, atol=0)
