"""Trainer pieces without a bus: advantages, loss, importance weights, staleness, checkpoints."""

import math

import pytest
import torch

from tests.helpers.tolerance import elementwise_rtol, fp32_tol, grad_reduction_len, sum_rtol
from trainer import checkpoint
from trainer.batcher import ConsumedIds, stale_weights
from trainer.config import TrainerConfig
from trainer.loss import LossConfig, group_advantages, pg_loss


def test_group_advantage_is_group_relative():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0, 5.0, 5.0, 5.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    a = group_advantages(r, g, "std")
    # why: (r - mean)/(std + eps): eps = 1e-6 (trainer/loss.py) against std 0.5 shifts it by 2e-6;
    # atol 1e-4 leaves room for any eps up to 5e-5 and still tells 1 from 1/sqrt(2) or 2
    assert torch.allclose(a[:4], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-4)
    assert torch.equal(a[4:], torch.zeros(4))  # no signal in a constant group (why equal: r - r = 0)
    m = group_advantages(torch.tensor([3.0, 1.0, 10.0]), torch.tensor([0, 0, 1]), "mean")
    # why exact: small integers, their means and differences are exact in fp32
    assert torch.equal(m, torch.tensor([1.0, -1.0, 0.0]))
    with pytest.raises(ValueError):
        group_advantages(r, g[:3])


def test_truncated_and_masked_weights_and_no_ppo_clip():
    behav = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    logp = torch.log(torch.tensor([0.5, 2.0, 0.1, 0.9])).requires_grad_()  # ratios 1, 4, 0.2, 1.8
    adv, w = torch.ones(4), torch.ones(4)
    _, st = pg_loss(logp, behav, adv, w, 4, LossConfig(is_mode="truncated", is_clip=2.0))
    # why: ratios are exp(log a - log b) in fp32 (3 roundings, exp amplifies by |log| <= 2.3), then a
    # mean of 4
    assert st["frac_truncated"] == 0.25 and math.isclose(
        st["is_weight_mean"], (1 + 2 + 0.2 + 1.8) / 4, rel_tol=elementwise_rtol(3, cond=2.3) + sum_rtol(4)
    )
    _, st = pg_loss(logp, behav, adv, w, 4, LossConfig(is_mode="masked", is_clip=2.0))
    assert st["frac_masked"] == 0.5  # 4 and 0.2 fall outside [1/2, 2]
    # the PPO clip anchored on mu is gone: one step per batch has no trust region
    with pytest.raises(ValueError, match="ppo_clip.*trust region"):
        TrainerConfig(loss={"ppo_clip": 0.2})


def test_dropped_samples_carry_no_gradient():
    logp = torch.randn(6, requires_grad=True)
    behav = logp.detach() + 0.1 * torch.randn(6)
    adv = torch.randn(6)
    w = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    loss, _ = pg_loss(logp, behav, adv, w, 3, LossConfig())
    loss.backward()
    assert torch.equal(logp.grad[3:], torch.zeros(3)) and (logp.grad[:3] != 0).all()  # why equal: x 0
    with pytest.raises(ValueError):
        pg_loss(logp, behav[:2], adv, w, 3, LossConfig())


def test_stale_weights_drop_and_downweight():
    assert stale_weights([0, 2, 3, 5], 2, "drop", 0.5) == [1.0, 1.0, 0.0, 0.0]
    assert stale_weights([0, 2, 3, 5], 2, "downweight", 0.5) == [1.0, 1.0, 0.5, 0.125]


def test_consumed_ids_bounded_fifo():
    c = ConsumedIds(["a", "b"], limit=3)
    c.add(["c", "d"])
    assert "a" not in c and c.to_list() == ["b", "c", "d"]


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="stale"):
        TrainerConfig(batch={"stale": "sometimes"})
    with pytest.raises(ValueError, match="mode"):
        TrainerConfig(run={"mode": "both"})


def _state(version, epoch, value):
    return checkpoint.TrainerState(
        version=version,
        epoch=epoch,
        model={"w": torch.full((3,), value)},
        optimizer={},
        consumed=[f"r{version}"],
        digest="d",
    )


def test_checkpoint_atomic_latest_and_epoch_fencing(tmp_path):
    checkpoint.save(tmp_path, _state(1, 5, 1.0))
    checkpoint.save(tmp_path, _state(2, 5, 2.0))
    checkpoint.save(tmp_path, _state(1, 9, 3.0))  # new leader (epoch 9) resumed at v1
    checkpoint.save(tmp_path, _state(3, 5, 4.0))  # deposed leader wrote late: ignored
    st = checkpoint.load_latest(tmp_path)
    assert (st.epoch, st.version, st.consumed) == (9, 1, ["r1"]) and torch.equal(
        st.model["w"], torch.full((3,), 3.0)
    )
    (tmp_path / "ckpt-e00000009-v00000001.pt.tmp.123").write_bytes(b"half")  # a crash mid-write
    assert checkpoint.load_latest(tmp_path).epoch == 9
    (tmp_path / "ckpt-e00000010-v00000004.pt").write_bytes(b"garbage")  # unreadable newest
    assert checkpoint.load_latest(tmp_path).epoch == 9
    assert checkpoint.load_latest(tmp_path / "none") is None


