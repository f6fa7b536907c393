"""Chunked logprobs and the kept-token denominator under FSDP2 (torchrun, 2 ranks, gloo): the
vocabulary projection runs a few rows at a time under activation checkpointing inside the
sharded model's forward, masked IS rejects tokens on both ranks, and the loss is rescaled by the
kept count summed over the ranks; the world-2 step still equals the world-1 step. The token
budget gives the ranks uneven micro-batches, so one makes idle passes with the KL reference on:
they must run their forwards in a real pass's order (before: gloo aborted on a size mismatch)."""

from __future__ import annotations

import torch

from tests.helpers.fsdp import cfg_dict, make_samples, torchrun
from tests.helpers.tolerance import sum_rtol
from tests.test_trainer_fsdp import assert_runs_close, grad_len, one_process


def test_world2_chunked_masked_step_equals_world1(tmp_path):
    samples = make_samples()
    torch.save(samples, tmp_path / "samples.pt")
    # ~3 rows of logits per chunk; is_clip 15: tokens whose behaviour logprob is above ~-1.9 are rejected
    cfg = cfg_dict(
        tmp_path,
        loss={"logit_chunk_mb": 0.001, "is_mode": "masked", "is_clip": 15.0, "micro_batch_tokens": 40},
    )
    res = torchrun(tmp_path, {"cfg": cfg, "samples": str(tmp_path / "samples.pt"), "steps": 2})
    learner, stats = one_process(cfg, samples, 2)
    assert 0 < stats[0]["kept_tokens"] < stats[0]["n_tokens"]  # something really is rejected
    assert res["stats"][0]["kept_tokens"] == stats[0]["kept_tokens"]  # summed over both ranks
    assert_runs_close(res["fp32"], learner.model, cfg, samples, [s["lr"] for s in stats])
    n = grad_len(learner.model, samples)
    for s1, s2 in zip(stats, res["stats"]):
        assert abs(s1["loss"] - s2["loss"]) <= sum_rtol(n) * max(1.0, abs(s1["loss"]))
