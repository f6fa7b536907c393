"""W&B tracking of `asyncrl up` in offline mode: the run written locally is read back (its
.wandb record log) and holds the trainer's and the workers'/scorers' keys at the trainer's
versions; the run id is kept in the run dir and reused (resume)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from bench.up_driver import SMALL_RUN

wandb = pytest.importorskip("wandb", reason="wandb is a dev extra (pip install -e .[dev])")

# the shared small run (bench/up_driver.py) with one worker, no evals and shorter answers
CONFIG = (
    SMALL_RUN.replace("workers = 2", 'workers = 1\nwandb_project = "asyncrl-test"\nwandb_mode = "offline"')
    .replace("eval_every = 3\neval_prompts = 16\n", "")
    .replace("max_tokens = 40", "max_tokens = 24")
)


def wandb_records(path):
    """Records of a .wandb file: LevelDB-log framing (32 KiB blocks; 7-byte chunk headers:
    crc32, length, type FULL/FIRST/MIDDLE/LAST) after a 7-byte ':W&B' header; protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, typ = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and typ == 0:
            break
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if typ in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            buf = b""
            yield r


def history(run_file):
    rows = []
    for r in wandb_records(run_file):
        if r.WhichOneof("record_type") == "history":
            rows.append(
                (
                    r.history.step.num,
                    {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item},
                )
            )
    return rows


def test_wandb_offline_run_read_back(fresh_server, tmp_path):
    cfg = tmp_path / "up.toml"
    cfg.write_text(CONFIG)
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "up",
            "--config",
            str(cfg),
            "--steps",
            "4",
            "--minutes",
            "4",
            "--nats",
            fresh_server.url,
            "--run-dir",
            str(run_dir),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    files = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1, list((run_dir / "wandb").iterdir())
    rows = history(files[0])
    keys = set().union(*(d for _s, d in rows))
    for k in (
        "trainer/reward_mean",
        "trainer/success_mean",
        "trainer/cost_mean",
        "trainer/lambda",
        "trainer/staleness_mean",
        "trainer/delta_bytes",
        "trainer/delta_ratio",
        "trainer/changed_frac",
        "trainer/total_s",
        "rollout_worker/worker-0/tokens_per_s",
        "rollout_worker/worker-0/slot_occupancy",
        "scorer/scorer-0/scored",
    ):
        assert k in keys, (k, sorted(keys))
    assert any(k.startswith("trainer/staleness_hist/") for k in keys)
    steps = [s for s, _d in rows]
    assert steps == sorted(steps)  # one x axis, only growing
    trainer_steps = {s: d["trainer/version"] for s, d in rows if "trainer/version" in d}
    assert trainer_steps and all(s == v for s, v in trainer_steps.items())  # W&B step = policy version
    assert max(trainer_steps) >= 4

    # resume: the same run dir opens the same W&B run
    from asyncrl import tracking

    os.environ["WANDB_MODE"] = "offline"
    t = tracking.open_tracker(run_dir, {"wandb_project": "asyncrl-test", "wandb_mode": "offline"})
    try:
        assert t.run.id == run_id
    finally:
        t.close()


def test_tracker_off_unless_configured(tmp_path):
    from asyncrl import tracking

    assert tracking.open_tracker(tmp_path, {}) is None
    assert not (tmp_path / "wandb_run_id").exists()
