"""ScorerConfig in sections (scorer/sections.py): the layout, old flat keys refused with their new
place (files, dicts, env; `asyncrl config check` and the scorer as a real process), nested env
overrides, a bad value per section still a clear error naming its table and key, the resolved tree
printed, `up`'s process-wide keys in [scorer.run], and every shipped config's [scorer] loading."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from asyncrl import child_conf, config_check
from kernel.config import ConfigError, load_config
from scorer.config import ScorerConfig
from scorer.sections import RewardSection, RunSection, SandboxSection
from tests.helpers import config_sections as shared
from tests.helpers.deploy import ENV_DIR, read_env

SECTIONS = {
    "reward": {"cost_unit", "default_lambda", "overlong_buffer", "overlong_scale", "episode_reward"},
    "run": {"concurrency", "verify_threads", "threads", "heartbeat_s", "grace_s", "provision", "metrics_port"}
    | {"metrics_host", "instance", "log_level"},
    "sandbox": {"allow_weak_sandbox", "envs"},
}
# the other processes' tables of a run config, agreeing (config check's cross-process checks pass)
AGREE = "[up]\nworkers = 1\n[trainer.batch]\nmax_lag = 4\n[worker.admission]\nmax_lag = 4\n"
# every key of the flat layout (16 fields before the sections) but the two that stay at the top
FLAT = (
    "concurrency verify_threads threads cost_unit default_lambda overlong_buffer overlong_scale "
    "episode_reward heartbeat_s grace_s provision metrics_port log_level allow_weak_sandbox"
).split()


def test_the_section_layout():
    shared.check_layout(ScorerConfig, ["bus", "scorer_id"], SECTIONS)
    cfg = ScorerConfig()
    assert isinstance(cfg.reward, RewardSection) and isinstance(cfg.run, RunSection)
    assert isinstance(cfg.sandbox, SandboxSection) and not cfg.sandbox.allow_weak_sandbox
    # the defaults of the flat layout, unchanged
    assert (cfg.reward.cost_unit, cfg.reward.default_lambda, cfg.reward.episode_reward) == (
        "tokens",
        0.0,
        "fraction",
    )
    assert (cfg.run.concurrency, cfg.run.verify_threads, cfg.run.grace_s, cfg.run.provision) == (
        8,
        4,
        10.0,
        True,
    )
    # what stays at the top: the scorer's id names its bus client (the Rl-From header)
    cfg = ScorerConfig(scorer_id="s1", run={"concurrency": 2})
    assert cfg.bus.name == "s1" and cfg.run.concurrency == 2 and cfg.run.verify_threads == 4
    assert ScorerConfig().scorer_id.startswith("scorer-")


def test_every_old_flat_key_moved_to_an_existing_field():
    shared.check_moved(ScorerConfig, FLAT)
    assert ScorerConfig.MOVED["cost_unit"] == "reward.cost_unit"
    assert ScorerConfig.MOVED["allow_weak_sandbox"] == "sandbox.allow_weak_sandbox"


def test_old_flat_keys_in_a_file_or_a_dict_are_refused_naming_the_new_key(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(
        'scorer_id = "s"\nconcurrency = 4\ncost_unit = "wall_s"\nallow_weak_sandbox = true\n'
        '[bus]\nname = "x"\n'
    )
    with pytest.raises(ConfigError) as e:
        load_config(ScorerConfig, f, environ={})
    for moved in (
        "concurrency: moved to [run] concurrency",
        "cost_unit: moved to [reward] cost_unit",
        "allow_weak_sandbox: moved to [sandbox] allow_weak_sandbox",
    ):
        assert moved in str(e.value), str(e.value)
    # a run config's [scorer] table (as `asyncrl up` and `config check` read it)
    f.write_text("[scorer]\ndefault_lambda = 0.01\nheartbeat_s = 1.0\n")
    with pytest.raises(ConfigError) as e:
        load_config(ScorerConfig, f, section="scorer", environ={})
    assert "default_lambda: moved to [scorer.reward] default_lambda" in str(e.value)
    assert "heartbeat_s: moved to [scorer.run] heartbeat_s" in str(e.value)
    for key, value, new in (
        ("cost_unit", "tokens", r"\[scorer.reward\] cost_unit"),
        ("episode_reward", "resolved", r"\[scorer.reward\] episode_reward"),
        ("overlong_buffer", 8, r"\[scorer.reward\] overlong_buffer"),
        ("verify_threads", 2, r"\[scorer.run\] verify_threads"),
        ("provision", False, r"\[scorer.run\] provision"),
        ("threads", 1, r"\[scorer.run\] threads"),
    ):
        with pytest.raises(ConfigError, match=rf"{key}: moved to {new}"):
            load_config(ScorerConfig, None, overrides={key: value}, environ={}, table="scorer")


def test_old_flat_keys_fail_config_check_naming_every_new_place(tmp_path):
    cfg = tmp_path / "old.toml"
    cfg.write_text(
        AGREE + '[scorer]\nconcurrency = 4\nheartbeat_s = 2.0\nepisode_reward = "resolved"\n'
        "allow_weak_sandbox = true\n"
    )
    r = shared.run_config_check(cfg, env=shared.clean_env())
    assert r.returncode == 2, r.stdout + r.stderr
    for moved in (
        "concurrency: moved to [scorer.run] concurrency",
        "heartbeat_s: moved to [scorer.run] heartbeat_s",
        "episode_reward: moved to [scorer.reward] episode_reward",
        "allow_weak_sandbox: moved to [scorer.sandbox] allow_weak_sandbox",
    ):
        assert moved in r.stderr, r.stderr
    # `up` resolves the same way before it starts anything
    with pytest.raises(ConfigError, match=r"\[scorer\]: .*cost_unit: moved to \[scorer.reward\] cost_unit"):
        config_check.resolve({"scorer": {"cost_unit": "tokens"}}, environ={})


def test_the_scorer_process_refuses_an_old_key_and_reads_nested_env(tmp_path):
    """As `python -m scorer` reads them (each fails before any broker is needed)."""
    f = tmp_path / "s.toml"
    f.write_text("concurrency = 4\n")
    r = shared.run("-m", "scorer", "--config", str(f), env=shared.clean_env())
    assert r.returncode == 2, r.stderr[-2000:]
    assert "concurrency: moved to [run] concurrency" in r.stderr and "Traceback" not in r.stderr
    # a nested variable reaches the process's config (a bad value, so it stops before connecting)
    r = shared.run("-m", "scorer", env=shared.clean_env(ASYNCRL_REWARD__COST_UNIT="dollars"))
    assert r.returncode == 2 and "[scorer.reward] invalid value for cost_unit" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    r = shared.run("-m", "scorer", env=shared.clean_env(ASYNCRL_CONCURRENCY="4"))
    assert r.returncode == 2 and "set ASYNCRL_RUN__CONCURRENCY" in r.stderr, r.stderr[-2000:]


def test_env_overrides_nest_and_a_flat_one_is_refused_with_its_variable():
    cfg = load_config(
        ScorerConfig,
        None,
        environ={
            "ASYNCRL_REWARD__COST_UNIT": "wall_s",
            "ASYNCRL_REWARD__DEFAULT_LAMBDA": "0.01",
            "ASYNCRL_REWARD__EPISODE_REWARD": "resolved",
            "ASYNCRL_RUN__CONCURRENCY": "16",
            "ASYNCRL_RUN__PROVISION": "false",
            "ASYNCRL_RUN__METRICS_PORT": "9400",
            "ASYNCRL_SANDBOX__ALLOW_WEAK_SANDBOX": "1",
            "ASYNCRL_SCORER_ID": "s7",
            "ASYNCRL_OPTIM__LR": "3e-4",  # the trainer's: ignored
            "ASYNCRL_RUN__DIR": "/x",  # the trainer's [trainer.run] dir: not a scorer key, ignored
            "ASYNCRL_ENGINE__SLOTS": "4",  # the worker's: ignored
        },
    )
    assert (cfg.reward.cost_unit, cfg.reward.default_lambda, cfg.reward.episode_reward) == (
        "wall_s",
        0.01,
        "resolved",
    )
    assert cfg.run.concurrency == 16 and cfg.run.provision is False and cfg.run.metrics_port == 9400
    assert cfg.sandbox.allow_weak_sandbox and cfg.scorer_id == "s7" and cfg.bus.name == "s7"
    for var, new in (
        ("ASYNCRL_CONCURRENCY", "ASYNCRL_RUN__CONCURRENCY"),
        ("ASYNCRL_PROVISION", "ASYNCRL_RUN__PROVISION"),
        ("ASYNCRL_METRICS_PORT", "ASYNCRL_RUN__METRICS_PORT"),
        ("ASYNCRL_HEARTBEAT_S", "ASYNCRL_RUN__HEARTBEAT_S"),
        ("ASYNCRL_COST_UNIT", "ASYNCRL_REWARD__COST_UNIT"),
        ("ASYNCRL_DEFAULT_LAMBDA", "ASYNCRL_REWARD__DEFAULT_LAMBDA"),
        ("ASYNCRL_OVERLONG_SCALE", "ASYNCRL_REWARD__OVERLONG_SCALE"),
        ("ASYNCRL_ALLOW_WEAK_SANDBOX", "ASYNCRL_SANDBOX__ALLOW_WEAK_SANDBOX"),
    ):
        with pytest.raises(ConfigError, match=rf"env {var}: .*moved to .*: set {new}$"):
            load_config(ScorerConfig, None, environ={var: "1"})
    # a run config's table names the new place in full
    with pytest.raises(ConfigError, match=r"moved to \[scorer.run\] grace_s: set ASYNCRL_RUN__GRACE_S$"):
        load_config(ScorerConfig, None, environ={"ASYNCRL_GRACE_S": "3"}, table="scorer")


@pytest.mark.parametrize(
    "values,message",
    [
        (
            {"reward": {"cost_unit": "dollars"}},
            r"reward: \[scorer.reward\] invalid value for cost_unit: cost_unit='dollars'; "
            r"cost_unit: one of tokens, wall_s, tool_calls",
        ),
        (
            {"reward": {"episode_reward": "tests"}},
            r"\[scorer.reward\] invalid value for episode_reward: episode_reward='tests'; "
            r"episode_reward: one of fraction, resolved",
        ),
        (
            {"reward": {"default_lambda": -1}},
            r"\[scorer.reward\] invalid value for default_lambda: default_lambda=-1",
        ),
        ({"reward": {"default_lambda": "nan"}}, r"\[scorer.reward\] invalid value for default_lambda"),
        ({"reward": {"overlong_buffer": -8}}, r"\[scorer.reward\] invalid value for overlong_buffer"),
        ({"reward": {"overlong_scale": "inf"}}, r"\[scorer.reward\] invalid value for overlong_scale"),
        ({"reward": {"overlong_buffer": "many"}}, r"reward.overlong_buffer: expected int, got 'many'"),
        ({"run": {"concurrency": 0}}, r"run: \[scorer.run\] invalid value for concurrency: concurrency=0"),
        (
            {"run": {"concurrency": 0, "verify_threads": 0}},
            r"\[scorer.run\] invalid value for concurrency, verify_threads: concurrency=0, verify_threads=0",
        ),
        ({"run": {"threads": -1}}, r"\[scorer.run\] invalid value for threads: threads=-1"),
        ({"run": {"provision": "maybe"}}, r"run.provision: expected a bool, got 'maybe'"),
        ({"sandbox": {"allow_weak_sandbox": "sure"}}, r"sandbox.allow_weak_sandbox: expected a bool"),
        ({"run": {"concurency": 4}}, r"run: unknown key\(s\) \['concurency'\]"),
        ({"reward": "tokens"}, r"reward: expected a table for RewardSection"),
    ],
)
def test_a_bad_value_in_each_section_is_a_clear_error(values, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ScorerConfig, None, overrides=values, environ={}, table="scorer")


def test_sections_check_themselves():
    with pytest.raises(ValueError, match=r"\[scorer.reward\] invalid value for cost_unit"):
        RewardSection(cost_unit="usd")
    with pytest.raises(ValueError, match=r"\[scorer.run\] invalid value for verify_threads"):
        RunSection(verify_threads=0)
    # a section given as a dict (tests, overrides) is built and checked like its table
    with pytest.raises(ConfigError, match=r"run: \[scorer.run\] invalid value for concurrency"):
        ScorerConfig(run={"concurrency": 0})
    assert ScorerConfig(reward={"overlong_buffer": 8}).reward.overlong_buffer == 8


def test_config_check_prints_the_scorer_tree(tmp_path):
    cfg = tmp_path / "new.toml"
    cfg.write_text(
        AGREE
        + '[scorer.run]\nconcurrency = 4\n[scorer.reward]\ncost_unit = "wall_s"\ndefault_lambda = 0.01\n'
        "[scorer.sandbox]\nallow_weak_sandbox = true\n"
    )
    r = shared.run_config_check(cfg, env=shared.clean_env())
    assert r.returncode == 0, r.stderr
    tree = shared.printed_tree(r.stdout, "scorer")
    assert set(tree) == {f.name for f in dataclasses.fields(ScorerConfig)}
    assert tree["run"]["concurrency"] == 4 and tree["run"]["verify_threads"] == 4
    assert tree["reward"] == {
        "cost_unit": "wall_s",
        "default_lambda": 0.01,
        "overlong_buffer": 0,
        "overlong_scale": 1.0,
        "episode_reward": "fraction",
    }
    assert tree["sandbox"] == {"allow_weak_sandbox": True, "envs": []}


def test_up_finds_the_process_wide_keys_in_scorer_run():
    conf = {"reward": {"cost_unit": "wall_s"}, "run": {"grace_s": 3.0, "threads": 2}}
    assert child_conf.get("scorer", conf, "grace_s") == 3.0
    out = child_conf.with_keys("scorer", conf, metrics_port=9402)
    assert (
        out["run"] == {"grace_s": 3.0, "threads": 2, "metrics_port": 9402} and out["reward"] == conf["reward"]
    )
    assert child_conf.where("scorer") == "scorer.run"
    # what `up` writes for a child loads as the scorer reads it
    load_config(ScorerConfig, None, overrides=out, environ={}, table="scorer")


def test_shipped_configs_use_the_sections():
    shared.check_shipped(ScorerConfig, "scorer")
    swe = tomllib.loads((shared.ROOT / "deploy" / "swe-demo.toml").read_text())["scorer"]
    assert swe["reward"]["episode_reward"] == "resolved"


def test_the_scorer_env_file_uses_the_sections():
    """deploy/env/scorer.env (compose and systemd): nested names only, each reaching its key."""
    env = {**read_env(ENV_DIR / "common.env"), **read_env(ENV_DIR / "scorer.env")}
    assert not {k.removeprefix("ASYNCRL_").lower() for k in env} & set(ScorerConfig.MOVED)
    cfg = load_config(ScorerConfig, None, environ=env)
    assert cfg.run.provision is False and cfg.run.metrics_port == 9500 and cfg.run.concurrency == 8
