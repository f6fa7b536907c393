"""`asyncrl up`'s Prometheus ports: one per process from `[up] metrics_port` (the trainer's; 0 = off).

    plan(run_dir, base)                       once, before spawning
    conf = assign(run_dir, name, component, conf)   per process: sets its metrics_port (asyncrl.child_conf)

Every process of a run shares one host, so each gets base, base+1, ... in spawn order; the plan
is kept in runs/<id>/config/metrics_ports.json and the targets in Prometheus' file_sd format in
runs/<id>/config/prometheus_targets.json (point `file_sd_configs` at it: deploy/prometheus).
A `metrics_port` set in a process's own table wins over the plan.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl import child_conf

PLAN = "metrics_ports.json"
TARGETS = "prometheus_targets.json"


def plan(run_dir: Path, base: int) -> None:
    base = int(base or 0)
    if not 0 <= base < 65536:
        raise ValueError(f"[up] metrics_port must be in [0, 65535], got {base}")
    (Path(run_dir) / "config" / PLAN).write_text(json.dumps({"base": base, "assigned": {}}))
    (Path(run_dir) / "config" / TARGETS).write_text("[]")


def assign(run_dir: Path, name: str, component: str, conf: dict) -> dict:
    path = Path(run_dir) / "config" / PLAN
    if not path.is_file():
        return conf
    p = json.loads(path.read_text())
    port = int(child_conf.get(component, conf, "metrics_port") or 0)
    if not port and p["base"]:
        taken = {a["port"] for a in p["assigned"].values()}
        port = p["assigned"].get(name, {}).get("port") or next(
            q for q in range(p["base"], p["base"] + 10_000) if q not in taken
        )
    if not port:
        return conf
    p["assigned"][name] = {"port": port, "component": component}
    path.write_text(json.dumps(p))
    targets = [
        {"targets": [f"127.0.0.1:{a['port']}"], "labels": {"job": a["component"], "process": n}}
        for n, a in sorted(p["assigned"].items())
    ]
    (Path(run_dir) / "config" / TARGETS).write_text(json.dumps(targets, indent=1))
    return child_conf.with_keys(component, conf, metrics_port=port)
