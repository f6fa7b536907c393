"""`python -m rollout_worker --config worker.toml` (or `asyncrl rollout-worker`)."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from bus import connect, load_config, setup_logging
from bus.metrics import start_metrics_server

from .worker import Worker, WorkerConfig


async def amain(cfg: WorkerConfig) -> None:
    bus = await connect(cfg.bus)
    try:
        await bus.provision()
        await Worker(cfg, bus).run()
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rollout_worker", description=__doc__)
    ap.add_argument("--config", default=None, help="TOML with WorkerConfig fields (env ASYNCRL_* overrides)")
    a = ap.parse_args(argv)
    cfg = load_config(WorkerConfig, a.config)
    json_logs = {"1": True, "0": False}.get(os.environ.get("ASYNCRL_LOG_JSON", ""), None)
    setup_logging("rollout_worker", json=json_logs, component_id=cfg.worker_id, level=cfg.log_level)
    start_metrics_server(cfg.metrics_port)
    asyncio.run(amain(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
