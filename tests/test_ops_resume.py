"""`asyncrl up --resume RUN_DIR`: a run stopped with Ctrl-C goes on in the same run dir (its
store, checkpoints, config): versions continue without a gap and no rollout is trained twice
across both parts (trainer.jsonl, the books)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

from asyncrl.report import read_jsonl
from bench.up_driver import ROOT, kill_run, start_up, trainer_version, wait_for
from tests.helpers.up import SUPERVISE


def steps_of(run_dir) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics" / "trainer.jsonl") if "samples" in r]


async def test_resume_continues_versions_and_trains_nothing_twice(tmp_path):
    proc, run_dir = start_up(tmp_path, SUPERVISE, steps=500, minutes=5)
    out = tmp_path / "up.out"
    try:
        await wait_for(lambda: trainer_version(run_dir) >= 2, 240, "version 2", proc, out)
        os.killpg(proc.pid, signal.SIGINT)
        assert await asyncio.to_thread(proc.wait, 90) == 0, out.read_text()[-3000:]
        first = steps_of(run_dir)
        v1 = max(r["version"] for r in first)
        assert json.loads((run_dir / "summary.json").read_text())["stopped"].startswith(
            "interrupted by SIGINT"
        )
        # the resumed part: no --config (the run's own), the limit is the total number of versions
        p = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "asyncrl.cli",
                "up",
                "--resume",
                str(run_dir),
                "--steps",
                str(v1 + 3),
                "--minutes",
                "4",
                "--quiet",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=400,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        summary = json.loads(p.stdout.strip().splitlines()[-1])
        assert summary["stopped"].startswith("reached"), summary
    finally:
        kill_run(run_dir)
    rows = steps_of(run_dir)
    versions = [r["version"] for r in rows]
    assert versions == list(range(versions[0], versions[-1] + 1)), versions  # no gap, none twice
    assert versions[-1] >= v1 + 3 and len(rows) > len(first)
    ids = [i for r in rows for i in r["rollout_ids"]]
    assert ids and len(ids) == len(set(ids)), "a rollout was consumed twice"
    trained = [i for r in rows for i in r["trained_ids"]]
    assert len(trained) == len(set(trained))
    resumed = "\n".join(
        (run_dir / "logs" / f).read_text() for f in os.listdir(run_dir / "logs") if f.startswith("trainer")
    )
    assert '"resumed from checkpoint"' in resumed


def test_resume_refuses_what_it_cannot_continue(tmp_path):
    def up(*args):
        return subprocess.run(
            [sys.executable, "-m", "asyncrl.cli", "up", *args, "--quiet"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    p = up("--resume", str(tmp_path))
    assert p.returncode == 2 and "not an `asyncrl up` run directory" in p.stderr, p.stderr
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "run.json").write_text(json.dumps({"steps": 3, "trainer": {}}))
    p = up("--resume", str(tmp_path))
    assert p.returncode == 2 and "no JetStream store" in p.stderr, p.stderr
    cfg = tmp_path / "up.toml"
    cfg.write_text("[up]\n")
    p = up("--resume", str(tmp_path), "--config", str(cfg))
    assert p.returncode == 2 and "leave out --config" in p.stderr, p.stderr
