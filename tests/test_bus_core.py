"""bus core against a real nats-server: topology, publish/dedupe, pull, KV, config, logging."""

from __future__ import annotations

import asyncio
import io
import json
import os
from pathlib import Path

import nats.errors
import pytest

from bus import BusConfig, KVConflict, TopologyConfig, connect
from bus import topology as topo
from bus.events import Task, new_id
from kernel import ConfigError, get_logger, load_config, setup_logging


async def test_provision_is_idempotent_and_updates_changed_config(fresh_server):
    bus = await connect(BusConfig(servers=[fresh_server.url], name="prov"))
    try:
        first = await bus.provision()
        assert set(first.values()) == {"created"}
        assert set((await bus.provision()).values()) == {"unchanged"}
        changed = TopologyConfig(ack_wait_s=7, max_deliver=9, weights_keep=3, kv_history=8)
        res = await bus.provision(changed)
        assert res[f"{topo.TASKS}/{topo.ROLLOUT_CONSUMER}"] == "updated"
        assert res[topo.WEIGHTS] == "updated" and res[topo.CONTROL_BUCKET] == "updated"
        assert res[topo.TASKS] == "unchanged"
        ci = await bus.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)
        assert ci.config.ack_wait == pytest.approx(7) and ci.config.max_deliver == 9
        si = await bus.js.stream_info(topo.WEIGHTS)
        assert si.config.max_msgs_per_subject == 3
        assert (await bus.js.stream_info(f"KV_{topo.CONTROL_BUCKET}")).config.max_msgs_per_subject == 8
        assert set((await bus.provision(changed)).values()) == {"unchanged"}
        # a change that cannot be applied in place is refused with a clear error, nothing altered
        with pytest.raises(ValueError, match="cannot change"):
            await bus.provision(TopologyConfig(storage="memory"))
        assert (await bus.js.stream_info(topo.TASKS)).config.storage == "file"
    finally:
        await bus.close()


async def test_publish_headers_and_dedupe(bus):
    t = Task(task_id=new_id(), env="arith", prompt="2+2")
    a1 = await bus.publish(topo.task_subject("arith"), t)
    a2 = await bus.publish(topo.task_subject("arith"), t)  # same Nats-Msg-Id
    assert not a1.duplicate and a2.duplicate and a1.seq == a2.seq
    sub = await bus.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
    msgs = await sub.fetch(10, timeout=0.5)
    assert len(msgs) == 1
    h = msgs[0].headers
    assert h["Nats-Msg-Id"] == f"task-{t.task_id}" and h["Rl-Kind"] == "Task"
    assert h["Rl-Task"] == t.task_id and h["Rl-From"] == "test" and h["Rl-Schema"] == "1"
    await msgs[0].ack_sync()
    assert await sub.fetch(10, timeout=0.2) == []  # empty -> [], no TimeoutError


async def test_publish_many_pipelined_and_deduped(bus):
    tasks = [Task(task_id=f"pm-{i}", env="arith", prompt="x") for i in range(300)]
    acks = await bus.publish_many([(topo.task_subject("arith"), t) for t in tasks])
    assert len({a.seq for a in acks}) == 300 and not any(a.duplicate for a in acks)
    again = await bus.publish_many([(topo.task_subject("arith"), t) for t in tasks[:10]])
    assert all(a.duplicate for a in again)
    assert (await bus.js.stream_info(topo.TASKS)).state.messages == 300


async def test_kv_create_update_watch(bus):
    key = "leader"
    r1 = await bus.kv_create(key, b"a")
    with pytest.raises(KVConflict):
        await bus.kv_create(key, b"b")
    r2 = await bus.kv_update(key, b"c", r1)
    with pytest.raises(KVConflict):
        await bus.kv_update(key, b"d", r1)  # stale revision loses
    assert await bus.kv_get(key) == b"c" and await bus.kv_get("missing") is None
    seen = []

    async def watch():
        async for value, rev in bus.kv_watch(key):
            seen.append((value, rev))
            if len(seen) == 2:
                return

    w = asyncio.create_task(watch())
    await asyncio.sleep(0.2)
    r3 = await bus.kv_put(key, b"e")
    await asyncio.wait_for(w, 5)
    assert seen == [(b"c", r2), (b"e", r3)]


