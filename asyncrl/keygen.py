"""`asyncrl keygen [--out DIR] [--name NAME]`: an ed25519 pair for signing published weights.

    DIR/NAME.key   private key, hex, mode 0600 (trainer: signing_key / ASYNCRL_SIGNING_KEY)
    DIR/NAME.pub   public key, hex (workers: public_key / ASYNCRL_PUBLIC_KEY; several keys, one
                   per line, are all accepted: the rotation window, docs/operations.md)
An existing private key is never overwritten.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from delta_codec import signing


def write_keypair(out: Path, name: str = "trainer-signing") -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    key, pub = out / f"{name}.key", out / f"{name}.pub"
    if key.exists():
        raise FileExistsError(f"{key} exists; refusing to overwrite a signing key (rotate with a new --name)")
    sk, pk = signing.generate_keypair()
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)   # never world-readable, not even briefly
    with os.fdopen(fd, "w") as f:
        f.write(sk.hex() + "\n")
    pub.write_text(pk.hex() + "\n")
    return key, pub


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="asyncrl keygen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="keys", help="directory (default: ./keys)")
    ap.add_argument("--name", default="trainer-signing", help="file name stem")
    a = ap.parse_args(argv)
    try:
        key, pub = write_keypair(Path(a.out), a.name)
    except FileExistsError as e:
        print(f"asyncrl keygen: {e}", file=sys.stderr)
        return 2
    print(f"private key: {key} (0600)\npublic key:  {pub}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
