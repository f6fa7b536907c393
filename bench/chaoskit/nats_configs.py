"""Run the shipped deploy/nats server configs on one machine: role passwords into the
environment, the configs rendered with free loopback ports and private store dirs, and a
nats-server started from a rendered config (the chaos cluster scenario and the deploy tests).

    passwords = role_passwords()
    conf_dir = render_nats_configs(tmp_path / "conf", cluster_replacements(tmp_path))
    srv = ConfServer(conf_dir / "cluster-a.conf", role_env_vars(passwords), tmp_path / "a.log").start()
    bus = await connect(BusConfig(servers=[srv.url], user="trainer", password=passwords["trainer"]))
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import secrets
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from asyncrl.nats_server import find_binary
from bus import BusConfig

ROOT = Path(__file__).resolve().parents[2]
NATS_DIR = ROOT / "deploy" / "nats"
ROLES = ("admin", "trainer", "worker", "scorer", "observer", "region", "sys")


def role_passwords() -> dict[str, str]:
    """Fresh random password per role (the configs read them from the environment)."""
    return {r: secrets.token_hex(12) for r in ROLES}


def role_env_vars(passwords: Mapping[str, str]) -> dict[str, str]:
    """The servers' environment: a password per role; the region's leaf logs in with an nkey
    instead (seed for leaf.conf/region.conf, public key for the hub), derived from its entry."""
    from bus.nkeys import user_nkey

    env = {f"ASYNCRL_NATS_{r.upper()}_PASSWORD": p for r, p in passwords.items() if r != "region"}
    if "region" in passwords:
        seed, public = user_nkey(hashlib.sha256(passwords["region"].encode()).digest())
        env.update(ASYNCRL_NATS_REGION_SEED=seed, ASYNCRL_NATS_REGION_NKEY=public)
    return env


def free_port() -> int:
    """A port free now, from below the kernel's ephemeral range: a port the kernel handed out
    (bind to 0) can be taken again, before the server binds it, as the source port of any
    outgoing connection on the box (seen: a leafnode port lost that way, "address already in
    use"); a port below that range is only ever taken by an explicit bind."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free down there: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render_nats_configs(dest: Path, replace: Mapping[str, str] | None = None) -> Path:
    """Copy deploy/nats/*.conf into `dest`, replacing literal strings (ports, store dirs) in
    every file. Each key must occur somewhere, so a config change that silently defeats a
    replacement fails loudly instead of binding a fixed port."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    texts = {p.name: p.read_text() for p in NATS_DIR.glob("*.conf")}
    for old in replace or {}:
        if not any(old in t for t in texts.values()):
            raise ValueError(f"{old!r} occurs in no file of {NATS_DIR}")
    # one pass, longest key first: a replaced port is never rewritten by a shorter key
    pattern = re.compile("|".join(re.escape(k) for k in sorted(replace or {}, key=len, reverse=True)))
    for name, text in texts.items():
        if replace:
            text = pattern.sub(lambda m: replace[m.group(0)], text)
        (dest / name).write_text(text)
    return dest


def cluster_replacements(store_root: Path) -> dict[str, str]:
    """Free loopback ports for the 3-node cluster (client, monitor, route, leaf) and store dirs."""
    out = {}
    for i, n in enumerate("abc"):
        for base in (4222, 8222, 6222, 7422):
            out[f"127.0.0.1:{base + i}"] = f"127.0.0.1:{free_port()}"
        out[f"http_port: {8222 + i}"] = f"http_port: {free_port()}"
        out[f"/var/lib/nats/rl-{n}"] = str(store_root / f"rl-{n}")
    del out["127.0.0.1:8222"], out["127.0.0.1:8223"], out["127.0.0.1:8224"]  # monitor is http_port: N
    return out


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=2) as r:
        return json.loads(r.read())


def wait_until(pred, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        try:
            v = pred()
            if v:
                return v
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        time.sleep(0.1)


class ConfServer:
    """nats-server run from a rendered deploy config, as an operator runs it: store dir,
    cluster and leaf ports from the config; client and monitor ports given here (EmbeddedServer
    is for the embedded case: it always adds -js -sd, which a config with store_dir refuses).
    stop(kill=True) and start() again keep the ports, so clients reconnect (chaos tests)."""

    def __init__(self, conf: Path, env: Mapping[str, str], log: Path):
        self.conf, self.env, self.log = conf, dict(env), log
        self.port, self.monitor_port = free_port(), free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.monitor_url = f"http://127.0.0.1:{self.monitor_port}"
        self.proc: subprocess.Popen | None = None

    def start(self, health: str = "/healthz") -> ConfServer:
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(
                [
                    find_binary(),
                    "-c",
                    str(self.conf),
                    "-a",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    "-m",
                    str(self.monitor_port),
                ],
                env={**os.environ, **self.env},
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        wait_until(
            lambda: self._alive() and get_json(self.monitor_url + health),
            20,
            f"{self.conf.name} healthy (log {self.log})",
        )
        return self

    def _alive(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.conf.name} exited {self.proc.returncode}: {self.log.read_text()[-2000:]}"
            )
        return True

    def wait_leaf_connected(self, timeout: float = 20.0) -> None:
        wait_until(
            lambda: self._alive() and get_json(self.monitor_url + "/leafz").get("leafnodes", 0) >= 1,
            timeout,
            f"leaf link up (log {self.log})",
        )

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def role_bus_config(url: str | list[str], role: str, passwords: Mapping[str, str], **kw) -> BusConfig:
    return BusConfig(
        servers=[url] if isinstance(url, str) else list(url),
        name=f"{role}-test",
        user=role,
        password=passwords[role],
        **kw,
    )
