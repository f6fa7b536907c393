"""WorkerConfig in sections (rollout_worker/sections.py): the layout, an old flat key an unknown key
naming the nearest one (files, dicts; `asyncrl config check` and the worker as real processes), nested env
overrides, a bad value per section still a clear error, the resolved tree printed, and `up`'s
process-wide keys in [worker.run]."""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl import child_conf
from kernel.config import ConfigError, load_config
from rollout_worker.config import WorkerConfig
from rollout_worker.sections import AdmissionSection, EngineSection, EpisodesSection, RunSection
from tests.helpers.config_sections import (
    check_layout,
    check_shipped,
    clean_env,
    printed_tree,
    run,
    run_config_check,
)

SECTIONS = {
    "engine": {"kind", "slots", "max_len", "model", "tokenizer", "quant_sites", "quant_block", "seed"}
    | {"update_mode", "device", "gpu_memory_utilization", "tensor_parallel_size"},
    "admission": {"max_lag", "queue", "max_inflight"},
    "episodes": {"workspace", "docker_image", "sandbox_latency", "episode_wall_s", "allow_weak_sandbox"}
    | {"envs", "task_set"},
    "harness": {"kind", "config", "endpoint_host", "endpoint_port", "external_deadline_s"}
    | {"endpoint_token_file", "bounds"},
    "weights": {"public_key"},
    "run": {"threads", "heartbeat_s", "grace_s", "max_restarts", "restart_backoff_s", "metrics_port"}
    | {"metrics_host", "instance", "log_level"},
    "faults": {"weights_after"},
}


def test_the_section_layout():
    check_layout(WorkerConfig, ["bus", "worker_id"], SECTIONS)
    assert len(dataclasses.fields(WorkerConfig)) <= 15
    cfg = WorkerConfig()
    assert isinstance(cfg.engine, EngineSection) and isinstance(cfg.run, RunSection)
    # what two sections decide: the admission's defaults from the engine's slots
    assert (cfg.admission.queue, cfg.admission.max_inflight) == (4, 8)
    cfg = WorkerConfig(engine={"slots": 6})
    assert (cfg.admission.queue, cfg.admission.max_inflight) == (3, 6)


def test_an_old_flat_key_is_an_unknown_key_naming_the_nearest_one(tmp_path):
    f = tmp_path / "w.toml"
    f.write_text('worker_id = "w"\nslots = 4\n')
    with pytest.raises(ConfigError, match=r"unknown key 'slots'; did you mean \[engine\] slots\?"):
        load_config(WorkerConfig, f, environ={})
    with pytest.raises(
        ConfigError, match=r"\[worker\] unknown key 'harness_config'; did you mean 'harness'\?"
    ):
        load_config(WorkerConfig, None, overrides={"harness_config": "m.yaml"}, environ={}, table="worker")
    cfg = tmp_path / "old.toml"
    cfg.write_text("[up]\nworkers = 1\n[trainer.batch]\nmax_lag = 4\n[worker]\nheartbeat_s = 1.0\n")
    r = run_config_check(cfg)
    assert (
        r.returncode == 2
        and "[worker] unknown key 'heartbeat_s'; did you mean [worker.run] heartbeat_s?" in r.stderr
    ), r.stderr


def test_the_worker_process_refuses_an_unknown_key_and_reads_nested_env(tmp_path):
    """As `python -m rollout_worker` reads them (both fail before any broker is needed)."""
    f = tmp_path / "w.toml"
    f.write_text("max_inflight = 4\n")
    r = run("-m", "rollout_worker", "--config", str(f), env=clean_env())
    assert r.returncode == 2, r.stderr[-2000:]
    assert "unknown key 'max_inflight'; did you mean [worker.admission] max_inflight?" in r.stderr
    assert "Traceback" not in r.stderr
    # a nested variable reaches the process's config (a bad value, so it stops before connecting)
    r = run("-m", "rollout_worker", env=clean_env(ASYNCRL_ENGINE__KIND="tpu"))
    assert (
        r.returncode == 2
        and "[worker.engine] kind: Input should be 'torch' or 'vllm' (got 'tpu')" in r.stderr
    ), r.stderr[-2000:]


def test_env_overrides_nest():
    cfg = load_config(
        WorkerConfig,
        None,
        environ={
            "ASYNCRL_ENGINE__SLOTS": "16",
            "ASYNCRL_ENGINE__KIND": "vllm",
            "ASYNCRL_ADMISSION__MAX_LAG": "2",
            "ASYNCRL_WEIGHTS__PUBLIC_KEY": "/etc/asyncrl/keys/trainer-signing.pub",
            "ASYNCRL_RUN__METRICS_PORT": "9400",
            "ASYNCRL_EPISODES__SANDBOX_LATENCY__MEDIAN_S": "3",
            "ASYNCRL_EPISODES__SANDBOX_LATENCY__P99_S": "60",
            "ASYNCRL_WORKER_ID": "w7",
            "ASYNCRL_OPTIM__LR": "3e-4",  # the trainer's: ignored
            "ASYNCRL_RUN__DIR": "/x",  # the trainer's [trainer.run] dir: not a worker key, ignored
        },
    )
    assert (cfg.engine.slots, cfg.engine.kind, cfg.admission.max_lag) == (16, "vllm", 2)
    assert cfg.admission.max_inflight == 16 and cfg.run.metrics_port == 9400 and cfg.worker_id == "w7"
    assert cfg.weights.public_key == "/etc/asyncrl/keys/trainer-signing.pub"
    assert cfg.episodes.sandbox_latency.enabled and cfg.episodes.sandbox_latency.p99_s == 60.0