def test_load_config_toml_env_and_errors(tmp_path):
    from dataclasses import dataclass, field

    @dataclass
    class Proc:
        slots: int = 4
        ratio: float = 0.5
        verbose: bool = False
        tags: list[str] = field(default_factory=list)
        bus: BusConfig = field(default_factory=BusConfig)

    p = tmp_path / "c.toml"
    p.write_text('slots = 2\ntags = ["a"]\n[bus]\nname = "w1"\n[bus.topology]\nack_wait_s = 3\n')
    env = {
        "ASYNCRL_SLOTS": "8",
        "ASYNCRL_VERBOSE": "yes",
        "ASYNCRL_BUS__SERVERS": "nats://a:1, nats://b:2",
        "ASYNCRL_BUS__TOPOLOGY__MAX_DELIVER": "7",
        "ASYNCRL_OTHER_PROCESS_KNOB": "ignored",
    }
    cfg = load_config(Proc, p, environ=env)
    assert (cfg.slots, cfg.ratio, cfg.verbose, cfg.tags) == (8, 0.5, True, ["a"])
    assert cfg.bus.servers == ["nats://a:1", "nats://b:2"] and cfg.bus.name == "w1"
    assert cfg.bus.topology.ack_wait_s == 3.0 and cfg.bus.topology.max_deliver == 7
    p.write_text("slotz = 2\n")
    with pytest.raises(ConfigError, match="slotz"):
        load_config(Proc, p, environ={})
    p.write_text('[bus]\nconnect_timeout_s = "soon"\n')
    with pytest.raises(ConfigError, match="connect_timeout_s"):
        load_config(Proc, p, environ={})
    with pytest.raises(ConfigError, match="SLOTS|slots"):
        load_config(Proc, None, environ={"ASYNCRL_SLOTS": "many"})
    with pytest.raises(ConfigError, match="max_deliver"):
        load_config(Proc, None, environ={"ASYNCRL_BUS__TOPOLOGY__MAX_DELIVER": "0"})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Proc, tmp_path / "nope.toml")


def test_logging_json_lines_with_component():
    buf = io.StringIO()
    setup_logging("scorer", component_id="scorer-7", stream=buf)  # not a TTY -> JSON
    get_logger("x").info("hello", n=3)
    rec = json.loads(buf.getvalue().strip().splitlines()[-1])
    assert rec["event"] == "hello" and rec["n"] == 3
    assert rec["component"] == "scorer" and rec["component_id"] == "scorer-7" and rec["level"] == "info"
    with pytest.raises(ValueError, match="log level"):
        setup_logging("x", level="loud")


class _SlowClusterJS:
    """A JetStream context whose stream creates time out the way an R3 create does on a loaded
    cluster: the call took effect on the server, the reply came too late."""

    def __init__(self, js, fail: int, info_times_out: bool = False):
        self._js, self.fail, self.calls, self.info_times_out = js, fail, 0, info_times_out

    def __getattr__(self, name):
        return getattr(self._js, name)

    async def stream_info(self, name, *a, **kw):
        if self.info_times_out:
            raise nats.errors.TimeoutError
        return await self._js.stream_info(name, *a, **kw)

    async def add_stream(self, config):
        res = await self._js.add_stream(config)
        self.calls += 1
        if self.calls <= self.fail:
            raise nats.errors.TimeoutError
        return res


async def test_provision_retries_a_timed_out_create_that_took_effect(fresh_server):
    bus = await connect(BusConfig(servers=[fresh_server.url], name="prov-retry", publish_retries=3))
    js = bus.js
    try:
        bus.js = slow = _SlowClusterJS(js, fail=2)
        res = await bus.provision()
        assert slow.calls >= 2  # two creates timed out; the retries saw them done
        for s in topo.stream_configs(TopologyConfig()):
            assert (await js.stream_info(s.name)).config.name == s.name
        assert set(res.values()) <= {"created", "unchanged"}
        assert set((await bus.provision()).values()) == {"unchanged"}
        # a server that never answers is reported after the last attempt, not swallowed
        bus.js = _SlowClusterJS(js, fail=0, info_times_out=True)
        with pytest.raises(nats.errors.TimeoutError):
            await bus.provision()
    finally:
        bus.js = js
        await bus.close()


async def test_publish_to_unprovisioned_subject_is_a_clear_error(fresh_server):
    from bus import PublishError

    bus = await connect(BusConfig(servers=[fresh_server.url], name="np", publish_retries=2))
    try:
        with pytest.raises(PublishError, match="no JetStream stream takes subject 'rl.nowhere'"):
            await bus.publish("rl.nowhere", b"x")
    finally:
        await bus.close()


def test_embedded_server_bad_config_and_restart_keeps_port(tmp_path):
    from asyncrl.nats_server import EmbeddedServer, ServerError

    bad = tmp_path / "bad.conf"
    bad.write_text("this is { not a config\n")
    with pytest.raises(ServerError, match="exited"):
        EmbeddedServer(tmp_path / "s1", config_file=str(bad)).start_sync()
    with EmbeddedServer(tmp_path / "s2") as srv:
        port = srv.port
        srv.stop_sync(kill=True)
        assert not srv.running
        srv.start_sync()
        assert srv.port == port and srv.running


