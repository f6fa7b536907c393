"""A group's completions packed behind one copy of their prompt (policy/packing.py): the same
logprobs, entropies, loss and gradients as one row each, with the prompt run once."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from policy import ModelConfig, QuantConfig, SamplingConfig, SamplingMask, Transformer, sequence_logprobs
from policy.packing import one_per_row, prompt_units, shared_prompts
from tests.helpers.tolerance import forward_tol
from trainer.config import TrainerConfig
from trainer.learner import Learner, PackedSample
from trainer.loss import LossConfig

V = 97
# why: packed and one-per-row forwards run the same layers in other matmul shapes (another
# reduction order); the tiny model's forward tolerance
ATOL = forward_tol(ModelConfig.tiny(vocab_size=V))["atol"]


def model(attn: str = "gqa", quant=(), seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig.tiny(vocab_size=V, attn=attn, max_seq_len=128)
    return Transformer(cfg, quant=QuantConfig(sites=quant))


def groups(seed: int = 0, n_groups: int = 3, size: int = 4):
    """Prompts of different lengths, each with `size` completions of different lengths, shuffled
    (a batch does not arrive group by group), plus one sequence alone with its prompt."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(n_groups):
        p = [rng.randrange(2, V) for _ in range(rng.randint(2, 14))]
        seqs += [(p, [rng.randrange(2, V) for _ in range(rng.randint(1, 12))]) for _ in range(size)]
    rng.shuffle(seqs)
    seqs.append(([7], [8, 9, 10]))
    return [p for p, _ in seqs], [c for _, c in seqs]


@pytest.mark.parametrize("attn,quant", [("gqa", ()), ("mla", ()), ("mla", ("mla_rope_qk",))])
def test_packed_rows_give_the_same_logprobs_entropies_and_gradients(attn, quant):
    m = model(attn, quant)
    prompts, comps = groups()
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, top_k=30)
    plain = sequence_logprobs(m, prompts, comps, cfg)
    (plain.logprobs.sum() + plain.entropy.sum()).backward()
    g_plain = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    packed = sequence_logprobs(m, prompts, comps, cfg, share_prompts=True)
    (packed.logprobs.sum() + packed.entropy.sum()).backward()
    assert torch.equal(packed.valid, plain.valid)
    torch.testing.assert_close(packed.logprobs, plain.logprobs, atol=ATOL, rtol=0)
    torch.testing.assert_close(packed.entropy, plain.entropy, atol=ATOL, rtol=0)
    for a, p in zip(g_plain, m.parameters()):
        torch.testing.assert_close(p.grad, a, atol=ATOL, rtol=1e-4)


def test_packed_rows_replay_shipped_kept_sets():
    """Shipped masks are read in sample order, whatever row a sample is packed into."""
    m = model()
    prompts, comps = groups(seed=3)
    rng = torch.Generator().manual_seed(0)
    masks = []
    for c in comps:
        rows = []
        for tok in c:
            ids = torch.randperm(V, generator=rng)[:20]
            ids = torch.unique(torch.cat([ids, torch.tensor([tok])]))
            rows.append((len(ids), ids.numpy()))
        masks.append(SamplingMask.from_rows(rows))
    cfg = SamplingConfig(temperature=0.8, top_k=21)
    a = sequence_logprobs(m, prompts, comps, cfg, masks)
    b = sequence_logprobs(m, prompts, comps, cfg, masks, share_prompts=True, packed_row_tokens=20)
    torch.testing.assert_close(b.logprobs, a.logprobs, atol=ATOL, rtol=0)
    torch.testing.assert_close(b.entropy, a.entropy, atol=ATOL, rtol=0)


def test_a_group_runs_its_prompt_once():
    prompts, comps = groups(n_groups=3, size=4)
    plain, packed = one_per_row(prompts, comps, "cpu"), shared_prompts(prompts, comps, "cpu")
    assert plain.idx.shape[0] == 13 and packed.idx.shape[0] == 4  # 3 groups + the one alone
    # the packed rows hold each distinct prompt once (the sequence alone included) and every completion
    fed = sum(len(p) for p in {tuple(p) for p in prompts}) + sum(len(c) for c in comps)
    assert int((packed.pos > 0).sum()) + packed.idx.shape[0] == fed  # padding sits at position 0
    assert fed < sum(len(p) + len(c) for p, c in zip(prompts, comps))
    # each completion token is predicted from a hidden state and checked against the same token id
    torch.testing.assert_close(packed.target, plain.target, atol=0, rtol=0)
    assert not bool(packed.mask.triu(1).any())  # causal; isolation of completions: the equality tests


