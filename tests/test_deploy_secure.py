"""deploy/ secure by default, checked for real:

placeholders    deploy/nats/check-secrets.sh, run as compose's entrypoint and systemd's
                ExecStartPre run it, refuses CHANGE-ME-*, empty secrets and a leaf URL with
                credentials, and the server it fronts never starts
ports           compose publishes monitoring, Prometheus and Grafana on 127.0.0.1 unless
                ASYNCRL_BIND says otherwise (docker-compose config)
TLS             single-tls.conf / region-tls.conf with certificates from a test CA: clients
                over tls:// with CA/cert/key from BusConfig, a region's leaf over TLS; no
                client certificate, a foreign CA or plain text is refused
leaf login      the leaf URL carries no password: the region's nkey, and a wrong one is refused
signing key     `asyncrl keygen --owner 10001` / `deploy init --key-owner`: the container's
                user (uid 10001) can read the 0600 key; the host user's key it cannot
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from asyncrl.nats_server import find_binary
from bench.chaoskit.nats_configs import (
    ConfServer,
    free_port,
    get_json,
    render_nats_configs,
    role_bus_config,
    role_env_vars,
    role_passwords,
    wait_until,
)
from bus import BusConfig
from bus import topology as topo
from bus.client import ConnectError, connect
from kernel import ConfigError
from tests.helpers.deploy import DEPLOY, ENV_DIR, ROOT, SHIPPED_ENV, compose_cmd, needs_compose, read_env
from tests.helpers.tls import TestCA

CHECK = DEPLOY / "nats" / "check-secrets.sh"
NATS_UNITS = ("asyncrl-nats.service", "asyncrl-nats-region.service")


def run_check(env: dict[str, str], *cmd: str) -> subprocess.CompletedProcess:
    """check-secrets.sh as systemd / compose run it: only the env file's variables (plus PATH)."""
    return subprocess.run(
        ["/bin/sh", str(CHECK), *cmd],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- placeholders -------------------------------------------------------------------------------
def test_placeholder_secrets_stop_the_server_before_it_starts(tmp_path):
    shipped = read_env(SHIPPED_ENV / "nats.env")
    marker = tmp_path / "server-started"
    r = run_check(shipped, "/bin/sh", "-c", f"touch {marker}")
    assert r.returncode == 78 and not marker.exists(), r.stderr
    for var in ("ASYNCRL_NATS_ADMIN_PASSWORD", "ASYNCRL_NATS_SYS_PASSWORD", "ASYNCRL_NATS_REGION_NKEY"):
        assert f"{var} is still a CHANGE-ME placeholder" in r.stderr
    assert "refusing to start" in r.stderr

    # the real server behind the wrapper, as compose's entrypoint runs it: never up with a placeholder
    conf = render_nats_configs(tmp_path / "conf", {"/var/lib/nats": str(tmp_path / "js")})
    server = (find_binary(), "-c", str(conf / "single.conf"), "-t")
    r = run_check(shipped, *server)
    assert r.returncode == 78 and "is valid" not in r.stdout + r.stderr
    # initialised (asyncrl deploy init): the check passes and execs the server (-t: parse and exit)
    r = run_check(read_env(ENV_DIR / "nats.env"), *server)
    assert r.returncode == 0 and "is valid" in r.stdout + r.stderr, r.stdout + r.stderr
    assert run_check(read_env(ENV_DIR / "nats.env")).returncode == 0  # systemd: check only

    # one placeholder left anywhere (any case), an empty secret, a password in the leaf URL
    good = read_env(ENV_DIR / "nats-region.env")
    assert run_check(good).returncode == 0
    for bad, said in (
        ({"ASYNCRL_NATS_WORKER_PASSWORD": "change-me-worker"}, "ASYNCRL_NATS_WORKER_PASSWORD"),
        ({"ASYNCRL_NATS_ADMIN_PASSWORD": ""}, "ASYNCRL_NATS_ADMIN_PASSWORD is empty"),
        ({"ASYNCRL_NATS_REGION_SEED": ""}, "ASYNCRL_NATS_REGION_SEED is empty"),
        ({"ASYNCRL_NATS_HUB_LEAF_URL": "nats-leaf://region:s3cret@hub:7422"}, "carries credentials"),
    ):
        r = run_check({**good, **bad}, "/bin/sh", "-c", f"touch {marker}")
        assert r.returncode == 78 and said in r.stderr and not marker.exists(), (bad, r.stderr)
        assert "s3cret" not in r.stderr  # names, never values


needs_systemd = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="no systemd-analyze: apt-get install systemd"
)


