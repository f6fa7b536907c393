"""Reusing a warm start (warmstart_from), the warm start's own thread count and demonstration
prefetch, and the after-run eval of the initial policy (`python -m trainer --eval-initial`)."""

import dataclasses
import json

import pytest
import torch

import delta_codec
from asyncrl import config_check
from asyncrl.report import at_version_time, finish_run
from kernel.config import ConfigError
from policy import inference_state, load_tokenizer
from trainer import warmstart as ws
from trainer.config import TrainerConfig
from trainer.evaluate import evaluate
from trainer.factory import build_learner, build_model, build_optimizer, initial_model
from trainer.final_eval import evaluate_initial
from trainer.leader import Trainer

from .test_warmstart_until import config, say_digit  # noqa: F401  (the fixture)


def leader(cfg) -> Trainer:
    model, mcfg = build_model(cfg)
    return Trainer(cfg, None, build_learner(model, build_optimizer(model, cfg), cfg), mcfg)


def rows(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics" / "trainer.jsonl").read_text().splitlines()]


def test_warmstart_from_loads_an_earlier_runs_warm_start(tmp_path, say_digit):
    first = leader(config(tmp_path / "a", warmstart={"until": 0.0, "steps": 20}))
    first.prepare()
    saved = tmp_path / "a" / "run" / "warmstart.pt"
    assert torch.load(saved, weights_only=True)["warmstart_steps_done"] == 20
    # another run from it: no warm start step runs (the seeded model would differ), same bits as the first
    cfg = config(tmp_path / "b", warmstart={"until": 0.0, "steps": 20, "reuse": str(saved)}, run={"seed": 5})
    second = leader(cfg)
    second.prepare()
    assert second.warmstart_record == {
        "warmstart_steps_done": 20,
        "warmstart_stopped": "loaded",
        "warmstart_from": str(saved),
    }
    assert second.digest == first.digest
    assert [r.get("warmstart_stopped") for r in rows(tmp_path / "b" / "run")] == ["loaded"]
    assert (tmp_path / "b" / "run" / "warmstart.pt").exists()  # this run's starting policy, as ever
    (tmp_path / "b" / "run" / "plots").mkdir()
    summary = finish_run(tmp_path / "b" / "run", "test")
    assert summary["warmstart_stopped"] == "loaded" and summary["warmstart_steps_done"] == 20


def test_warmstart_from_another_model_shape_is_refused(tmp_path, say_digit):
    first = leader(config(tmp_path / "a", warmstart={"until": 0.0, "steps": 2}))
    first.prepare()
    other = config(
        tmp_path / "b",
        warmstart={"reuse": str(tmp_path / "a" / "run" / "warmstart.pt")},
        policy={
            "model": {
                "preset": "tiny",
                "d_model": 16,
                "n_layers": 1,
                "n_heads": 2,
                "n_kv_heads": 1,
                "d_ff": 32,
                "max_seq_len": 64,
            }
        },
    )
    tr = leader(other)
    before = {k: v.clone() for k, v in tr.learner.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"\[trainer.warmstart\] reuse .* saved for model"):
        tr.prepare()
    assert all(torch.equal(before[k], v) for k, v in tr.learner.model.state_dict().items())  # nothing loaded
    assert not (tmp_path / "b" / "run" / "warmstart.pt").exists()


def test_missing_warmstart_file_is_refused_before_start(tmp_path):
    with pytest.raises(ValueError, match=r"\[trainer.warmstart\] reuse: '.*nope.pt' is not a file"):
        TrainerConfig(trainer_id="t", warmstart={"reuse": str(tmp_path / "nope.pt")})
    with pytest.raises(ValueError, match=r"\[trainer.warmstart\] threads: .*\(got -1\)"):
        TrainerConfig(trainer_id="t", warmstart={"threads": -1})
    with pytest.raises(ConfigError, match=r"\[trainer.warmstart\] reuse: '.*nope.pt' is not a file"):
        config_check.resolve({"trainer": {"warmstart": {"reuse": str(tmp_path / "nope.pt")}}}, environ={})


def test_prefetched_demonstrations_keep_their_order_and_threads_are_restored(
    tmp_path, say_digit, monkeypatch
):
    cfg = config(
        tmp_path, warmstart={"until": 0.0, "steps": 6, "threads": 2}, tasks={"envs": [say_digit, say_digit]}
    )
    seen, threads = [], []
    real_step = ws._step

    def step(model, opt, prompts, completions, masks):
        seen.append(prompts)
        threads.append(torch.get_num_threads())
        return real_step(model, opt, prompts, completions, masks)

    monkeypatch.setattr(ws, "_step", step)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, _ = build_model(cfg)
        ws.warm_start(model, cfg)
        assert torch.get_num_threads() == 1 and threads == [2] * 6
    finally:
        torch.set_num_threads(before)
    # the same draws, in the same order, as one serial stream of demo_batch calls
    import random

    rng, tok = random.Random(cfg.run.seed + 7919), load_tokenizer(cfg.policy.tokenizer)
    assert seen == [ws.demo_batch(cfg.tasks.envs, cfg.warmstart.batch, rng, tok)[0] for _ in range(6)]


def test_initial_eval_after_the_run(tmp_path, say_digit):
    cfg = config(tmp_path, warmstart={"until": 0.0, "steps": 30}, tasks={"eval_prompts": 8})
    tr = leader(cfg)
    tr.prepare()
    run = tmp_path / "run"
    # the final eval of the last version has landed first: the summary still orders them by version
    tr.write_jsonl({"eval_success": 0.25, "eval_tokens": 3.0, "version": 7, "eval_final": True})
    row = evaluate_initial(cfg)
    assert row["version"] == 0 and row["eval_initial"] and rows(run)[-1] == row
    want = evaluate(
        tr.published,
        tr.model_cfg,
        load_tokenizer(cfg.policy.tokenizer),
        cfg.tasks.envs,
        cfg.tasks.sampling,
        8,
        cfg.run.seed,
        cfg.tasks.chat_template,
    )
    assert row["eval_success"] == want["eval_success"]  # the warm start's published bits
    assert evaluate_initial(cfg) == {}  # v0 is evaluated once
    (run / "plots").mkdir()
    summary = finish_run(run, "test")
    assert summary["eval_success_initial"] == row["eval_success"] and summary["eval_version_final"] == 7
    assert summary["eval_success_final"] == 0.25
    # without a warm start the initial policy is the trainer's seeded initial model
    plain = dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, dir=str(tmp_path / "plain")),
        warmstart=dataclasses.replace(cfg.warmstart, steps=0),
    )
    row = evaluate_initial(plain)
    model, mcfg = initial_model(plain)
    want = evaluate(
        inference_state(model),
        mcfg,
        load_tokenizer(cfg.policy.tokenizer),
        cfg.tasks.envs,
        cfg.tasks.sampling,
        8,
        cfg.run.seed,
        cfg.tasks.chat_template,
    )
    assert row["eval_success"] == want["eval_success"] and row["eval_tokens"] == want["eval_tokens"]


