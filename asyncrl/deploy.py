"""`asyncrl deploy init [--dir deploy/env] [--keys deploy/keys]`: the secrets a deployment needs.

deploy/env/*.env ship placeholders (CHANGE-ME-<role>) that no process accepts (bus.BusConfig
refuses them). `init` replaces every one with a random password, the same value for the same
role in every file (the server's nats.env and the component's own env file must agree), makes
the files private (0600), and writes the ed25519 weight-signing pair (asyncrl.keygen) to
--keys unless one is there. Running it again changes nothing: filled files keep their values.
A region's leaf logs in with an nkey, not a password: CHANGE-ME-regionseed (nats-region.env) and
CHANGE-ME-regionnkey (the hub's nats.env) become the seed and the public key of one fresh pair.
--key-owner UID[:GID] gives the private signing key to the trainer's user (compose: 10001).
"""

from __future__ import annotations

import os
import re
import secrets
import sys
from pathlib import Path

import click

from asyncrl.keygen import give_key, parse_owner, write_keypair
from bus.nkeys import user_nkey
from kernel.cli import Group, run

PLACEHOLDER_RE = re.compile(r"CHANGE-ME-([a-z0-9]+)")


def fill_env_dir(env_dir: Path) -> dict[str, list[str]]:
    """Replace the placeholders in env_dir/*.env. -> {file name: [roles filled]}."""
    files = sorted(env_dir.glob("*.env"))
    if not files:
        raise FileNotFoundError(f"no *.env files in {env_dir}")
    texts = {f: f.read_text() for f in files}
    roles = sorted({r for t in texts.values() for r in PLACEHOLDER_RE.findall(t)})
    # hex: safe inside a nats-leaf:// URL and a nats-server config variable without quoting
    secret = {r: secrets.token_hex(24) for r in roles}
    secret["regionseed"], secret["regionnkey"] = user_nkey()  # one pair: seed to the region, key to the hub
    filled = {}
    for f, text in texts.items():
        found = PLACEHOLDER_RE.findall(text)
        if not found:
            continue
        tmp = f.with_suffix(".env.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(PLACEHOLDER_RE.sub(lambda m: secret[m.group(1)], text))
        os.replace(tmp, f)  # whole file or nothing: a crash never leaves half a file
        filled[f.name] = sorted(set(found))
    return filled


def init(env_dir: Path, keys_dir: Path, key_owner: tuple[int, int] | None = None) -> dict:
    filled = fill_env_dir(env_dir)
    key = keys_dir / "trainer-signing.key"
    if key.exists():
        keys = f"kept {key}"
        if key_owner is not None:
            give_key(key, key_owner)
    else:
        k, p = write_keypair(keys_dir, owner=key_owner)
        keys = f"wrote {k} (0600) and {p}"
    if key_owner is not None:
        keys += f"; the private key belongs to uid {key_owner[0]}"
    return {"filled": filled, "keys": keys}


@click.group("deploy", cls=Group, help=__doc__)
def cli() -> None:
    pass


@cli.command("init", short_help="random passwords into the env files, and the signing key pair")
@click.option("--dir", "env", default="deploy/env", help="env files to fill (default: deploy/env)")
@click.option("--keys", default=None, help="key pair directory (default: <dir>/../keys)")
@click.option(
    "--key-owner",
    default=None,
    metavar="UID[:GID]",
    help="owner of the private signing key: the trainer's user (compose: 10001; needs root)",
)
def init_command(env: str, keys: str | None, key_owner: str | None) -> int:
    env_dir = Path(env)
    keys_dir = Path(keys) if keys else env_dir.resolve().parent / "keys"
    try:
        res = init(env_dir, keys_dir, parse_owner(key_owner) if key_owner else None)
    except (FileNotFoundError, FileExistsError, PermissionError, ValueError) as e:
        print(f"asyncrl deploy init: {e}", file=sys.stderr)
        return 2
    for name, roles in res["filled"].items():
        print(f"{env_dir / name}: {', '.join(roles)}")
    if not res["filled"]:
        print(f"{env_dir}: no placeholders left (already initialised)")
    print(res["keys"])
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(cli, argv, "asyncrl deploy")


if __name__ == "__main__":
    sys.exit(main())
