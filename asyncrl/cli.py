"""`asyncrl` console script: one entry point that dispatches to each process and tool.

    asyncrl up [--sync] [--steps N]       whole system locally (what `make demo` runs)
    asyncrl trainer | rollout-worker | scorer [--config FILE]   one process (same as python -m ...)
    asyncrl calibrate-cost [...]           measure the test-time scaling curve, set λ
    asyncrl inspect [--nats URL]           streams, consumers, KV control values, latest version
    asyncrl nats [--store DIR]             a local JetStream server in the foreground
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import sys

# subcommand -> module whose main(argv) runs it (imported lazily: each pulls in torch etc.)
COMMANDS = {
    "up": "asyncrl.up",
    "trainer": "trainer.__main__",
    "rollout-worker": "rollout_worker.__main__",
    "scorer": "scorer.__main__",
    "calibrate-cost": "scorer.calibrate",
}


def _inspect(argv: list[str]) -> int:
    from bus import BusConfig, connect
    from asyncrl.inspect import render, snapshot

    ap = argparse.ArgumentParser(prog="asyncrl inspect", description=__doc__)
    ap.add_argument("--nats", default="nats://127.0.0.1:4222", help="server URL(s), comma separated")
    ap.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    a = ap.parse_args(argv)

    async def run() -> None:
        bus = await connect(BusConfig(servers=a.nats.split(","), name="asyncrl-inspect"))
        try:
            snap = await snapshot(bus)
        finally:
            await bus.close()
        if a.json:
            import json
            print(json.dumps(snap, default=str, indent=2))
        else:
            print(render(snap))

    asyncio.run(run())
    return 0


def _nats(argv: list[str]) -> int:
    from bus.server import run_foreground

    ap = argparse.ArgumentParser(prog="asyncrl nats", description="local nats-server with JetStream")
    ap.add_argument("--store", default=None, help="store dir (default: a temporary one)")
    ap.add_argument("--config", default=None, help="nats-server config file (deploy/nats/*.conf)")
    a = ap.parse_args(argv)
    return run_foreground(a.store, config=a.config) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "inspect":
        return _inspect(rest)
    if cmd == "nats":
        return _nats(rest)
    if cmd not in COMMANDS:
        print(f"asyncrl: unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
        return 2
    mod = importlib.import_module(COMMANDS[cmd])
    return mod.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