@needs_systemd
def test_systemd_nats_units_check_secrets_before_the_server(tmp_path):
    """ExecStartPre runs check-secrets.sh (a failing ExecStartPre stops the start), before ExecStart;
    the units verify with systemd-analyze against a scratch root holding the real script."""
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    sysdir = root / "etc/systemd/system"
    sysdir.mkdir(parents=True)
    for name in NATS_UNITS:
        text = (DEPLOY / "systemd" / name).read_text()
        lines = text.splitlines()
        pre = lines.index("ExecStartPre=/bin/sh /etc/asyncrl/nats/check-secrets.sh")
        assert pre < next(i for i, x in enumerate(lines) if x.startswith("ExecStart=")), name
        shutil.copy(DEPLOY / "systemd" / name, sysdir / name)
        for m in re.finditer(r"^Exec\w+=[-@:+!]*(/\S+)", text, re.M):
            exe = root / m.group(1).lstrip("/")
            exe.parent.mkdir(parents=True, exist_ok=True)
            if not exe.exists():
                exe.write_text("#!/bin/sh\n")
                exe.chmod(0o755)
    (root / "etc/asyncrl/nats").mkdir(parents=True, exist_ok=True)
    shutil.copy(CHECK, root / "etc/asyncrl/nats/check-secrets.sh")
    r = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", *NATS_UNITS],
        cwd=sysdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
    # the validator does fail on a broken ExecStartPre (so its pass means something)
    (sysdir / NATS_UNITS[0]).write_text(
        (DEPLOY / "systemd" / NATS_UNITS[0])
        .read_text()
        .replace("ExecStartPre=/bin/sh", "ExecStartPre=bin/sh")
    )
    r = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", NATS_UNITS[0]],
        cwd=sysdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "bad unit file setting" in r.stdout + r.stderr, r.stdout + r.stderr


# -- compose --------------------------------------------------------------------------------------
def _compose(env_extra: dict[str, str] | None = None) -> dict:
    args = compose_cmd() + [
        "-f",
        str(DEPLOY / "docker-compose.yml"),
        "--profile",
        "monitoring",
        "--profile",
        "region",
        "config",
    ]
    env = {k: v for k, v in os.environ.items() if k != "ASYNCRL_BIND"} | (env_extra or {})
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)["services"]


def _bound(service: dict) -> dict[int, str]:
    """container port -> host address it is published on ("" = every interface)."""
    out = {}
    for p in service.get("ports", []):
        if isinstance(p, dict):
            out[int(p["target"])] = p.get("host_ip", "")
        else:
            parts = str(p).split("/")[0].split(":")
            out[int(parts[-1])] = parts[0] if len(parts) == 3 else ""
    return out


@needs_compose
def test_compose_binds_monitoring_locally_and_checks_secrets_first():
    svc = _compose()
    assert _bound(svc["nats"])[8222] == "127.0.0.1"
    assert _bound(svc["prometheus"]) == {9090: "127.0.0.1"} and _bound(svc["grafana"]) == {3000: "127.0.0.1"}
    assert _bound(svc["nats"])[4222] in ("", "0.0.0.0")  # clients and leaves: reachable (use TLS)
    for name in ("nats", "nats-region"):
        assert svc[name]["entrypoint"] == ["/bin/sh", "/etc/nats/asyncrl/check-secrets.sh", "nats-server"], (
            name
        )
    assert svc["grafana"]["entrypoint"][:2] == ["/bin/sh", "/etc/asyncrl/check-secrets.sh"]
    assert any(
        str(v).endswith("/nats/check-secrets.sh:/etc/asyncrl/check-secrets.sh:ro")
        for v in svc["grafana"]["volumes"]
    )
    opened = _compose({"ASYNCRL_BIND": "0.0.0.0"})  # the operator's opt-out
    assert _bound(opened["nats"])[8222] == _bound(opened["prometheus"])[9090] == "0.0.0.0"


