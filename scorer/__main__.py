"""`python -m scorer [--config FILE]` / `asyncrl scorer`: score rollouts into SCORED."""
from __future__ import annotations

import argparse
import asyncio
import sys

from bus import load_config, setup_logging
from bus.metrics import start_metrics_server

from .service import Scorer, ScorerConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="asyncrl scorer", description=__doc__)
    ap.add_argument("--config", default=None, help="TOML file with ScorerConfig fields (env ASYNCRL_* overrides)")
    a = ap.parse_args(argv)
    cfg = load_config(ScorerConfig, a.config)
    setup_logging("scorer", component_id=cfg.scorer_id, level=cfg.log_level)
    start_metrics_server(cfg.metrics_port)
    asyncio.run(Scorer(cfg).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
