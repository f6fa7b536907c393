"""FSDP2 trainer (trainer/fsdp.py, learner.py, shards.py) under `torchrun --nproc_per_node 2`
(gloo, CPU): a world-2 step equals a world-1 step on the same batch, with uneven micro-batches
(idle passes), the KL penalty, activation checkpointing and an LR warmup; a sharded checkpoint
written by 2 ranks resumes on 1 process and continues exactly as an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.fsdp import cfg_dict, make_samples, torchrun
from tests.helpers.tolerance import assert_adam_close, grad_reduction_len, sum_rtol
from trainer.config import TrainerConfig
from trainer.factory import build_learner, build_model, build_optimizer


def one_process(cfg: dict, samples, steps: int):
    c = TrainerConfig(**cfg)
    model, _ = build_model(c)
    learner = build_learner(model, build_optimizer(model, c), c)
    stats = [learner.step(samples) for _ in range(steps)]
    return learner, stats


def grad_len(model, samples) -> int:
    return grad_reduction_len(model.cfg, sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples))


def assert_runs_close(got: dict, model, cfg: dict, samples, lrs: list[float]) -> None:
    # why: world 2 (or a resume) sums the gradients in another order than one process: AdamW's bound
    want = {n: p.detach() for n, p in model.named_parameters()}
    assert_adam_close(
        got,
        want,
        lrs=lrs,
        betas=tuple(TrainerConfig(**cfg).optim.betas),
        reduction_len=grad_len(model, samples),
    )


def test_world2_fsdp_steps_equal_world1(tmp_path):
    samples = make_samples()
    torch.save(samples, tmp_path / "samples.pt")
    cfg = cfg_dict(tmp_path)
    res = torchrun(tmp_path, {"cfg": cfg, "samples": str(tmp_path / "samples.pt"), "steps": 2})
    learner, stats = one_process(cfg, samples, 2)
    assert_runs_close(res["fp32"], learner.model, cfg, samples, [s["lr"] for s in stats])
    n = grad_len(learner.model, samples)
    n_params = sum(p.numel() for p in learner.model.parameters())
    for s1, s2 in zip(stats, res["stats"]):
        # why: the schedule is the same Python float arithmetic on every rank: exact
        assert s1["lr"] == s2["lr"] and s1["lr"] < cfg["optim"]["lr"]  # warmup applies on every rank
        # why: the loss is a mean of per-token terms of length-n reductions, O(1) values
        assert abs(s1["loss"] - s2["loss"]) <= sum_rtol(n) * max(1.0, abs(s1["loss"]))
        # why: each gradient element's rounding, then a sum of n_params squares
        assert abs(s1["grad_norm"] - s2["grad_norm"]) <= (sum_rtol(n) + sum_rtol(n_params)) * s1["grad_norm"]
        assert s2["kl_ref"] >= 0
    assert res["stats"][1]["kl_ref"] > 0  # moved away from the reference
    init, _ = build_model(TrainerConfig(**cfg))
    assert any(not torch.equal(v, dict(init.named_parameters())[n].detach()) for n, v in res["fp32"].items())
    # published bf16 = the trained fp32 weights rounded, gathered from the shards
    for n, v in res["state"].items():  # why equal: one cast of the same fp32 bits, no arithmetic
        assert torch.equal(v, res["fp32"][n].to(torch.bfloat16)), n


def test_sharded_checkpoint_resumes_on_one_process(tmp_path):
    """2 ranks: one step, sharded DCP save. 1 process: load it, step again == 2 uninterrupted steps."""
    from trainer import checkpoint

    samples = make_samples(seed=1)
    torch.save(samples, tmp_path / "samples.pt")
    cfg = cfg_dict(tmp_path, loss={"kl_coef": 0.0}, policy={"activation_checkpointing": False})
    res = torchrun(
        tmp_path,
        {
            "cfg": cfg,
            "samples": str(tmp_path / "samples.pt"),
            "steps": 1,
            "save": True,
            "ckpt_dir": cfg["checkpoint"]["dir"],
        },
    )
    ref_payload = res["payload"]
    assert ref_payload["model"]["optim"] is True and ref_payload["optimizer"] == {}
    folder = Path(cfg["checkpoint"]["dir"]) / ref_payload["model"]["__dcp__"]
    assert (folder / ".metadata").is_file() and len(list(folder.glob("*.distcp"))) == 2  # one file per rank
    c = TrainerConfig(**cfg)
    model, _ = build_model(c)
    learner = build_learner(model, build_optimizer(model, c), c)
    learner.checkpoint.load(cfg["checkpoint"]["dir"], ref_payload["model"], ref_payload["optimizer"])
    for n, p in model.named_parameters():  # why equal: a load copies the saved bits
        assert torch.equal(p.detach(), res["fp32"][n]), n
    learner.step(samples)
    straight, stats = one_process(cfg, samples, 2)
    # step 1 ran on 2 ranks (another gradient summation order than one process): AdamW's bound
    assert_runs_close(
        {n: p for n, p in model.named_parameters()}, straight.model, cfg, samples, [s["lr"] for s in stats]
    )
    # the trainer checkpoint file names the folder; a folder without .metadata is refused
    st = checkpoint.TrainerState(version=1, epoch=1, **ref_payload)
    checkpoint.save(cfg["checkpoint"]["dir"], checkpoint.snapshot(st))
    assert checkpoint.load_latest(cfg["checkpoint"]["dir"]).model == ref_payload["model"]
    (folder / ".metadata").unlink()
    with pytest.raises(FileNotFoundError, match="incomplete"):
        learner.checkpoint.load(cfg["checkpoint"]["dir"], ref_payload["model"], {})


def test_warm_start_under_world2_matches_one_process(tmp_path):
    """The leader's start (Trainer.prepare) with warm-start steps in a 2-rank sharded group: every
    rank takes part in the warm start (it used to run on rank 0 alone and hang the group), and the
    result is the one-process warm start (fp32 weights within fp32 tolerance)."""
    from trainer.leader import Trainer

    cfg = cfg_dict(
        tmp_path,
        loss={"kl_coef": 0.0},
        policy={"activation_checkpointing": False},
        warmstart={"steps": 2, "batch": 4},
        run={"dir": str(tmp_path / "run2")},
    )
    Path(cfg["run"]["dir"]).mkdir()
    res = torchrun(tmp_path, {"cfg": cfg, "prepare": True}, timeout_s=150)
    one = {**cfg, "checkpoint": {"dir": str(tmp_path / "ckpt1")}, "run": {"dir": str(tmp_path / "run1")}}
    Path(one["run"]["dir"]).mkdir()
    c = TrainerConfig(**one)
    model, mcfg = build_model(c)
    tr = Trainer(c, None, build_learner(model, build_optimizer(model, c), c), mcfg)
    tr.prepare()
    init, _ = build_model(c := TrainerConfig(**cfg))
    # why: 2 ranks sum the demonstrations' gradients in another order; warm start: AdamW default betas
    tokens = c.warmstart.batch * 128  # arith demonstrations: < 128 tokens each (73 the longest of 64)
    assert_adam_close(
        res["fp32"],
        {n: p.detach() for n, p in model.named_parameters()},
        lrs=[c.warmstart.lr] * c.warmstart.steps,
        betas=(0.9, 0.999),
        reduction_len=grad_reduction_len(mcfg, tokens),
    )
    moved = False
    for n, p in model.named_parameters():
        moved |= not torch.equal(p.detach(), dict(init.named_parameters())[n].detach())
    assert moved  # the warm start did train
    assert res["version"] == tr.version == 0 and res["digest"]
    saved = torch.load(Path(cfg["run"]["dir"]) / "warmstart.pt", weights_only=False)["model"]
    for n, v in res["fp32"].items():  # rank 0 saved the whole model (why equal: a copy, no arithmetic)
        assert torch.equal(saved[n], v), n


def test_async_save_in_flight_then_kill_resumes_from_last_complete(tmp_path):
    """async_checkpoint: v1 is saved in the background and named by its checkpoint file only once
    complete; rank 0 dies with the v2 save in flight. Resume finds v1 (complete, exact), never v2."""
    from trainer import checkpoint

    samples = make_samples(seed=2)
    torch.save(samples, tmp_path / "samples.pt")
    cfg = cfg_dict(
        tmp_path,
        loss={"kl_coef": 0.0},
        policy={"activation_checkpointing": False},
        checkpoint={"async_save": True},
    )
    torchrun(tmp_path, {"cfg": cfg, "samples": str(tmp_path / "samples.pt"), "async_kill": True}, ok=False)
    out = tmp_path / "out"
    assert "Future" in (out / "v2-started").read_text()  # the v2 save was a background one
    v1 = torch.load(out / "v1.pt", weights_only=False)
    assert v1["complete"]  # named only once complete
    st = checkpoint.load_latest(cfg["checkpoint"]["dir"])
    assert (st.version, st.epoch) == (1, 1)
    c = TrainerConfig(**cfg)
    model, _ = build_model(c)
    learner = build_learner(model, build_optimizer(model, c), c)
    learner.checkpoint.load(cfg["checkpoint"]["dir"], st.model, st.optimizer)
    for n, p in model.named_parameters():  # why equal: a load copies the saved bits
        assert torch.equal(p.detach(), v1["fp32"][n]), n
    # and it continues like an uninterrupted run (step 1 on 2 ranks: AdamW's bound)
    learner.step(samples)
    straight, stats = one_process(cfg, samples, 2)
    assert_runs_close(
        {n: p for n, p in model.named_parameters()}, straight.model, cfg, samples, [s["lr"] for s in stats]
    )