# -- TLS and the leaf's nkey ----------------------------------------------------------------------
def _tls_confs(tmp_path: Path, leaf_port: int, ca_dir: Path) -> tuple[Path, Path]:
    hub = render_nats_configs(
        tmp_path / "hubconf",
        {
            "0.0.0.0:7422": f"127.0.0.1:{leaf_port}",
            "/var/lib/nats": str(tmp_path / "hub"),
            "/etc/nats/tls": str(ca_dir),
        },
    )
    region = render_nats_configs(
        tmp_path / "euconf", {"/var/lib/nats": str(tmp_path / "eu"), "/etc/nats/tls": str(ca_dir)}
    )
    return hub, region


async def _refused(cfg, what: str) -> str:
    with pytest.raises(ConnectError) as e:
        b = await connect(cfg)
        await b.close()
    return str(e.value)


async def test_tls_clients_and_leaf_with_certificates_from_a_test_ca(tmp_path):
    ca = TestCA(tmp_path / "tls")
    ca.issue("server", ["127.0.0.1", "localhost"])
    ca.issue("leaf")
    client_cert, client_key = ca.issue("client")
    foreign = TestCA(tmp_path / "foreign")
    foreign_cert, foreign_key = foreign.issue("client")
    passwords = role_passwords()
    leaf_port = free_port()
    hub_conf, region_conf = _tls_confs(tmp_path, leaf_port, ca.folder)
    hub = ConfServer(hub_conf / "single-tls.conf", role_env_vars(passwords), tmp_path / "hub.log")
    region = ConfServer(
        region_conf / "region-tls.conf",
        {
            **role_env_vars(passwords),
            "ASYNCRL_REGION": "eu",
            "ASYNCRL_NATS_HUB_LEAF_URL": f"tls://127.0.0.1:{leaf_port}",
        },
        tmp_path / "eu.log",
    )
    tls = dict(tls_ca=str(ca.cert_file), tls_cert=str(client_cert), tls_key=str(client_key))
    quick = dict(connect_attempts=1, connect_timeout_s=2.0)
    buses = []
    try:
        hub.start("/healthz?js-enabled-only=true")
        region.start("/healthz?js-enabled-only=true")
        await asyncio.to_thread(region.wait_leaf_connected)  # the leaf link, over TLS
        leafz = get_json(f"{hub.monitor_url}/leafz")["leafs"][0]
        assert leafz["account"] == "RL"  # the hub's `region` nkey user
        hub_url, region_url = hub.url.replace("nats://", "tls://"), region.url.replace("nats://", "tls://")
        trainer = await connect(role_bus_config(hub_url, "trainer", passwords, **tls))
        buses.append(trainer)
        await trainer.provision()
        await trainer.kv_put(topo.KEY_VERSION, b"11")
        assert trainer.nc.connected_url.scheme == "tls"
        worker = await connect(
            role_bus_config(region_url, "worker", passwords, js_domain=topo.HUB_DOMAIN, **tls)
        )
        buses.append(worker)
        assert await worker.kv_get(topo.KEY_VERSION) == b"11"  # client TLS + leaf TLS, end to end

        no_cert = await _refused(
            role_bus_config(hub_url, "trainer", passwords, tls_ca=str(ca.cert_file), **quick),
            "no client certificate",
        )
        assert "TLS" in no_cert or "tls" in no_cert.lower(), no_cert
        await _refused(
            role_bus_config(
                hub_url,
                "trainer",
                passwords,
                tls_ca=str(ca.cert_file),
                tls_cert=str(foreign_cert),
                tls_key=str(foreign_key),
                **quick,
            ),
            "foreign CA",
        )
        await _refused(role_bus_config(hub.url, "trainer", passwords, **quick), "plain text")
        wrong_ca = await _refused(
            role_bus_config(
                hub_url,
                "trainer",
                passwords,
                tls_ca=str(foreign.cert_file),
                tls_cert=str(client_cert),
                tls_key=str(client_key),
                **quick,
            ),
            "server cert from another CA",
        )
        assert "certificate" in wrong_ca.lower() or "tls" in wrong_ca.lower(), wrong_ca
        with pytest.raises(ConfigError, match="tls_cert"):  # half a client certificate
            BusConfig(tls_key=str(client_key))
    finally:
        for b in buses:
            await b.close()
        region.stop()
        hub.stop()


