"""TrainerConfig in sections (trainer/sections.py): few top-level fields, an old flat key an unknown
key naming the nearest one (files, dicts; `asyncrl config check` as a real process), nested env overrides,
the resolved tree printed."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from kernel.config import ConfigError, load_config
from tests.helpers.config_sections import ROOT, check_shipped, printed_tree, run_config_check
from trainer.config import TrainerConfig
from trainer.loss import LossConfig


def test_trainer_config_has_at_most_15_top_level_fields():
    names = [f.name for f in dataclasses.fields(TrainerConfig)]
    assert len(names) <= 15, names
    assert isinstance(TrainerConfig().loss, LossConfig)  # the loss takes its section whole


def test_an_old_flat_key_is_an_unknown_key_naming_the_nearest_one(tmp_path):
    cfg = tmp_path / "old.toml"
    cfg.write_text("[up]\nworkers = 1\n[trainer]\nlr = 3e-4\n[worker.admission]\nmax_lag = 4\n")
    r = run_config_check(cfg)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "[trainer] unknown key 'lr'; did you mean [trainer.optim] lr?" in r.stderr, r.stderr
    f = tmp_path / "t.toml"
    f.write_text("[trainer]\nmax_steps = 3\n")
    with pytest.raises(
        ConfigError, match=r"\[trainer\] unknown key 'max_steps'; did you mean \[trainer.run\] max_steps\?"
    ):
        load_config(TrainerConfig, f, section="trainer", environ={})
    with pytest.raises(ConfigError, match=r"\[trainer.optim\] unknown key 'lrr'; did you mean 'lr'\?"):
        load_config(TrainerConfig, None, overrides={"optim": {"lrr": 1}}, environ={}, table="trainer")


def test_env_override_of_a_nested_key():
    cfg = load_config(
        TrainerConfig,
        None,
        environ={
            "ASYNCRL_OPTIM__LR": "3e-4",
            "ASYNCRL_BATCH__GROUPS": "8",
            "ASYNCRL_BUS__SERVERS": "nats://a:4222,nats://b:4222",
            "ASYNCRL_ENGINE__SLOTS": "4",
        },
    )  # another process's: ignored
    assert cfg.optim.lr == 3e-4 and cfg.batch.groups == 8
    assert cfg.bus.servers == ["nats://a:4222", "nats://b:4222"]
    with pytest.raises(
        ConfigError, match=r"env ASYNCRL_SIGNING_KEY: .*did you mean ASYNCRL_PUBLISH__SIGNING_KEY\?"
    ):
        load_config(TrainerConfig, None, environ={"ASYNCRL_SIGNING_KEY": "/k"})


def test_env_override_reaches_a_trainer_process(tmp_path):
    """The nested spelling as a real trainer process reads it (its --eval-final path: no bus)."""
    cfg = tmp_path / "t.toml"
    cfg.write_text('[trainer.checkpoint]\ndir = "/nonexistent/ckpt"\n')
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_") or k == "ASYNCRL_CACHE"},
        "PYTHONPATH": str(ROOT),
        "ASYNCRL_CHECKPOINT__DIR": str(tmp_path / "empty"),
        "ASYNCRL_TASKS__EVAL_PROMPTS": "4",
    }
    argv = [sys.executable, "-m", "trainer", "--config", str(cfg), "--eval-final"]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and f"no checkpoint in {tmp_path / 'empty'}" in out, out[-2000:]
    # a flat variable naming a section's key is refused with the nested name, not dropped quietly
    env["ASYNCRL_CHECKPOINT_DIR"] = "/x"
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "did you mean ASYNCRL_CHECKPOINT__DIR?" in r.stderr, r.stderr[-2000:]


def test_config_check_prints_the_tree(tmp_path):
    cfg = tmp_path / "new.toml"
    cfg.write_text(
        "[up]\nworkers = 1\n[trainer.optim]\nlr = 3e-4\n[trainer.batch]\nmax_lag = 3\n"
        "[worker.admission]\nmax_lag = 3\n"
    )
    r = run_config_check(cfg)
    assert r.returncode == 0, r.stderr
    tree = printed_tree(r.stdout, "trainer")
    assert tree["optim"]["lr"] == 3e-4 and tree["batch"]["max_lag"] == 3
    assert tree["loss"]["is_mode"] == "truncated"
    assert set(tree) == {f.name for f in dataclasses.fields(TrainerConfig)}


def test_shipped_configs_use_the_sections():
    check_shipped(TrainerConfig, "trainer")
