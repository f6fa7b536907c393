"""A warm start stopped on measured success (warmstart_until): checks on the train split, stops at
the first passing check, leaves the training trajectory alone, is recorded by the leader and the
run's summary, and bad settings are refused before start."""

import dataclasses
import json

import pytest

from asyncrl import config_check
from asyncrl.launch import Telemetry, warmstart_line
from asyncrl.report import finish_run
from envs import base
from envs.base import TaskSpec, Verdict
from kernel.config import ConfigError
from trainer.config import TrainerConfig
from trainer.factory import build_learner, build_model, build_optimizer
from trainer.leader import Trainer
from trainer.warmstart import warm_start

from .helpers.trainer import trainer_config


class SayDigit:
    """Train tasks ask for a 7, eval tasks for a 3; demonstrations come from the train split only,
    so a policy warm-started here succeeds on train tasks and fails every eval task: a check that
    read the eval split would never pass."""

    name = "say-digit-test"

    def sample(self, rng, split: str = "train") -> TaskSpec:
        d = "7" if split == "train" else "3"
        return TaskSpec(prompt=f"Q{d}:", spec={"answer": d})

    def verify(self, text: str, spec: dict) -> Verdict:
        ok = text.strip() == spec["answer"]
        return Verdict(float(ok), "correct" if ok else f"wrong {text!r}")

    def demonstration(self, spec: dict, style: str = "default") -> str:
        return spec["answer"]


@pytest.fixture
def say_digit():
    base.ENVS[SayDigit.name] = SayDigit
    yield SayDigit.name
    base.ENVS.pop(SayDigit.name)
    base._INSTANCES.pop(SayDigit.name, None)


# the char tokenizer's vocabulary (the default): the policy samples only decodable ids
MODEL = {
    "preset": "tiny",
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 1,
    "d_ff": 64,
    "max_seq_len": 64,
}


def config(tmp_path, **kw) -> TrainerConfig:
    """The say-digit trainer; a section in `kw` is merged key by key into these."""
    base = {
        "tasks": {"envs": [SayDigit.name], "sampling": {"temperature": 1.0, "max_tokens": 4}},
        "policy": {"model": MODEL},
        "warmstart": {"steps": 200, "lr": 1e-2, "batch": 8, "until": 0.75, "check_every": 5, "check_n": 16},
    }
    over = {
        k: {**base[k], **v} if isinstance(base.get(k), dict) and isinstance(v, dict) else v
        for k, v in kw.items()
    }
    return trainer_config("nats://unused", tmp_path, **{**base, **over})


def test_stops_at_the_first_check_that_passes(tmp_path, say_digit):
    cfg = config(tmp_path)
    model, _ = build_model(cfg)
    checks = []
    losses = warm_start(model, cfg, on_check=checks.append)
    steps = [c["warmstart_step"] for c in checks]
    assert steps == list(range(5, len(losses) + 1, 5))  # every 5 steps, the last one where it stopped
    assert len(losses) < cfg.warmstart.steps  # stopped early, on success (train split)
    assert checks[-1]["warmstart_check_success"] >= 0.75
    assert all(c["warmstart_check_success"] < 0.75 for c in checks[:-1])
    assert all(c["warmstart_check_n"] == 16 for c in checks) and model.training
    # the checks draw nothing from the warm start's own streams: the same steps without them
    model2, _ = build_model(cfg)
    plain = warm_start(
        model2,
        dataclasses.replace(cfg, warmstart=dataclasses.replace(cfg.warmstart, until=0.0, steps=len(losses))),
    )
    assert plain == losses


def test_check_window_and_cap(tmp_path, say_digit):
    cfg = config(tmp_path, warmstart={"until": 1.0, "steps": 12, "check_from": 3, "check_every": 4})
    model, _ = build_model(cfg)
    checks = []
    losses = warm_start(model, cfg, on_check=checks.append)
    assert len(losses) == 12  # 3 and 7 and 11 checked, none passed yet
    assert [c["warmstart_step"] for c in checks] == [3, 7, 11]


@pytest.mark.filterwarnings("error:No artists with labels")  # (its plot has panels with no series yet)
def test_leader_records_where_the_warm_start_stopped(tmp_path, say_digit):
    cfg = config(tmp_path)
    model, mcfg = build_model(cfg)
    tr = Trainer(cfg, None, build_learner(model, build_optimizer(model, cfg), cfg), mcfg)
    tr.prepare()
    rec = tr.warmstart_record
    assert rec["warmstart_stopped"] == "until" and rec["warmstart_steps_done"] < 200
    assert rec["warmstart_check_success_last"] >= 0.75
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert [r["warmstart_step"] for r in rows[:-1]] == list(range(5, rec["warmstart_steps_done"] + 1, 5))
    assert rows[-1]["warmstart_steps_done"] == rec["warmstart_steps_done"] and (run / "warmstart.pt").exists()
    (run / "plots").mkdir()
    summary = finish_run(run, "test")
    assert (
        summary["warmstart_steps_done"] == rec["warmstart_steps_done"]
        and summary["warmstart_stopped"] == "until"
    )
    assert summary["warmstart_checks"][-1] == [
        rec["warmstart_steps_done"],
        rec["warmstart_check_success_last"],
    ]
    assert summary["eval_success_initial"] is None  # checks are not held-out evals
    tel = Telemetry(run)
    tel.record("trainer", "T1", {**rec, "version": 0}, persist=False)
    tel.record("trainer", "T1", {"version": 1, "reward_mean": 0.5}, persist=False)
    assert warmstart_line(tel).startswith(f"warm start: {rec['warmstart_steps_done']} steps (until)")


@pytest.mark.parametrize(
    "bad",
    [
        {"until": 1.5},
        {"until": -0.1},
        {"until": 0.4, "steps": 0},
        {"check_every": 0},
        {"check_n": 0},
        {"check_from": -1},
    ],
)
def test_bad_settings_are_refused_before_start(bad):
    key = next(k for k in bad if k != "steps")
    with pytest.raises(ValueError, match=key):
        TrainerConfig(trainer_id="t", warmstart={"steps": 100, **bad})
    with pytest.raises(ConfigError, match=rf"\[trainer.warmstart\].*{key}"):  # `asyncrl up` / `config check`
        config_check.resolve({"trainer": {"warmstart": {"steps": 100, **bad}}}, environ={})