async def test_kv_watch_survives_server_restart(fresh_server):
    bus = await connect(BusConfig(servers=[fresh_server.url], name="kvw"))
    try:
        await bus.provision()
        await bus.kv_put(topo.KEY_LAMBDA, b"0.1")
        seen = []

        async def watch():
            async for value, _rev in bus.kv_watch(topo.KEY_LAMBDA):
                seen.append(value)
                if value == b"0.3":
                    return

        w = asyncio.create_task(watch())
        async with asyncio.timeout(20):
            while seen != [b"0.1"]:
                await asyncio.sleep(0.05)
            await fresh_server.restart(kill=True)
            while bus.reconnects == 0:
                await asyncio.sleep(0.05)
            await bus.kv_put(topo.KEY_LAMBDA, b"0.2")
            await bus.kv_put(topo.KEY_LAMBDA, b"0.3")
            await w
        assert seen[0] == b"0.1" and seen[-1] == b"0.3"  # 0.2 may be folded into the rebuild
    finally:
        await bus.close()


async def test_connect_reports_bad_credentials_and_unreachable_servers(tmp_path):
    from asyncrl.nats_server import EmbeddedServer
    from bus import ConnectError

    async with EmbeddedServer(tmp_path / "auth", extra_args=["--auth", "s3cret"]) as srv:
        ok = await connect(BusConfig(servers=[srv.url], token="s3cret", name="tok"))
        assert ok.nc.is_connected
        await ok.close()
        with pytest.raises(ConnectError, match="refused the credentials"):
            await connect(BusConfig(servers=[srv.url], token="wrong", connect_attempts=5))
        port = srv.port
    with pytest.raises(ConnectError, match="no NATS server reachable"):
        await connect(
            BusConfig(
                servers=[f"nats://127.0.0.1:{port}"],
                connect_attempts=2,
                reconnect_wait_s=0.05,
                reconnect_wait_max_s=0.1,
            )
        )


async def test_run_foreground_serves_until_sigterm(tmp_path):
    """`asyncrl nats`: prints the URL, serves JetStream, exits 0 on SIGTERM and stops the server."""
    import signal
    import sys

    code = (
        "import sys; from asyncrl.nats_server import run_foreground; "
        "sys.exit(run_foreground(sys.argv[1], port=None))"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        str(tmp_path / "store"),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("nats-server ready: nats://"), line
        url = line.split()[2]
        b = await connect(BusConfig(servers=[url], name="fg"))
        assert (await b.provision())[topo.TASKS] == "created"
        await b.close()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert (tmp_path / "store" / "jetstream").is_dir()  # file store kept
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _self_signed(tmp_path):
    """A CA and a server cert for 127.0.0.1 (cryptography), written as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject, issuer, pub, sign_key, ca, san=None):
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(pub)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(sign_key, hashes.SHA256())

    ca_key, srv_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "asyncrl test CA")])
    ca = cert(ca_name, ca_name, ca_key.public_key(), ca_key, True)
    srv = cert(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]),
        ca_name,
        srv_key.public_key(),
        ca_key,
        False,
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    pem = serialization.Encoding.PEM
    (tmp_path / "ca.pem").write_bytes(ca.public_bytes(pem))
    (tmp_path / "srv.pem").write_bytes(srv.public_bytes(pem))
    (tmp_path / "srv.key").write_bytes(
        srv_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return tmp_path / "ca.pem", tmp_path / "srv.pem", tmp_path / "srv.key"


async def test_connect_over_tls_with_ca(tmp_path):
    from asyncrl.nats_server import EmbeddedServer
    from bus import ConnectError

    ca, crt, key = _self_signed(tmp_path)
    async with EmbeddedServer(
        tmp_path / "tls", extra_args=["--tls", "--tlscert", str(crt), "--tlskey", str(key)]
    ) as srv:
        b = await connect(BusConfig(servers=[srv.url], name="tls", tls_ca=str(ca)))
        try:
            await b.provision()
            assert (
                await b.publish(topo.task_subject("arith"), Task(task_id="tls", env="arith", prompt="p"))
            ).seq == 1
        finally:
            await b.close()
        with pytest.raises(ConnectError, match="TLS"):  # no CA: the server certificate is not trusted
            await connect(BusConfig(servers=[srv.url], name="notls", connect_attempts=1, connect_timeout_s=1))


async def test_pull_shared_by_concurrent_fetchers_delivers_each_message_once(bus):
    n = 60
    await bus.publish_many(
        [(topo.task_subject("arith"), Task(task_id=f"cf-{i}", env="arith", prompt="p")) for i in range(n)]
    )
    sub = await bus.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
    got: list[str] = []

    async def fetcher():
        while len(got) < n:
            for m in await sub.fetch(7, timeout=0.3):
                got.append(m.headers["Rl-Task"])
                await m.ack()

    await asyncio.wait_for(asyncio.gather(*[fetcher() for _ in range(4)]), 20)
    assert sorted(got) == sorted(f"cf-{i}" for i in range(n))