def test_checkpoint_keeps_last_n(tmp_path):
    for v in range(6):
        checkpoint.save(tmp_path, _state(v, 1, float(v)), keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "ckpt-e00000001-v00000004.pt",
        "ckpt-e00000001-v00000005.pt",
    ]


def test_single_file_checkpoints_are_not_read_back_when_saving(tmp_path, monkeypatch):
    """Pruning looks into kept checkpoints only for the shard folders they name: a run with none
    (one process; each file holds the whole fp32 state, GBs for a real model) reads nothing back."""
    reads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: reads.append(a[0]) or real_load(*a, **k))
    for v in range(4):
        checkpoint.save(tmp_path, _state(v, 1, float(v)), keep=3)
    assert reads == [] and len(checkpoint.list_checkpoints(tmp_path)) == 3
    (tmp_path / "shards-e00000001-v00000000").mkdir()  # a sharded run's folder: now it must look
    checkpoint.save(tmp_path, _state(4, 1, 4.0), keep=3)
    assert len(reads) == 3


def test_one_process_optimizer_is_fused_adamw_with_the_default_update():
    """The single-process trainer steps with the fused AdamW kernel; its update is foreach AdamW's
    up to float rounding (a few ulp after several steps)."""
    from trainer.config import TrainerConfig
    from trainer.factory import build_model, build_optimizer

    cfg = TrainerConfig(
        policy={
            "model": {
                "preset": "tiny",
                "d_model": 32,
                "n_layers": 1,
                "n_heads": 2,
                "n_kv_heads": 1,
                "d_ff": 64,
                "max_seq_len": 32,
            }
        },
        optim={"lr": 1e-2, "weight_decay": 0.1},
    )
    a, _ = build_model(cfg)
    b, _ = build_model(cfg)
    fused = build_optimizer(a, cfg)
    ref = torch.optim.AdamW(
        b.parameters(),
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        weight_decay=cfg.optim.weight_decay,
        foreach=True,
    )
    assert fused.defaults["fused"] is True
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(a.parameters(), b.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        fused.step()
        ref.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_bad_configuration_is_a_clear_error(tmp_path, capsys):
    from trainer.__main__ import main

    assert main(["--config", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer]\nbatch_grups = 3\n")
    assert main(["--config", str(bad)]) == 2
    assert "batch_grups" in capsys.readouterr().err
    bad.write_text("[trainer.loss]\nis_mode = 'sometimes'\n")
    assert main(["--config", str(bad)]) == 2
    assert "is_mode" in capsys.readouterr().err


def test_length_buckets_cover_every_sequence_once_and_split_a_long_tail():
    from trainer.buckets import length_buckets

    lens = [30, 12, 110, 25, 31, 14, 29, 13]
    runs = length_buckets(lens, max_batch=32, overhead_tokens=16)
    assert sorted(i for r in runs for i in r) == list(range(len(lens)))
    assert [110] in [[lens[i] for i in r] for r in runs]  # the long answer pads nobody
    assert all(len(r) <= 3 for r in length_buckets(lens, max_batch=3))
    assert length_buckets([], 4) == []


def test_length_bucketing_does_not_change_loss_or_gradient():
    """Micro-batching by length is only a cost decision: loss and gradients are unchanged."""
    import random

    from policy import ModelConfig, Transformer
    from trainer.learner import Learner, PackedSample

    rng = random.Random(0)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny", vocab_size=40)).float()
    samples = []
    for i in range(8):
        n = rng.choice([3, 5, 40])
        samples.append(
            PackedSample(
                str(i),
                i // 2,
                rng.random(),
                1.0,
                0,
                [1, 2, 3],
                [rng.randrange(4, 40) for _ in range(n)],
                [-1.5] * n,
                {"temperature": 1.0, "top_p": 0.9},
                {},
                {},
            )
        )
    grads = []
    for micro in (1000, 1):  # buckets by cost vs one sequence per forward
        learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.0), LossConfig(), micro_batch=micro)
        model.zero_grad(set_to_none=True)
        loss, _ = learner.loss(samples)
        loss.backward()
        grads.append((float(loss.detach()), torch.cat([p.grad.reshape(-1) for p in model.parameters()])))
    # why: bucketing only reorders the sums over tokens and sequences (grad_reduction_len); values are O(1)
    # for the loss; gradients are compared relative to the largest one (an element that cancels to ~0
    # keeps the absolute error of its terms' scale)
    n = grad_reduction_len(model.cfg, sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples))
    assert math.isclose(grads[0][0], grads[1][0], rel_tol=sum_rtol(n), abs_tol=sum_rtol(n))
    scale = float(grads[0][1].abs().max())
    torch.testing.assert_close(
        grads[0][1], grads[1][1], rtol=fp32_tol(n)["rtol"], atol=fp32_tol(n)["atol"] * scale
    )
