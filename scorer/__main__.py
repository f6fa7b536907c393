"""`python -m scorer [--config FILE]` / `asyncrl scorer`: score rollouts into SCORED.

SIGTERM / SIGINT / SIGHUP: drain (held rollouts finish within grace_s, the rest is nak'ed); the
process is gone grace_s + a few seconds later even if the broker is unreachable."""

from __future__ import annotations

import argparse
import asyncio
import sys

from bus import load_config, setup_logging
from bus.lifetime import stop_on_signals
from bus.metrics import start_metrics_server
from envs.isolation import WeakSandbox

from .service import Scorer, ScorerConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="asyncrl scorer", description=__doc__)
    ap.add_argument(
        "--config", default=None, help="TOML file with ScorerConfig fields (env ASYNCRL_* overrides)"
    )
    a = ap.parse_args(argv)
    cfg = load_config(ScorerConfig, a.config)
    setup_logging("scorer", component_id=cfg.scorer_id, level=cfg.log_level)
    start_metrics_server(cfg.metrics_port)

    async def amain() -> None:
        stop = asyncio.Event()
        stop_on_signals(stop, cfg.grace_s, name=cfg.scorer_id)  # before connecting: see bus.lifetime
        await Scorer(cfg).run(stop, handle_signals=False)

    try:
        asyncio.run(amain())
    except WeakSandbox as e:  # one message naming the missing layers, no traceback
        print(f"scorer refuses to start: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