@pytest.mark.parametrize(
    "values,message",
    [
        (
            {"engine": {"kind": "jax"}},
            r"\[worker.engine\] kind: Input should be 'torch' or 'vllm' \(got 'jax'\)",
        ),
        ({"engine": {"slots": 0}}, r"\[worker.engine\] slots: .*greater than or equal to 1 \(got 0\)"),
        (
            {"engine": {"device": "gpu"}},
            r"\[worker.engine\] device: String should match pattern .*\(got 'gpu'\)",
        ),
        ({"engine": {"slots": "many"}}, r"\[worker.engine\] slots: .*valid integer.*\(got 'many'\)"),
        (
            {"admission": {"max_lag": -1}},
            r"\[worker.admission\] max_lag: .*greater than or equal to 0 \(got -1\)",
        ),
        (
            {"engine": {"slots": 4}, "admission": {"max_inflight": 2}},
            r"\[worker.admission\] max_inflight must be 0 or >= \[worker.engine\] slots \(4\), got 2",
        ),
        (
            {"episodes": {"workspace": "podman"}},
            r"\[worker.episodes\] workspace: .*'local' or 'docker' \(got 'podman'\)",
        ),
        ({"episodes": {"episode_wall_s": -1}}, r"\[worker.episodes\] episode_wall_s: .*\(got -1\)"),
        (
            {"episodes": {"sandbox_latency": {"median_s": 3, "p99_s": 1}}},
            r"\[worker.episodes.sandbox_latency\] sandbox latency needs",
        ),
        (
            {"harness": {"kind": "openhands"}},
            r"\[worker.harness\] kind: Input should be 'builtin', 'mini-swe-agent' or 'external' "
            r"\(got 'openhands'\)",
        ),
        ({"harness": {"endpoint_port": 70000}}, r"\[worker.harness\] endpoint_port: .*65535 \(got 70000\)"),
        (
            {"harness": {"external_deadline_s": 0}},
            r"\[worker.harness\] external_deadline_s: .*greater than 0 \(got 0\)",
        ),
        (
            {"harness": {"config": "/nonexistent.yaml"}},
            r"\[worker.harness\] config: harness config '/nonexistent.yaml' is not a file",
        ),
        ({"run": {"max_restarts": -1}}, r"\[worker.run\] max_restarts: .*\(got -1\)"),
        ({"run": {"restart_backoff_s": 0}}, r"\[worker.run\] restart_backoff_s: .*greater than 0 \(got 0\)"),
        ({"faults": {"weights_after": -2}}, r"\[worker.faults\] weights_after: .*\(got -2\)"),
        ({"engine": {"slotz": 4}}, r"\[worker.engine\] unknown key 'slotz'; did you mean 'slots'\?"),
    ],
)
def test_a_bad_value_in_each_section_is_a_clear_error(values, message):
    with pytest.raises(ConfigError, match=message):
        load_config(WorkerConfig, None, overrides=values, environ={}, table="worker")


def test_sections_check_themselves():
    with pytest.raises(ConfigError, match=r"AdmissionSection: max_lag: .*equal to 0 \(got -1\)"):
        AdmissionSection(max_lag=-1)
    with pytest.raises(ConfigError, match=r"EpisodesSection: workspace: .*'local' or 'docker' \(got 'nfs'\)"):
        EpisodesSection(workspace="nfs")
    assert EpisodesSection(sandbox_latency={"median_s": 2.0, "p99_s": 2.0}).sandbox_latency.enabled


def test_config_check_prints_the_worker_tree(tmp_path):
    cfg = tmp_path / "new.toml"
    cfg.write_text(
        "[up]\nworkers = 1\n[trainer.batch]\nmax_lag = 3\n[worker.engine]\nslots = 4\n"
        '[worker.admission]\nmax_lag = 3\n[worker.harness]\nkind = "external"\n'
    )
    r = run_config_check(cfg, env=clean_env())
    assert r.returncode == 0, r.stderr
    tree = printed_tree(r.stdout, "worker")
    assert set(tree) == {f.name for f in dataclasses.fields(WorkerConfig)}
    assert tree["engine"]["slots"] == 4 and tree["engine"]["kind"] == "torch"
    assert tree["admission"] == {"max_lag": 3, "queue": 2, "max_inflight": 4}
    assert tree["harness"]["kind"] == "external" and tree["episodes"]["sandbox_latency"]["median_s"] == 0.0


def test_up_finds_the_process_wide_keys_in_worker_run():
    conf = {"engine": {"slots": 2}, "run": {"grace_s": 3.0, "threads": 2}}
    for component in ("worker", "rollout_worker"):
        assert child_conf.get(component, conf, "grace_s") == 3.0
        out = child_conf.with_keys(component, conf, metrics_port=9401)
        assert (
            out["run"] == {"grace_s": 3.0, "threads": 2, "metrics_port": 9401}
            and out["engine"] == conf["engine"]
        )
    assert child_conf.where("worker") == "worker.run"


def test_shipped_configs_use_the_sections():
    check_shipped(WorkerConfig, "worker")
