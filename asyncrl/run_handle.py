"""Runs from Python (a notebook, a script): `asyncrl.up(config)` starts `asyncrl up` as its own
process group and returns a `Run`; `asyncrl.load_run(dir)` opens a run that exists (finished, or
live under another process). A `Run` reads what the run writes: metrics, evals, summary, plots.

    import asyncrl
    run = asyncrl.up("deploy/demo.toml", steps=20)            # blocks; wait=False returns at once
    run.evals()[-1]["eval_success"], run.summary["versions"]
    asyncrl.load_run("runs/latest").metrics()[-1]

The run is the same as on the command line (same processes, same run dir layout): nothing here
trains in the caller's process, so a notebook kernel stays responsive and a crash stays out of it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.report import read_trainer_metrics


@dataclass
class Run:
    dir: Path
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def summary(self) -> dict | None:
        """summary.json, written when the run ended (None while it runs)."""
        p = self.dir / "summary.json"
        return json.loads(p.read_text()) if p.exists() else None

    @property
    def config(self) -> dict:
        """The run config as given (run.json's `source`): every section, no secrets."""
        return json.loads((self.dir / "config" / "run.json").read_text())["source"]

    def metrics(self) -> list[dict]:
        """The trainer's rows (one per version, and the eval rows), `t` = seconds since the first."""
        return read_trainer_metrics(self.dir)

    def evals(self) -> list[dict]:
        """Held-out evals, by version."""
        rows = [r for r in self.metrics() if r.get("eval_success") is not None]
        return sorted(rows, key=lambda r: r.get("version", 0))

    @property
    def version(self) -> int:
        """The newest policy version the trainer recorded (0 before the first)."""
        steps = [r["version"] for r in self.metrics() if "samples" in r]
        return steps[-1] if steps else 0

    def plots(self) -> list[Path]:
        return sorted((self.dir / "plots").glob("*.png"))

    def wait(self, timeout: float | None = None) -> dict | None:
        """Block until the run ends (or `timeout` s); its summary."""
        if self.process is not None:
            self.process.wait(timeout)
        return self.summary

    def stop(self, timeout: float = 120.0) -> dict | None:
        """Stop as a SIGTERM to `up` does (children drain, summary written), then the summary."""
        if self.running:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.summary


def load_run(run_dir: str | os.PathLike) -> Run:
    """A run directory written by `asyncrl up` (runs/<id>, or runs/latest)."""
    d = Path(run_dir).resolve()
    if not (d / "config" / "run.json").is_file() and not (d / "metrics").is_dir():
        raise FileNotFoundError(f"{run_dir} is not an asyncrl run directory (no config/run.json)")
    return Run(d)


def up(
    config: str | os.PathLike | dict,
    *,
    steps: int | None = None,
    minutes: float | None = None,
    run_dir: str | os.PathLike | None = None,
    wait: bool = True,
    extra_args: list[str] | None = None,
    start_timeout: float = 120.0,
) -> Run:
    """Start `asyncrl up` on a config file (or a dict of the same sections). With wait=False it
    returns once the run directory exists; its console output goes to <run>/logs/up.out."""
    if isinstance(config, dict):
        from asyncrl.supervisor import write_toml

        fd, name = tempfile.mkstemp(prefix="asyncrl-run-", suffix=".toml")
        os.close(fd)
        write_toml(Path(name), config)
        config = name
    run_dir = Path(run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    cmd = [sys.executable, "-m", "asyncrl.cli", "up", "--config", str(config), "--run-dir", str(run_dir)]
    cmd += ["--quiet"] + (["--steps", str(steps)] if steps else [])
    cmd += (["--minutes", str(minutes)] if minutes else []) + list(extra_args or [])
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    with open(run_dir / "logs" / "up.out", "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    run = Run(run_dir, proc)
    if wait:
        run.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"asyncrl up exited {proc.returncode}: see {run_dir / 'logs' / 'up.out'}")
        return run
    t0 = time.monotonic()
    while not (run_dir / "config" / "run.json").exists():
        if proc.poll() is not None:
            raise RuntimeError(f"asyncrl up exited {proc.returncode}: see {run_dir / 'logs' / 'up.out'}")
        if time.monotonic() - t0 > start_timeout:
            run.stop()
            raise TimeoutError(f"asyncrl up did not start within {start_timeout} s")
        time.sleep(0.2)
    return run
