"""Weights & Biases logging of a run, fed by the metrics events `asyncrl up` already receives.

Off unless `[up] wandb_project` is set. One W&B run per training run: its id is kept in
runs/<id>/wandb_run_id, so a resumed run (same run dir) continues the same W&B run. No network
is needed with WANDB_MODE=offline (the run is written under runs/<id>/wandb; `wandb sync` later).

Keys: `trainer/<name>` for the trainer's per-version metrics (reward_mean, success_mean,
cost_mean, lambda, staleness_mean, staleness_hist/<lag>, mismatch KL, IS weight stats,
delta_bytes/ratio, changed_frac, step time split, eval), `rollout_worker/<id>/<name>` and
`scorer/<id>/<name>` for telemetry. The W&B step is the trainer's policy version: telemetry is
logged at the latest version seen, so every chart shares one x axis and steps only grow.
"""

from __future__ import annotations

from pathlib import Path

from kernel import get_logger

log = get_logger(__name__)

RUN_ID_FILE = "wandb_run_id"
# [up] keys this module reads (asyncrl/upconfig.py declares and checks them)
UP_KEYS = {
    "wandb_project": str,
    "wandb_entity": str,
    "wandb_name": str,
    "wandb_mode": str,
    "wandb_tags": list,
}
_SKIP = {"ts", "t", "rollout_ids", "component", "beat"}


def flatten(values: dict, prefix: str) -> dict[str, float]:
    """Numeric leaves only (bools as 0/1); nested dicts become `a/b` keys."""
    out: dict[str, float] = {}
    for k, v in values.items():
        if k in _SKIP:
            continue
        key = f"{prefix}/{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key))
        elif isinstance(v, bool):
            out[key] = float(v)
        elif isinstance(v, (int, float)):
            out[key] = v
    return out


class Tracker:
    def __init__(self, run, run_dir: Path):
        self.run, self.run_dir = run, run_dir
        self.step = 0

    def log(self, component: str, cid: str, values: dict) -> None:
        if component == "trainer":
            v = values.get("version")
            if isinstance(v, int) and v > self.step:
                self.step = v
            data = flatten(values, "trainer")
        else:
            data = flatten(values, f"{component}/{cid}")
        if data:
            try:
                self.run.log(data, step=self.step)
            except Exception as e:  # the tracker must never stop a run
                log.warning("wandb log failed", error=repr(e))

    def close(self) -> None:
        self.run.finish()


def open_tracker(run_dir: Path, up: dict, run_config: dict | None = None) -> Tracker | None:
    """A Tracker when `[up] wandb_project` is set (else None); resumes the run dir's W&B run."""
    project = up.get("wandb_project")
    if not project:
        return None
    import uuid

    import wandb

    run_dir = Path(run_dir)
    id_file = run_dir / RUN_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:16]
    id_file.write_text(run_id)
    run = wandb.init(
        project=project,
        entity=up.get("wandb_entity") or None,
        name=up.get("wandb_name") or run_dir.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        mode=up.get("wandb_mode") or None,
        tags=list(up.get("wandb_tags", [])) or None,
        config=run_config or {},
    )
    log.info("wandb run", project=project, run_id=run_id, mode=up.get("wandb_mode") or "default")
    return Tracker(run, run_dir)
