"""Acknowledged means on disk: every JetStream server asyncrl starts or ships flushes each write
before acknowledging it (`sync_interval: always`), read back from the running server's /varz
(nats-server reports `jetstream.config.sync_always: true`; without it only `sync_interval`, the
2-minute default, and an acknowledged write can be lost in a host crash: docs/reliability.md)."""

from __future__ import annotations

import re

import pytest

from asyncrl.nats_server import EmbeddedServer, ServerError
from bench.chaoskit.nats_configs import (
    NATS_DIR,
    ConfServer,
    cluster_replacements,
    free_port,
    get_json,
    render_nats_configs,
    role_env_vars,
    role_passwords,
)
from tests.helpers.tls import TestCA


def js_config(monitor_url: str) -> dict:
    return get_json(f"{monitor_url}/varz").get("jetstream", {}).get("config", {})


# -- the embedded server (tests, benchmarks, `asyncrl up`, `asyncrl nats`) ----------------------
def test_embedded_server_flushes_before_it_acknowledges(tmp_path):
    with EmbeddedServer(tmp_path / "always") as srv:
        conf = js_config(srv.monitor_url)
        assert conf["sync_always"] is True, conf
        assert conf["store_dir"].startswith(str(tmp_path / "always"))
        assert srv.jetstream_config() == conf
    # the server's own default, for comparison (bench.bus --sync default): no sync_always
    with EmbeddedServer(tmp_path / "default", sync=None) as srv:
        assert not js_config(srv.monitor_url).get("sync_always"), js_config(srv.monitor_url)
    with EmbeddedServer(tmp_path / "interval", sync="5s") as srv:
        conf = js_config(srv.monitor_url)
        assert not conf.get("sync_always") and conf["sync_interval"] == 5_000_000_000


def test_embedded_server_keeps_a_config_file_and_still_flushes(tmp_path):
    """`asyncrl up` starts it with a config file (its per-run login): the file still applies (an
    anonymous client is refused) and writes are still flushed before the ack."""
    from asyncrl.run_secrets import broker_auth

    run_dir = tmp_path / "run"
    (run_dir / "config").mkdir(parents=True)
    auth = broker_auth(run_dir)
    with EmbeddedServer(tmp_path / "store", config_file=str(auth.server_conf)) as srv:
        varz = get_json(f"{srv.monitor_url}/varz")
        assert varz["auth_required"] is True
        assert varz["jetstream"]["config"]["sync_always"] is True


def test_embedded_server_with_its_own_jetstream_block_keeps_it(tmp_path):
    """A config file with its own jetstream block (a domain, limits) is not overridden: a second
    block would replace it whole, so the file decides its sync policy itself."""
    own = tmp_path / "own.conf"
    own.write_text("server_name: lab\njetstream { domain: lab }\n")
    with EmbeddedServer(tmp_path / "lab", config_file=str(own)) as srv:
        conf = js_config(srv.monitor_url)
        assert conf.get("domain") == "lab" and not conf.get("sync_always")
    own.write_text("server_name: lab\njetstream { domain: lab, sync_interval: always }\n")
    with EmbeddedServer(tmp_path / "lab2", config_file=str(own)) as srv:
        conf = js_config(srv.monitor_url)
        assert conf.get("domain") == "lab" and conf["sync_always"] is True


def test_embedded_server_refuses_a_bad_sync_value_and_a_missing_config(tmp_path):
    with pytest.raises(ServerError, match="sync must be"):
        EmbeddedServer(tmp_path / "s", sync="sometimes").start_sync()
    with pytest.raises(ServerError, match="missing.conf"):
        EmbeddedServer(tmp_path / "m", config_file=str(tmp_path / "missing.conf")).start_sync()


# -- every shipped deploy/nats config ---------------------------------------------------------
JETSTREAM_CONFS = ("single.conf", "single-tls.conf", "cluster-a.conf", "cluster-b.conf", "cluster-c.conf")
REGION_CONFS = ("region.conf", "region-tls.conf")


def test_every_shipped_config_is_listed_here():
    """A new server config must be added to the checks below (else it would ship unchecked)."""
    tops = {
        p.name
        for p in NATS_DIR.glob("*.conf")
        if re.search(r"^server_name:|^include \./(single|region)\.conf", p.read_text(), re.M)
    }
    assert tops == set(JETSTREAM_CONFS) | set(REGION_CONFS) | {"leaf.conf"}, tops


@pytest.mark.parametrize("name", JETSTREAM_CONFS + REGION_CONFS + ("leaf.conf",))
def test_shipped_config_flushes_before_it_acknowledges(tmp_path, name):
    """Each shipped server config, run as an operator runs it (rendered with free ports and a
    private store dir), reports sync_always in /varz; leaf.conf keeps no JetStream state at all."""
    ca = TestCA(tmp_path / "tls")
    ca.issue("server", ["127.0.0.1", "localhost"])
    ca.issue("leaf")
    replace = {
        **cluster_replacements(tmp_path),
        "0.0.0.0:7422": f"127.0.0.1:{free_port()}",
        "/var/lib/nats": str(tmp_path / "store"),
        "/etc/nats/tls": str(ca.folder),
    }
    conf = render_nats_configs(tmp_path / "conf", replace)
    env = {
        **role_env_vars(role_passwords()),
        "ASYNCRL_REGION": "eu",
        # a hub that is not there: the region's leaf keeps dialling, the server runs regardless
        "ASYNCRL_NATS_HUB_LEAF_URL": f"nats-leaf://127.0.0.1:{free_port()}",
    }
    srv = ConfServer(conf / name, env, tmp_path / "server.log")
    try:
        srv.start("/varz")
        js = get_json(f"{srv.monitor_url}/varz").get("jetstream", {})
        if name == "leaf.conf":
            assert not js.get("config"), js  # no JetStream: nothing is acknowledged from here
        else:
            assert js["config"]["sync_always"] is True, (name, js["config"])
            assert js["config"]["store_dir"].startswith(str(tmp_path)), js["config"]
    finally:
        srv.stop()
