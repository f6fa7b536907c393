"""The real processes, configured only by deploy/env/*.env (as compose and systemd run them),
against nats-server running deploy/nats/single.conf: each logs in as its own role and the
system advances policy versions without a single permission violation.

Minutes of CPU on a 2-core machine, so it runs with the long suite (make test-chaos).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.chaoskit.nats_configs import ConfServer, free_port, render_nats_configs, role_bus_config
from bus import topology as topo
from bus.weights.rules import parse_version
from tests.helpers.deploy import ENV_DIR, KEYS_DIR, read_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.chaos
@pytest.mark.timeout(900)
async def test_processes_run_under_their_roles_without_violations(tmp_path):
    server_env = read_env(ENV_DIR / "nats.env")
    conf = render_nats_configs(
        tmp_path / "conf", {"0.0.0.0:7422": f"127.0.0.1:{free_port()}", "/var/lib/nats": str(tmp_path / "js")}
    )
    hub = ConfServer(conf / "single.conf", server_env, tmp_path / "nats.log")
    hub.start("/healthz?js-enabled-only=true")
    common = read_env(ENV_DIR / "common.env")
    procs: dict[str, subprocess.Popen] = {}
    observer = None
    try:
        for comp in ("trainer", "scorer", "rollout_worker"):
            own = read_env(ENV_DIR / f"{comp}.env")
            # signing is on by default: the key files `asyncrl deploy init` wrote, not /etc/asyncrl/keys
            keys = {
                k: str(KEYS_DIR / Path(v).name)
                for k, v in own.items()
                if k in ("ASYNCRL_PUBLISH__SIGNING_KEY", "ASYNCRL_WEIGHTS__PUBLIC_KEY")
            }
            env = {
                **os.environ,
                **common,
                **own,
                **keys,
                "PYTHONPATH": ROOT,
                "OMP_NUM_THREADS": "1",
                "ASYNCRL_BUS__SERVERS": hub.url,
                "ASYNCRL_CHECKPOINT__DIR": str(tmp_path / "ckpt"),
                "ASYNCRL_RUN__DIR": str(tmp_path / "run"),
                "ASYNCRL_RUN__MAX_STEPS": "2",
                "ASYNCRL_BATCH__GROUPS": "2",
                "ASYNCRL_BATCH__GROUP_SIZE": "2",
                "ASYNCRL_ENGINE__SLOTS": "4",
            }
            with open(tmp_path / f"{comp}.log", "wb") as log:
                procs[comp] = subprocess.Popen(
                    [sys.executable, "-m", comp], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT
                )
            if comp == "trainer":
                # only the trainer may declare the topology; the others need it to exist (under
                # compose/systemd they would restart until it does)
                observer = await asyncio.wait_for(_observer(hub.url, server_env), 60)
                await asyncio.wait_for(_topology_ready(observer, procs["trainer"], tmp_path), 300)
        version, deadline = -1, time.monotonic() + 800
        while version < 2 and time.monotonic() < deadline:
            dead = {c: p.returncode for c, p in procs.items() if p.poll() is not None}
            assert not dead, f"exited: {dead}\n{_tails(tmp_path)}"
            await asyncio.sleep(2)
            try:
                version = parse_version(await observer.kv_get(topo.KEY_VERSION))
            except Exception:
                pass
        assert version >= 2, f"stuck at version {version}\n{_tails(tmp_path)}"
        violations = [
            line for line in (tmp_path / "nats.log").read_text().splitlines() if "Violation" in line
        ]  # "Publish Violation", "Subscription Violation"
        assert not violations, violations[:5]
    finally:
        if observer is not None:
            await observer.close()
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        hub.stop()


async def _observer(url: str, server_env: dict):
    from bus import connect

    cfg = role_bus_config(url, "observer", {"observer": server_env["ASYNCRL_NATS_OBSERVER_PASSWORD"]})
    return await connect(cfg)


async def _topology_ready(observer, trainer: subprocess.Popen, tmp_path) -> None:
    while True:
        assert trainer.poll() is None, f"trainer exited {trainer.returncode}\n{_tails(tmp_path)}"
        try:
            await observer.js.consumer_info(topo.SCORED, topo.TRAINER_CONSUMER)
            await observer.js.stream_info(f"OBJ_{topo.BLOB_BUCKET}")
            return
        except Exception:
            await asyncio.sleep(0.5)


def _tails(tmp_path, n: int = 1500) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}" for p in sorted(tmp_path.glob("*.log"))
    )
