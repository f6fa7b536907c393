"""A trainer process started from a written config file (python -m trainer), for tests that kill and
restart trainers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.trainer import MODEL

ROOT = Path(__file__).resolve().parents[2]
TTL = 3.0


def write_config(path: Path, url: str, tid: str, tmp: Path, ack_wait_s: float = 4.0, **extra) -> None:
    """A trainer process's config (tests/test_trainer_slow_step.py passes its own ack_wait, and
    knobs as {section: {key: value}})."""
    model = ", ".join(f"{k} = {json.dumps(v)}" for k, v in MODEL.items() if v is not None)  # TOML has no null
    more = "\n".join(
        f"[trainer.{sect}]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in keys.items())
        for sect, keys in extra.items()
    )
    path.write_text(f"""
[trainer]
trainer_id = "{tid}"
[trainer.policy]
model = {{ {model} }}
[trainer.batch]
groups = 1
group_size = 2
max_lag = 1000
fetch_timeout_s = 0.2
[trainer.tasks]
feed = false
[trainer.optim]
lr = 0.01
[trainer.checkpoint]
dir = "{tmp / "ckpt"}"
[trainer.run]
dir = "{tmp / ("run-" + tid)}"
[trainer.lease]
ttl_s = {TTL}
renew_s = 1.0
[trainer.publish]
keyframe_interval = 1000
{more}
[trainer.bus]
servers = ["{url}"]
[trainer.bus.topology]
ack_wait_s = {ack_wait_s}
""")


def start(tmp: Path, url: str, tid: str, **kw) -> subprocess.Popen:
    cfg = tmp / f"{tid}.toml"
    write_config(cfg, url, tid, tmp, **kw)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = open(tmp / f"{tid}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", "--config", str(cfg)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
