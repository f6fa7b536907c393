"""`asyncrl up --resume RUN_DIR`: continue a stopped run where it stopped.

Everything a run needs to go on is already in its directory: the JetStream store (runs/<id>/nats:
WEIGHTS, the undelivered TASKS and unacked SCORED messages, the KV version), the trainer's
checkpoints (its version, optimizer and the ids it consumed: nothing is trained twice) and the
W&B run id (asyncrl.tracking). So resuming is only: the same run dir and the same run config.
The config is the one the run started with (config/run.json, "source"); the limits and the
process counts it resolved then are kept unless given again on the command line (--steps is the
total number of versions, so `--steps 60` takes a 30-step run on to 60).
"""

from __future__ import annotations

import json
from pathlib import Path

from kernel.config import ConfigError

# [up] keys run.json records as resolved (flags included), reused as the resumed run's [up]
RESOLVED = ("steps", "minutes", "workers", "scorers", "sync", "lambda")


def resume_run(
    run_dir: str | Path, external_nats: bool = False, config: str | None = None
) -> tuple[Path, dict]:
    """-> (run dir, run config to start again with). ConfigError when it cannot be resumed."""
    if config:
        raise ConfigError("--resume continues with the run's own config: leave out --config")
    run_dir = Path(run_dir).resolve()
    meta_path = run_dir / "config" / "run.json"
    if not meta_path.is_file():
        raise ConfigError(f"--resume {run_dir}: not an `asyncrl up` run directory (no config/run.json)")
    meta = json.loads(meta_path.read_text())
    if not external_nats and meta.get("nats_external"):
        raise ConfigError(f"--resume {run_dir}: the run used an external server: give its --nats URL")
    if not external_nats and not (run_dir / "nats" / "jetstream").is_dir():
        raise ConfigError(
            f"--resume {run_dir}: no JetStream store in {run_dir / 'nats'}: nothing to continue"
        )
    conf = dict(meta.get("source") or {k: meta[k] for k in ("trainer", "worker", "scorer") if k in meta})
    up = dict(conf.get("up", {}))
    up.update({k: meta[k] for k in RESOLVED if meta.get(k) is not None})
    conf["up"] = up
    return run_dir, conf
