"""`python -m scorer [--config FILE]` / `asyncrl scorer`: score rollouts into SCORED.

SIGTERM / SIGINT / SIGHUP: drain (held rollouts finish within [run] grace_s, the rest is nak'ed);
the process is gone grace_s + a few seconds later even if the broker is unreachable. Exit code 2
on a bad configuration (naming the table, key and value; an unknown key the nearest one:
`unknown key 'cost_unit'; did you mean [scorer.reward] cost_unit?`) and on a sandbox weaker than
promised."""

from __future__ import annotations

import asyncio
import sys

import click

from envs.isolation import WeakSandbox
from kernel import load_config, setup_logging
from kernel.cli import Command, run
from kernel.config import run_section
from kernel.lifetime import stop_on_signals
from kernel.metrics import serve_metrics

from .config import ScorerConfig
from .service import Scorer


@click.command("scorer", cls=Command, help=__doc__)
@click.option(
    "--config",
    default=None,
    help="a run TOML (its [scorer] table: deploy/*.toml, /etc/asyncrl/run.toml) or a TOML with "
    "ScorerConfig fields and [reward], [run], [sandbox] tables (env ASYNCRL_* overrides)",
)
@click.option("--section", default="scorer", help="the table of a run TOML this process reads")
def cli(config: str | None, section: str) -> int:
    try:
        cfg = load_config(ScorerConfig, config, section=run_section(config, section), table=section)
    except ValueError as e:  # ConfigError included (names its table, key and value): no traceback
        print(f"scorer: bad configuration: {e}", file=sys.stderr)
        return 2
    setup_logging("scorer", component_id=cfg.scorer_id, level=cfg.run.log_level)
    serve_metrics(cfg.run)

    async def amain() -> None:
        stop = asyncio.Event()
        stop_on_signals(stop, cfg.run.grace_s, name=cfg.scorer_id)  # before connecting: see kernel.lifetime
        await Scorer(cfg).run(stop, handle_signals=False)

    try:
        asyncio.run(amain())
    except WeakSandbox as e:  # one message naming the missing layers, no traceback
        print(f"scorer refuses to start: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(cli, argv, "asyncrl scorer")


if __name__ == "__main__":
    sys.exit(main())
