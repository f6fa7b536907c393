"""`asyncrl keygen [--out DIR] [--name NAME] [--owner UID[:GID]]`: an ed25519 pair for signing weights.

    DIR/NAME.key   private key, hex, mode 0600 (trainer: [trainer.publish] signing_key,
                   env ASYNCRL_PUBLISH__SIGNING_KEY)
    DIR/NAME.pub   public key, hex (workers: [worker.weights] public_key, env
                   ASYNCRL_WEIGHTS__PUBLIC_KEY; several keys, one per line, are all accepted: the
                   rotation window, docs/operations.md)
An existing private key is never overwritten. --owner hands the private key (still 0600) to the
user that runs the trainer: the compose trainer runs as uid 10001 and cannot read a key the host
user owns (`sudo asyncrl keygen --owner 10001`, or `asyncrl deploy init --key-owner 10001`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from delta_codec import signing
from kernel.cli import Command, run


def parse_owner(spec: str) -> tuple[int, int]:
    """ "UID" or "UID:GID" (numbers: the container's user need not exist on the host)."""
    uid, _, gid = spec.partition(":")
    try:
        return int(uid), int(gid or uid)
    except ValueError:
        raise ValueError(f"--owner {spec!r}: expected UID or UID:GID (numbers, e.g. 10001)") from None


def give_key(key: Path, owner: tuple[int, int]) -> None:
    """chown the private key to `owner` (mode stays 0600). Needs root unless it is ours already."""
    try:
        os.chown(key, *owner)
    except PermissionError:
        raise PermissionError(
            f"cannot give {key} to uid {owner[0]}: run as root (sudo) or "
            f"`sudo chown {owner[0]}:{owner[1]} {key}`"
        ) from None
    os.chmod(key, 0o600)


def write_keypair(
    out: Path, name: str = "trainer-signing", owner: tuple[int, int] | None = None
) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    key, pub = out / f"{name}.key", out / f"{name}.pub"
    if key.exists():
        raise FileExistsError(f"{key} exists; refusing to overwrite a signing key (rotate with a new --name)")
    sk, pk = signing.generate_keypair()
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never world-readable, not even briefly
    with os.fdopen(fd, "w") as f:
        f.write(sk.hex() + "\n")
    pub.write_text(pk.hex() + "\n")
    if owner is not None:
        give_key(key, owner)
    return key, pub


@click.command("keygen", cls=Command, help=__doc__)
@click.option("--out", default="keys", help="directory (default: ./keys)")
@click.option("--name", default="trainer-signing", help="file name stem")
@click.option(
    "--owner",
    default=None,
    metavar="UID[:GID]",
    help="owner of the private key (the trainer's user; compose: 10001)",
)
def cli(out: str, name: str, owner: str | None) -> int:
    try:
        key, pub = write_keypair(Path(out), name, parse_owner(owner) if owner else None)
    except (FileExistsError, PermissionError, ValueError) as e:
        print(f"asyncrl keygen: {e}", file=sys.stderr)
        return 2
    print(f"private key: {key} (0600)\npublic key:  {pub}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(cli, argv, "asyncrl keygen")


if __name__ == "__main__":
    sys.exit(main())
