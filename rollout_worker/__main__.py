"""`python -m rollout_worker --config run.toml` (its [worker] table; or `asyncrl rollout-worker`).

SIGTERM / SIGINT / SIGHUP: drain (held tasks finish within grace_s, the rest is nak'ed); the
process is gone grace_s + a few seconds later even if the broker is unreachable. Exit code 1
when a background task (weights feed, version watch, heartbeat) failed past its restarts, so
a supervisor replaces the process; exit code 2 on a bad configuration (naming the table, key and
value; an unknown key the nearest one: `unknown key 'slots'; did you mean [worker.engine] slots?`).
"""

from __future__ import annotations

import asyncio
import os
import sys

import click

from bus import connect
from envs import isolation
from envs.isolation import WeakSandbox
from envs.workspace import default_root, private_root
from kernel import get_logger, load_config, setup_logging
from kernel.cli import Command, run
from kernel.config import run_section
from kernel.lifetime import stop_on_signals
from kernel.metrics import serve_metrics
from policy.devices import device_env

from .config import WorkerConfig
from .worker import BackgroundFailed, Worker

log = get_logger("rollout_worker")


async def amain(cfg: WorkerConfig) -> int:
    stop = asyncio.Event()
    stop_on_signals(
        stop, cfg.run.grace_s, name=cfg.worker_id
    )  # before connecting: a dead broker must not trap us
    # the sandbox before the broker: a worker that may not run episodes must not hold tasks
    await isolation.startup_async(
        cfg.episodes.allow_weak_sandbox,
        default_root() if cfg.episodes.workspace == "local" else None,
        cfg.episodes.envs,
    )
    bus = await connect(cfg.bus)
    try:
        await bus.provision()
        await Worker(cfg, bus).run(stop, handle_signals=False)
    except BackgroundFailed as e:
        log.error("worker giving up; exiting for a supervisor to replace it", error=str(e))
        return 1
    finally:
        await bus.close()
    return 0


@click.command("rollout-worker", cls=Command, help=__doc__)
@click.option(
    "--config",
    default=None,
    help="a run TOML (its [worker] table: deploy/*.toml, /etc/asyncrl/run.toml) or a TOML with "
    "WorkerConfig fields and [engine], [admission], ... tables (env ASYNCRL_* overrides)",
)
@click.option("--section", default="worker", help="the table of a run TOML this process reads")
def cli(config: str | None, section: str) -> int:
    try:
        cfg = load_config(WorkerConfig, config, section=run_section(config, section), table=section)
    except ValueError as e:  # ConfigError included (names its table, key and value): no traceback
        print(f"rollout worker: bad configuration: {e}", file=sys.stderr)
        return 2
    json_logs = {"1": True, "0": False}.get(os.environ.get("ASYNCRL_LOG_JSON", ""), None)
    setup_logging("rollout_worker", json=json_logs, component_id=cfg.worker_id, level=cfg.run.log_level)
    if cfg.harness.token_problem():
        print(f"rollout worker: bad configuration: {cfg.harness.token_problem()}", file=sys.stderr)
        return 2
    if cfg.episodes.workspace == "local":
        try:  # this uid's own, private episodes root (a planted one decides what scoring imports)
            private_root(default_root())
        except (OSError, ValueError) as e:
            print(f"rollout worker refuses to start: {e}", file=sys.stderr)
            return 2
    serve_metrics(cfg.run)
    # where it runs ([layout]: its CUDA_VISIBLE_DEVICES; vLLM shards over tensor_parallel_size of them)
    log.info(
        "devices",
        **device_env(),
        engine=cfg.engine.kind,
        device=cfg.engine.device if cfg.engine.kind == "torch" else None,  # vLLM: its visible GPUs
        tensor_parallel_size=cfg.engine.tensor_parallel_size,
    )
    try:
        return asyncio.run(amain(cfg))
    except WeakSandbox as e:  # one message naming the missing layers, no traceback
        print(f"rollout worker refuses to start: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run(cli, argv, "rollout_worker")


if __name__ == "__main__":
    sys.exit(main())