def test_units_are_capped_and_keep_order():
    prompts = [[1, 2]] * 4 + [[3]]
    comps = [[5] * 3, [5] * 3, [5] * 3, [5] * 10, [6]]
    assert prompt_units(prompts, comps) == [[0, 1, 2, 3], [4]]
    assert prompt_units(prompts, comps, max_row=8) == [[0, 1], [2], [3], [4]]  # 2 + 3 + 3 = 8 fits
    rows = shared_prompts(prompts, comps, "cpu", max_row=8)
    assert rows.idx.shape == (4, 12)  # the 10-token completion alone behind its prompt


def test_packed_forward_needs_positions_and_a_mask_of_its_shape():
    m = model()
    idx = torch.randint(2, V, (2, 5))
    with pytest.raises(ValueError, match="both pos and mask"):
        m(idx, pos=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="packed forward"):
        m(idx, pos=torch.zeros(2, 5, dtype=torch.long), mask=torch.ones(2, 4, 4, dtype=torch.bool))


def samples(m: Transformer, seed: int = 0) -> list[PackedSample]:
    prompts, comps = groups(seed=seed)
    key = {tuple(p): k for k, p in enumerate(dict.fromkeys(tuple(p) for p in prompts))}
    rng = random.Random(seed)
    cfg = SamplingConfig(temperature=0.9)
    with torch.no_grad():
        res = sequence_logprobs(m, prompts, comps, cfg)
    out = []
    for i, (p, c) in enumerate(zip(prompts, comps)):
        lp = [float(x) + rng.uniform(-0.3, 0.3) for x in res.logprobs[i, : len(c)]]  # a little off-policy
        out.append(
            PackedSample(
                f"r{i}",
                key[tuple(p)],
                float(rng.random() < 0.5),
                1.0,
                0,
                p,
                c,
                lp,
                {"temperature": 0.9},
                {},
                {},
            )
        )
    out[2] = dataclasses.replace(out[2], weight=0.0)  # a stale sample: out of the loss and its baseline
    return out


def learner_grad(m: Transformer, batch: list[PackedSample], **loss) -> tuple[float, list[torch.Tensor], dict]:
    learner = Learner(
        m, torch.optim.SGD(m.parameters(), lr=0.0), LossConfig(entropy_coef=0.01, **loss), micro_batch=6
    )
    m.zero_grad(set_to_none=True)
    value, stats = learner.loss(batch, grad=True, backward=True)
    return float(value), [p.grad.clone() for p in m.parameters()], stats


def test_learner_loss_and_gradient_are_the_same_packed():
    m = model()
    batch = samples(m)
    l0, g0, s0 = learner_grad(m, batch, share_prompts=False)
    l1, g1, s1 = learner_grad(m, batch, share_prompts=True)
    l2, g2, _ = learner_grad(m, batch, share_prompts=True, packed_row_tokens=16)  # units split by the cap
    assert math.isclose(l0, l1, rel_tol=1e-5, abs_tol=1e-7) and math.isclose(
        l0, l2, rel_tol=1e-5, abs_tol=1e-7
    )
    assert s0["kept_tokens"] == s1["kept_tokens"] and s0["n_tokens"] == s1["n_tokens"]
    assert math.isclose(s0["k3_mean"], s1["k3_mean"], rel_tol=1e-4, abs_tol=1e-7)
    for a, b, c in zip(g0, g1, g2):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(c, a, atol=ATOL, rtol=1e-4)


def test_learner_keeps_a_unit_in_one_pass_and_counts_its_members():
    m = model()
    batch = samples(m)
    learner = Learner(m, torch.optim.SGD(m.parameters(), lr=0.0), LossConfig(), micro_batch=8)
    runs = learner._runs(batch, list(range(len(batch))))
    assert sorted(i for _, r in runs for i in r) == list(range(len(batch)))
    for _, r in runs:  # whole prompt units only, two groups of 4 at most per pass
        assert len(r) <= 8
        for i in r:
            same = [j for j in range(len(batch)) if batch[j].prompt_ids == batch[i].prompt_ids]
            assert set(same) <= set(r)


def test_share_prompts_is_the_default_and_its_cap_is_checked():
    assert TrainerConfig().loss.share_prompts is True
    with pytest.raises(ValueError, match="packed_row_tokens"):
        TrainerConfig(loss={"packed_row_tokens": 0})