async def test_leaf_logs_in_with_its_nkey_and_a_wrong_seed_is_refused(tmp_path):
    """leaf.conf against single.conf: the URL has no password; the region's nkey seed gets the link
    up, another seed does not (the hub answers Authorization Violation)."""
    passwords = role_passwords()
    leaf_port = free_port()
    conf = render_nats_configs(
        tmp_path / "conf", {"0.0.0.0:7422": f"127.0.0.1:{leaf_port}", "/var/lib/nats": str(tmp_path / "hub")}
    )
    hub = ConfServer(conf / "single.conf", role_env_vars(passwords), tmp_path / "hub.log")
    url = {"ASYNCRL_NATS_HUB_LEAF_URL": f"nats-leaf://127.0.0.1:{leaf_port}"}
    good = ConfServer(conf / "leaf.conf", {**role_env_vars(passwords), **url}, tmp_path / "good.log")
    other = role_env_vars({**passwords, "region": "not-the-region"})["ASYNCRL_NATS_REGION_SEED"]
    bad = ConfServer(
        conf / "leaf.conf",
        {**role_env_vars(passwords), **url, "ASYNCRL_NATS_REGION_SEED": other},
        tmp_path / "bad.log",
    )
    try:
        hub.start()
        bad.start()
        refused = lambda: "Authorization Violation" in (tmp_path / "bad.log").read_text()  # noqa: E731
        await asyncio.to_thread(wait_until, refused, 20, "the hub refusing the wrong nkey")
        assert get_json(f"{hub.monitor_url}/leafz").get("leafnodes", 0) == 0
        bad.stop()
        good.start()
        await asyncio.to_thread(good.wait_leaf_connected)
        assert get_json(f"{hub.monitor_url}/leafz")["leafnodes"] == 1
    finally:
        for s in (good, bad, hub):
            s.stop()


# -- the trainer's signing key in the container -------------------------------------------------
READ_AS = """
import os, sys
os.setgroups([]); os.setgid(10001); os.setuid(10001)     # the container's user (Dockerfile: uid 10001)
try:
    key = open(sys.argv[1]).read().strip()
except PermissionError:
    sys.exit(3)
assert len(bytes.fromhex(key)) == 32, "not the hex key keygen writes"
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: reads the key as uid 10001 (the container's user)")
def test_signing_key_readable_by_the_container_user_only_when_given_to_it():
    from asyncrl import deploy, keygen

    tmp_path = Path(tempfile.mkdtemp(prefix="asyncrl-keys-"))  # pytest's tmp is root-only (0700)
    tmp_path.chmod(0o755)

    def read_as_10001(key: Path) -> int:
        r = subprocess.run(
            [sys.executable, "-I", "-S", "-c", READ_AS, str(key)], capture_output=True, text=True, timeout=60
        )
        assert r.returncode in (0, 3), r.stderr[-2000:]
        return r.returncode

    try:
        _check_key_owner(tmp_path, read_as_10001, deploy, keygen)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _check_key_owner(tmp_path: Path, read_as_10001, deploy, keygen) -> None:

    host_key, _ = keygen.write_keypair(tmp_path / "host")  # what `asyncrl keygen` did before
    assert read_as_10001(host_key) == 3  # the compose trainer could not read it
    assert keygen.main(["--out", str(tmp_path / "keys"), "--owner", "10001"]) == 0
    key = tmp_path / "keys" / "trainer-signing.key"
    st = key.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (10001, 10001, 0o600)
    assert read_as_10001(key) == 0
    # deploy init: a fresh tree, and an existing key handed over on a second run
    shutil.copytree(SHIPPED_ENV, tmp_path / "d" / "env")
    assert deploy.main(["init", "--dir", str(tmp_path / "d" / "env")]) == 0
    kept = tmp_path / "d" / "keys" / "trainer-signing.key"
    assert read_as_10001(kept) == 3
    assert deploy.main(["init", "--dir", str(tmp_path / "d" / "env"), "--key-owner", "10001:10001"]) == 0
    assert kept.stat().st_uid == 10001 and read_as_10001(kept) == 0
    assert keygen.main(["--out", str(tmp_path / "x"), "--owner", "ten"]) == 2  # a clear refusal