def test_kl_reference_is_the_warm_started_policy_also_after_a_resume(tmp_path, say_digit):
    cfg = config(tmp_path, warmstart={"until": 0.0, "steps": 20}, loss={"kl_coef": 0.1})
    tr = leader(cfg)
    initial = {k: v.clone() for k, v in tr.learner.reference.state_dict().items()}
    tr.prepare()
    ref, pol = tr.learner.reference.state_dict(), tr.learner.model.state_dict()
    assert all(torch.equal(ref[k], pol[k]) for k in pol)  # not the random initial weights
    assert not all(torch.equal(ref[k], initial[k]) for k in initial)
    assert not any(p.requires_grad for p in tr.learner.reference.parameters())
    # a restarted trainer resumes from the checkpoint: its reference is reloaded from warmstart.pt
    with torch.no_grad():
        for p in tr.learner.model.parameters():
            p.add_(0.01)  # RL moved the policy
    tr.published = tr.learner.publication.published_state()
    tr.digest = delta_codec.state_digest(tr.published)
    tr.save()
    again = leader(cfg)
    again.prepare()
    assert again.warmstarted and not again.warmstart_record  # resumed, no second warm start
    ref2 = again.learner.reference.state_dict()
    assert all(torch.equal(ref2[k], ref[k]) for k in ref)
    assert not torch.equal(again.learner.model.state_dict()["tok_emb.weight"], ref["tok_emb.weight"])


def test_after_run_evals_are_plotted_where_their_versions_were_made():
    rows = [
        {"warmstart_steps_done": 250, "t": 3.0},
        {"samples": 16, "version": 1, "t": 10.0},
        {"samples": 16, "version": 2, "t": 20.0},
        {"eval_success": 0.4, "version": 2, "eval_final": True, "t": 50.0},
        {"eval_success": 0.2, "version": 0, "eval_initial": True, "t": 55.0},
        {"eval_success": 0.3, "version": 1, "t": 12.0},
    ]  # an in-run eval stays put
    placed = at_version_time(rows)
    evals = [(r["version"], r["t"]) for r in placed if "eval_success" in r]
    assert evals == [(0, 3.0), (1, 12.0), (2, 20.0)]
    assert [r["t"] for r in placed] == sorted(r["t"] for r in placed) and rows[3][
        "t"
    ] == 50.0  # input untouched
