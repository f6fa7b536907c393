"""ScorerConfig in sections (scorer/sections.py): the layout, an old flat key an unknown key naming
the nearest one (files, dicts; `asyncrl config check` and the scorer as a real process), nested env
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


def test_an_old_flat_key_is_an_unknown_key_naming_the_nearest_one(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text("[scorer]\ndefault_lambda = 0.01\n")
    with pytest.raises(
        ConfigError,
        match=r"\[scorer\] unknown key 'default_lambda'; did you mean \[scorer.reward\] default_lambda\?",
    ):
        load_config(ScorerConfig, f, section="scorer", environ={})
    with pytest.raises(
        ConfigError, match=r"\[scorer.run\] unknown key 'concurency'; did you mean 'concurrency'\?"
    ):
        load_config(ScorerConfig, None, overrides={"run": {"concurency": 4}}, environ={}, table="scorer")
    # `up` and `config check` resolve the same way before they start anything
    with pytest.raises(
        ConfigError, match=r"\[scorer\] unknown key 'cost_unit'; did you mean \[scorer.reward\] cost_unit"
    ):
        config_check.resolve({"scorer": {"cost_unit": "tokens"}}, environ={})
    cfg = tmp_path / "old.toml"
    cfg.write_text(AGREE + "[scorer]\nconcurrency = 4\n")
    r = shared.run_config_check(cfg, env=shared.clean_env())
    assert (
        r.returncode == 2 and "unknown key 'concurrency'; did you mean [scorer.run] concurrency?" in r.stderr
    ), r.stderr


def test_the_scorer_process_refuses_an_unknown_key_and_reads_nested_env(tmp_path):
    """As `python -m scorer` reads them (each fails before any broker is needed)."""
    f = tmp_path / "s.toml"
    f.write_text("concurrency = 4\n")
    r = shared.run("-m", "scorer", "--config", str(f), env=shared.clean_env())
    assert r.returncode == 2, r.stderr[-2000:]
    assert (
        "[scorer] unknown key 'concurrency'; did you mean [scorer.run] concurrency?" in r.stderr
        and "Traceback" not in r.stderr
    )
    # a nested variable reaches the process's config (a bad value, so it stops before connecting)
    r = shared.run("-m", "scorer", env=shared.clean_env(ASYNCRL_REWARD__COST_UNIT="dollars"))
    assert r.returncode == 2 and "[scorer.reward] cost_unit: Input should be" in r.stderr, r.stderr[-2000:]
    assert "(got 'dollars')" in r.stderr and "Traceback" not in r.stderr


def test_env_overrides_nest():
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


@pytest.mark.parametrize(
    "values,message",
    [
        (
            {"reward": {"cost_unit": "dollars"}},
            r"\[scorer.reward\] cost_unit: Input should be 'tokens', 'wall_s' or 'tool_calls' "
            r"\(got 'dollars'\)",
        ),
        (
            {"reward": {"episode_reward": "tests"}},
            r"\[scorer.reward\] episode_reward: Input should be 'fraction' or 'resolved' \(got 'tests'\)",
        ),
        (
            {"reward": {"default_lambda": -1}},
            r"\[scorer.reward\] default_lambda: Input should be greater than or equal to 0 \(got -1\)",
        ),
        ({"reward": {"default_lambda": "nan"}}, r"\[scorer.reward\] default_lambda: .*finite.*\(got 'nan'\)"),
        ({"reward": {"overlong_buffer": -8}}, r"\[scorer.reward\] overlong_buffer: .* \(got -8\)"),
        ({"reward": {"overlong_scale": "inf"}}, r"\[scorer.reward\] overlong_scale: .*finite.*\(got 'inf'\)"),
        (
            {"reward": {"overlong_buffer": "many"}},
            r"\[scorer.reward\] overlong_buffer: .*valid integer.*\(got 'many'\)",
        ),
        (
            {"run": {"concurrency": 0}},
            r"\[scorer.run\] concurrency: Input should be greater than or equal to 1 \(got 0\)",
        ),
        (
            {"run": {"concurrency": 0, "verify_threads": 0}},
            r"\[scorer.run\] concurrency: .*\(got 0\); \[scorer.run\] verify_threads: .*\(got 0\)",
        ),
        ({"run": {"threads": -1}}, r"\[scorer.run\] threads: .* \(got -1\)"),
        (
            {"run": {"provision": "maybe"}},
            r"\[scorer.run\] provision: Input should be a valid boolean.*\(got 'maybe'\)",
        ),
        (
            {"sandbox": {"allow_weak_sandbox": "sure"}},
            r"\[scorer.sandbox\] allow_weak_sandbox: .*boolean.*'sure'",
        ),
        (
            {"run": {"concurency": 4}},
            r"\[scorer.run\] unknown key 'concurency'; did you mean 'concurrency'\?",
        ),
        ({"reward": "tokens"}, r"\[scorer.reward\] expected a table, got 'tokens'"),
    ],
)
def test_a_bad_value_in_each_section_is_a_clear_error(values, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ScorerConfig, None, overrides=values, environ={}, table="scorer")


def test_sections_check_themselves():
    with pytest.raises(ConfigError, match=r"RewardSection: cost_unit: Input should be .*\(got 'usd'\)"):
        RewardSection(cost_unit="usd")
    with pytest.raises(
        ConfigError, match=r"RunSection: verify_threads: .*greater than or equal to 1 \(got 0\)"
    ):
        RunSection(verify_threads=0)
    # a section given as a dict (tests, overrides) is built and checked like its table
    with pytest.raises(ConfigError, match=r"\[scorer.run\] concurrency: .*equal to 1 \(got 0\)"):
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
    cfg = load_config(ScorerConfig, None, environ=env)
    assert cfg.run.provision is False and cfg.run.metrics_port == 9500 and cfg.run.concurrency == 8
