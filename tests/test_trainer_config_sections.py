"""TrainerConfig in sections (trainer/sections.py): few top-level fields, old flat keys refused with
their new place (files, dicts, env; `asyncrl config check` as a real process), nested env overrides,
the resolved tree printed."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from kernel.config import ConfigError, load_config
from tests.helpers.config_sections import ROOT, check_moved, check_shipped, printed_tree, run_config_check
from trainer.config import TrainerConfig
from trainer.loss import LossConfig


def test_trainer_config_has_at_most_15_top_level_fields():
    names = [f.name for f in dataclasses.fields(TrainerConfig)]
    assert len(names) <= 15, names
    assert isinstance(TrainerConfig().loss, LossConfig)  # the loss takes its section whole


def test_every_moved_key_names_an_existing_section_field():
    check_moved(TrainerConfig)


def test_old_flat_keys_fail_config_check_naming_every_new_place(tmp_path):
    cfg = tmp_path / "old.toml"
    cfg.write_text(
        '[up]\nworkers = 1\n[trainer]\nlr = 3e-4\nbatch_groups = 8\nwarmstart_from = "w.pt"\n'
        'publish = "sharded"\nelastic_nnodes = "2:2"\n[worker.admission]\nmax_lag = 4\n'
    )
    r = run_config_check(cfg)
    assert r.returncode == 2, r.stdout + r.stderr
    for moved in (
        "lr: moved to [trainer.optim] lr",
        "batch_groups: moved to [trainer.batch] groups",
        "warmstart_from: moved to [trainer.warmstart] reuse",
        "publish: moved to [trainer.publish] layout",
        "elastic_nnodes: moved to [trainer.elastic] nnodes",
    ):
        assert moved in r.stderr, r.stderr


def test_old_flat_key_in_a_dict_or_a_file_is_refused_by_the_loader(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint_dir: moved to \[trainer.checkpoint\] dir"):
        load_config(TrainerConfig, None, overrides={"checkpoint_dir": "/x"}, environ={}, table="trainer")
    f = tmp_path / "t.toml"
    f.write_text("[trainer]\nmax_steps = 3\n")
    with pytest.raises(ConfigError, match=r"max_steps: moved to \[trainer.run\] max_steps"):
        load_config(TrainerConfig, f, section="trainer", environ={})
    with pytest.raises(ConfigError, match=r"lr_schedule: moved to \[optim\] schedule"):  # no table named
        load_config(TrainerConfig, None, environ={}, overrides={"lr_schedule": "cosine"})


def test_env_override_of_a_nested_key_and_a_flat_one_refused():
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
        ConfigError, match=r"ASYNCRL_SIGNING_KEY.*\[publish\] signing_key.*ASYNCRL_PUBLISH__SIGNING_KEY"
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
    env["ASYNCRL_CHECKPOINT_DIR"] = "/x"
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "ASYNCRL_CHECKPOINT__DIR" in r.stderr, r.stderr[-2000:]


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
