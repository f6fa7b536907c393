"""One run TOML for every process of a deployment (/etc/asyncrl/run.toml, compose's mounted
file): `python -m trainer|rollout_worker|scorer --config run.toml` each read their own table of
it, as `asyncrl up` hands them out; /metrics listens on loopback unless the run section opens it,
on metrics_port + instance (several instances on one host)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kernel import load_config
from kernel.config import ConfigError, run_section
from rollout_worker.config import WorkerConfig
from scorer.config import ScorerConfig
from tests.helpers import config_sections as shared
from trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[1]
RUN_TOMLS = sorted((ROOT / "deploy").glob("*.toml"))


def _load(cls, path, section):
    return load_config(cls, path, section=run_section(path, section), environ={})


@pytest.mark.parametrize("path", RUN_TOMLS, ids=lambda p: p.name)
def test_each_process_reads_its_table_of_every_shipped_run_toml(path):
    """What each process's main does with --config FILE: the file's own table, nothing else."""
    import tomllib

    from trainer.__main__ import load

    conf = tomllib.loads(path.read_text())
    w = _load(WorkerConfig, path, "worker")
    s = _load(ScorerConfig, path, "scorer")
    for key, v in conf.get("worker", {}).get("engine", {}).items():
        assert getattr(w.engine, key) == v, (path.name, key)
    for key, v in conf.get("scorer", {}).get("run", {}).items():
        assert getattr(s.run, key) == v, (path.name, key)
    with pytest.MonkeyPatch.context() as mp, shared.shipped_task_sets():  # the loader reads os.environ
        for k in [k for k in os.environ if k.startswith("ASYNCRL_") and k != "ASYNCRL_CACHE"]:
            mp.delenv(k)
        t = load(["--config", str(path)])
    for key, v in conf.get("trainer", {}).get("batch", {}).items():
        assert getattr(t.batch, key) == v, (path.name, key)


def test_run_section_tells_a_run_toml_from_a_process_file(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text("[up]\nworkers = 2\n[worker.engine]\nslots = 3\n")
    assert run_section(run, "worker") == "worker" and run_section(run, "scorer") == "scorer"
    assert _load(WorkerConfig, run, "worker").engine.slots == 3
    assert _load(ScorerConfig, run, "scorer").run.concurrency == 8  # no [scorer]: its defaults
    own = tmp_path / "worker.toml"
    own.write_text("worker_id = 'w1'\n[engine]\nslots = 5\n")
    assert run_section(own, "worker") is None
    w = _load(WorkerConfig, own, "worker")
    assert (w.worker_id, w.engine.slots) == ("w1", 5)
    assert run_section(tmp_path / "absent.toml", "worker") is None
    with pytest.raises(ConfigError, match="does not exist"):
        _load(WorkerConfig, tmp_path / "absent.toml", "worker")
    # a bad key in the process's table of a run TOML is named with its table
    run.write_text("[worker.engine]\nslotz = 3\n")
    with pytest.raises(ConfigError, match="slotz"):
        _load(WorkerConfig, run, "worker")


@pytest.mark.parametrize("module,table", [("rollout_worker", "worker"), ("scorer", "scorer")])
def test_a_process_refuses_a_bad_key_in_its_table_of_a_run_toml(tmp_path, module, table):
    """The process itself (a subprocess, as systemd starts it): exit 2, the key named, before it
    connects anywhere; the other processes' tables are not its business."""
    run = tmp_path / "run.toml"
    run.write_text(f"[up]\nworkers = 1\n[trainer.batch]\nbogus_for_trainer = 1\n[{table}.run]\nbogus = 1\n")
    r = shared.run("-m", module, "--config", str(run), env=shared.clean_env())
    assert r.returncode == 2, r.stderr
    assert "bogus" in r.stderr and "bogus_for_trainer" not in r.stderr


# -- /metrics: loopback by default, metrics_port + instance -------------------------------------
def _listen_addr(port: int) -> str | None:
    """The local address a TCP socket listens on at `port` (/proc/net/tcp), None when none."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":  # LISTEN
            return socket.inet_ntoa(bytes.fromhex(addr)[::-1])
    return None


def _free_port() -> int:
    from bench.chaoskit.nats_configs import free_port

    while True:  # instance 2: the two ports above must be free too
        p = free_port()
        if all(_listen_addr(p + i) is None for i in range(3)):
            return p


def test_metrics_listen_on_loopback_by_default():
    for cls in (TrainerConfig, WorkerConfig, ScorerConfig):
        assert cls().run.metrics_host == "127.0.0.1", cls
    with pytest.raises(ConfigError, match="instance"):
        ScorerConfig(run={"instance": -1})
    with pytest.raises(ConfigError, match="instance"):
        WorkerConfig(run={"metrics_port": 65535, "instance": 1})


@pytest.mark.parametrize("host", [None, "0.0.0.0"], ids=["default", "opened"])
def test_a_scorer_serves_metrics_on_its_instance_port_and_address(tmp_path, nats_server, host):
    """A real scorer from a run TOML with [scorer.run] metrics_port and instance = 2: /metrics on
    metrics_port + 2, listening on 127.0.0.1 unless metrics_host opens it."""
    base = _free_port()
    run = tmp_path / "run.toml"
    opened = f'metrics_host = "{host}"\n' if host else ""
    run.write_text(f"[up]\nscorers = 1\n[scorer.run]\nmetrics_port = {base}\ninstance = 2\n{opened}")
    env = shared.clean_env(ASYNCRL_BUS__SERVERS=nats_server.url, ASYNCRL_SANDBOX__ALLOW_WEAK_SANDBOX="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "scorer", "--config", str(run)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while _listen_addr(base + 2) is None:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no /metrics listener"
            time.sleep(0.2)
        assert _listen_addr(base + 2) == (host or "127.0.0.1")
        assert _listen_addr(base) is None  # the base port is instance 0's
        with urllib.request.urlopen(f"http://127.0.0.1:{base + 2}/metrics", timeout=10) as r:
            assert b"asyncrl_" in r.read()
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
