"""A live `asyncrl up` is readable from outside with the NATS tools a user has: `up` leaves
runs/<id>/nats.env (and runs/latest pointing at the run), exporting NATS_URL/NATS_USER/NATS_PASSWORD
for a read-only observer, the variables the `nats` CLI reads. The official JavaScript client
(@nats-io, from npm: no `nats` CLI binary ships in Debian or PyPI), configured from that file alone,
lists the streams and reads the version from KV; every write it tries is refused."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from asyncrl.model import cache_dir
from bench.up_driver import start_up, stop_run, wait_for
from bus import topology as topo
from tests.helpers.up import SUPERVISE

HERE = Path(__file__).parent
PACKAGES = ["@nats-io/transport-node@3", "@nats-io/jetstream@3", "@nats-io/kv@3"]


@pytest.fixture(scope="module")
def observer_script() -> Path:
    """The official client installed once into the cache (npm), beside the observer script."""
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.skip("node and npm are needed for the official NATS JavaScript client")
    home = cache_dir() / "nats-js"
    if not (home / "node_modules" / "@nats-io" / "kv").is_dir():
        home.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(home), *PACKAGES],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if r.returncode != 0:
            pytest.skip(f"npm could not install the NATS client (no registry?): {r.stderr[-500:]}")
    script = home / "observer.mjs"
    shutil.copyfile(HERE / "helpers" / "nats_observer.mjs", script)
    return script


def _sourced(path: Path) -> dict[str, str]:
    """What `. nats.env` exports, read by the shell itself."""
    out = subprocess.run(
        ["bash", "-c", f'set -e; . "{path}"; env -0'], capture_output=True, check=True
    ).stdout.decode()
    env = dict(kv.split("=", 1) for kv in out.split("\0") if "=" in kv)
    return {k: env[k] for k in ("NATS_URL", "NATS_USER", "NATS_PASSWORD")}


async def test_the_official_client_reads_a_live_run_from_nats_env_and_cannot_write(tmp_path, observer_script):
    proc, run_dir = start_up(tmp_path, SUPERVISE, steps=500, minutes=3)
    out = tmp_path / "up.out"
    try:
        latest = run_dir.parent / "latest"
        env_file = latest / "nats.env"
        await wait_for(
            lambda: env_file.exists() and (run_dir / "metrics" / "trainer.jsonl").exists(),
            180,
            "broker up and a version trained",
            proc,
            out,
        )
        assert latest.resolve() == run_dir.resolve()
        assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
        creds = _sourced(env_file)
        assert creds["NATS_USER"] == "observer" and creds["NATS_URL"].startswith("nats://127.0.0.1:")
        r = subprocess.run(
            [
                "node",
                str(observer_script),
                topo.CONTROL_BUCKET,
                topo.KEY_VERSION,
                topo.DELTA_SUBJECT,
                topo.TASKS,
                topo.ROLLOUT_CONSUMER,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": os.environ["PATH"], **creds},
        )
        assert r.returncode == 0, r.stderr[-2000:]
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        assert {topo.TASKS, topo.WEIGHTS, f"KV_{topo.CONTROL_BUCKET}"} <= set(seen["streams"])
        assert seen["account_streams"] == len(seen["streams"])
        assert seen["consumer"]["delivered"] > 0  # `nats consumer info TASKS rollout`
        assert seen["kv"] is not None and int(seen["kv"]) >= 0  # the run's current version
        for what, answer in seen["writes"].items():  # read-only: every write refused by the broker
            assert answer.startswith("refused"), (what, answer)
        # the run's own credentials are not what the observer got
        assert creds["NATS_PASSWORD"] not in (run_dir / "config" / "bus.env").read_text()
    finally:
        stop_run(proc, run_dir)
