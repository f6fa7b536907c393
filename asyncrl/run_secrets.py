"""The secrets of one `asyncrl up` run, made in its run directory: secure by default.

    with_signing(conf, run_dir)   the run config with weight signing on. No key configured (neither
                                  [trainer.publish] signing_key nor [worker.weights] public_key, in the
                                  file or the ASYNCRL_* environment): an ed25519 pair in run_dir/keys (0600
                                  private key; made once, a resumed run reuses it) signs every
                                  version and every worker verifies it. A configured signing key
                                  with no public key: the workers get the key's public half.
    broker_auth(run_dir)          fresh credentials for the embedded broker (a new password each
                                  start): the server's config run_dir/config/nats-auth.conf (0600)
                                  admits only them, and the children get them in their environment
                                  (ASYNCRL_BUS__USER/PASSWORD), never on a command line or in their
                                  TOML. run_dir/config/bus.env (0600) holds them for the operator
                                  (`set -a; . runs/<id>/config/bus.env; asyncrl inspect`).
                                  A second, read-only user `observer` (stream and consumer info,
                                  message and KV reads; no publish, no create, no delete) for the
                                  NATS CLI and any other client: run_dir/nats.env (0600) exports
                                  NATS_URL/NATS_USER/NATS_PASSWORD (`. runs/latest/nats.env && nats
                                  stream ls`).
So no local user, and no sandboxed command, can publish weights to an `up` broker or make workers
load weights the run's trainer did not sign.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from asyncrl.keygen import write_keypair

RUN_KEY_NAME = "run-signing"
BROKER_USER = "asyncrl-up"
OBSERVER_USER = "observer"
# what a read-only observer may ask JetStream: account/stream/consumer info and listings, and message
# reads (KV gets are message reads of the KV_ stream); nothing that creates, changes, deletes or acks
OBSERVER_API = (
    "$JS.API.INFO",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.STREAM.INFO.>",
    "$JS.API.CONSUMER.NAMES.>",
    "$JS.API.CONSUMER.LIST.>",
    "$JS.API.CONSUMER.INFO.>",
    "$JS.API.STREAM.MSG.GET.>",
    "$JS.API.DIRECT.GET.>",
)


def _write_private(path: Path, text: str) -> None:
    """Write a secret file 0600 from the first byte (never readable by others, not even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def with_signing(conf: dict, run_dir: Path, environ=None) -> dict:
    """`conf` with [trainer.publish] signing_key and [worker.weights] public_key filled in (see the
    module doc)."""
    from asyncrl.config_check import resolve

    resolved = resolve(conf, environ)
    key, pub = resolved["trainer"].publish.signing_key, resolved["worker"].weights.public_key
    out = {**conf, "trainer": dict(conf.get("trainer", {})), "worker": dict(conf.get("worker", {}))}
    if key and pub:
        return out
    if key:  # the operator's key: the workers verify against its public half
        from cryptography.hazmat.primitives import serialization

        from trainer.keys import load_signing_key

        raw = (
            load_signing_key(key)
            .public_key()
            .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        )
        pub_path = run_dir / "keys" / "trainer-signing.pub"
        pub_path.parent.mkdir(parents=True, exist_ok=True)
        pub_path.write_text(raw.hex() + "\n")
        out["worker"]["weights"] = {**out["worker"].get("weights", {}), "public_key": str(pub_path)}
        return out
    if pub:
        return out  # a worker key with no trainer key: config_check names the disagreement
    keys = run_dir / "keys"
    key_path, pub_path = keys / f"{RUN_KEY_NAME}.key", keys / f"{RUN_KEY_NAME}.pub"
    if not key_path.exists():
        write_keypair(keys, RUN_KEY_NAME)
    out["trainer"]["publish"] = {**out["trainer"].get("publish", {}), "signing_key": str(key_path)}
    out["worker"]["weights"] = {**out["worker"].get("weights", {}), "public_key": str(pub_path)}
    return out


@dataclass
class BrokerAuth:
    user: str
    password: str
    server_conf: Path  # nats-server -c: admits only this user (and the read-only observer)
    env_file: Path  # the same, for the operator's tools
    observer_password: str = ""
    observer_file: Path | None = None  # NATS_URL/NATS_USER/NATS_PASSWORD of the observer

    def env(self) -> dict[str, str]:
        """What the children get in their environment."""
        return {"ASYNCRL_BUS__USER": self.user, "ASYNCRL_BUS__PASSWORD": self.password}

    def write_env_file(self, servers: list[str]) -> None:
        _write_private(
            self.env_file,
            f"ASYNCRL_BUS__SERVERS={','.join(servers)}\n"
            + "".join(f"{k}={v}\n" for k, v in self.env().items()),
        )
        if self.observer_file is not None:  # the variables the `nats` CLI reads, exported for `.`
            _write_private(
                self.observer_file,
                "# read-only access to this run's broker: . this file, then `nats stream ls`\n"
                f"export NATS_URL={','.join(servers)}\n"
                f"export NATS_USER={OBSERVER_USER}\n"
                f"export NATS_PASSWORD={self.observer_password}\n",
            )


ENDPOINT_TOKEN = "endpoint.token"


def endpoint_token(run_dir: Path) -> Path:
    """run_dir/config/endpoint.token (0600): the bearer token of the run's workers' OpenAI-compatible
    endpoints (made once; a resumed run keeps it). The workers read it from the file
    ([worker.harness] endpoint_token_file), a harness a worker launches gets it from its worker, and
    a user's own harness reads the file: the token is never in argv, a log or run.json."""
    path = run_dir / "config" / ENDPOINT_TOKEN
    if not path.exists():
        _write_private(path, secrets.token_urlsafe(32) + "\n")
    return path


def external_broker(servers: list[str]) -> tuple[list[str], dict[str, str]]:
    """--nats URLs with their credentials taken out, and those credentials as the children's
    environment (ASYNCRL_BUS__USER/PASSWORD or ASYNCRL_BUS__TOKEN): what run.json, the children's
    config files and the logs show carries no password. ValueError if the URLs disagree."""
    from bus.config import url_credentials

    clean, found = [], []
    for url in servers:
        u, creds = url_credentials(url)
        clean.append(u)
        if creds:
            found.append(creds)
    if any(c != found[0] for c in found):
        raise ValueError("--nats: the URLs carry different credentials; give one user for all of them")
    creds = found[0] if found else {}
    return clean, {f"ASYNCRL_BUS__{k.upper()}": v for k, v in creds.items()}


def broker_auth(run_dir: Path) -> BrokerAuth:
    password = secrets.token_hex(24)  # hex: no quoting in the server config or env files
    observer = secrets.token_hex(24)
    conf = run_dir / "config" / "nats-auth.conf"
    allow = ", ".join(f'"{s}"' for s in OBSERVER_API)
    _write_private(
        conf,
        "# asyncrl up: this run's broker admits only its own processes and a read-only observer\n"
        "# (written per start)\n"
        "authorization {\n  users = [\n"
        f'    {{ user: "{BROKER_USER}", password: "{password}" }}\n'
        f'    {{ user: "{OBSERVER_USER}", password: "{observer}",\n'
        f'      permissions: {{ publish: {{ allow: [{allow}] }}, subscribe: {{ allow: ["_INBOX.>"] }} }} }}\n'
        "  ]\n}\n",
    )
    return BrokerAuth(
        BROKER_USER, password, conf, run_dir / "config" / "bus.env", observer, run_dir / "nats.env"
    )
