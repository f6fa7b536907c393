"""Prometheus end to end: `asyncrl up` with `[up] metrics_port`, scraped by a real Prometheus
server (Debian package `prometheus`) through the run's file_sd targets, queried over its HTTP API."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from bench.up_driver import SMALL_RUN

# the shared small run (bench/up_driver.py) with one worker, no evals and shorter answers
CONFIG = (
    SMALL_RUN.replace("workers = 2", "workers = 1\nmetrics_port = {port}")
    .replace("eval_every = 3\neval_prompts = 16\n", "")
    .replace("max_tokens = 40", "max_tokens = 24")
)

PROM_CONFIG = """
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: asyncrl
    file_sd_configs:
      - files: ["{targets}"]
        refresh_interval: 1s
"""


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def consecutive_free(n: int) -> int:
    """A base port with n free ports after it (the run assigns base, base+1, ...)."""
    for _ in range(50):
        base = free_ports(1)[0]
        if base + n >= 65535:
            continue
        try:
            held = []
            for q in range(base, base + n):
                s = socket.socket()
                s.bind(("0.0.0.0", q))
                held.append(s)
            for s in held:
                s.close()
            return base
        except OSError:
            for s in held:
                s.close()
    raise RuntimeError("no free port range")


def query(prom: str, expr: str) -> list[dict]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="the `prometheus` binary is not installed (apt-get install -y prometheus; .ci/run does)",
)
def test_prometheus_scrapes_a_running_up(fresh_server, tmp_path):
    base = consecutive_free(3)
    cfg = tmp_path / "up.toml"
    cfg.write_text(CONFIG.replace("{port}", str(base)))
    run_dir = tmp_path / "run"
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "up",
            "--config",
            str(cfg),
            "--steps",  # bounded by the minutes: the test stops the run (SIGINT) once all is seen; a
            "100000",  # 40-version run once ended before Prometheus had scraped every series
            "--minutes",
            "5",
            "--nats",
            fresh_server.url,
            "--run-dir",
            str(run_dir),
            "--quiet",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    prom_port = free_ports(1)[0]
    prom_yml = tmp_path / "prometheus.yml"
    prom_yml.write_text(PROM_CONFIG.format(targets=run_dir / "config" / "prometheus_targets.json"))
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={prom_yml}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "prometheus.log", "w"),
    )
    url = f"http://127.0.0.1:{prom_port}"
    wanted = {
        # the trainer published versions; the worker applied them and generated tokens; the scorer scored
        "published": 'sum(asyncrl_versions_published_total{job="trainer",kind="delta"})',
        "applied": 'sum(asyncrl_versions_applied_total{job="rollout_worker",kind="delta"})',
        "tokens": 'sum(asyncrl_tokens_generated_total{job="rollout_worker"})',
        "scored": 'sum by (env) (asyncrl_rollouts_scored_total{job="scorer"})',
        "patched": "sum(asyncrl_publish_to_patched_seconds_count)",
        "step": "sum(asyncrl_trainer_step_seconds_count)",
        "pending": "count(asyncrl_consumer_pending_messages)",
    }
    got: dict = {}
    try:
        deadline = time.time() + 240
        while time.time() < deadline and len(got) < len(wanted):
            assert up.poll() is None, f"asyncrl up exited early:\n{up.stdout.read()[-3000:]}"
            time.sleep(2)
            for k, expr in wanted.items():
                try:
                    res = query(url, expr)
                except OSError:  # Prometheus still starting
                    break
                if res and float(res[0]["value"][1]) > 0:
                    got[k] = res
        assert set(got) == set(wanted), f"not seen in Prometheus: {sorted(set(wanted) - set(got))}"
        assert got["scored"][0]["metric"]["env"] == "arith-small"
        with urllib.request.urlopen(f"{url}/api/v1/targets", timeout=5) as r:
            targets = json.load(r)["data"]["activeTargets"]
        assert {t["labels"]["job"] for t in targets} == {"trainer", "rollout_worker", "scorer"}
        assert all(t["health"] == "up" for t in targets), [(t["labels"], t["lastError"]) for t in targets]
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
        prom.terminate()
        prom.wait(timeout=30)
