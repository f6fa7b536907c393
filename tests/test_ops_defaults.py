"""Safe defaults in deploy/: the shipped env files hold placeholders that no process accepts;
`asyncrl deploy init` fills them (one random secret per role, consistent across files, 0600) and
writes the signing pair; compose with signing on validates after it."""

import shutil
import stat
import subprocess

import pytest
import yaml

from asyncrl.cli import main as cli_main
from bus import BusConfig
from delta_codec import signing
from kernel import ConfigError, load_config
from tests.helpers.deploy import DEPLOY, ROOT, SHIPPED_ENV, compose_cmd, needs_compose, read_env


def test_placeholder_password_is_refused_naming_the_env_var():
    env = read_env(SHIPPED_ENV / "trainer.env")
    assert env["ASYNCRL_BUS__PASSWORD"].startswith("CHANGE-ME-")
    with pytest.raises(ConfigError, match="ASYNCRL_BUS__PASSWORD.*asyncrl deploy init"):
        load_config(BusConfig, env_prefix="ASYNCRL_BUS__", environ=env)
    with pytest.raises(ConfigError, match="ASYNCRL_BUS__TOKEN"):
        BusConfig(token="CHANGE-ME-token")
    with pytest.raises(ConfigError, match="placeholder"):
        BusConfig(user="worker", password="example-worker-change-me")  # the old shipped examples
    assert BusConfig(user="worker", password="s3cret-0123").password == "s3cret-0123"


def test_no_working_password_is_shipped():
    for f in SHIPPED_ENV.glob("*.env"):
        for k, v in read_env(f).items():
            if "PASSWORD" in k or "SEED" in k or "NKEY" in k:
                assert "CHANGE-ME-" in v, (f.name, k)
            if "LEAF_URL" in k:  # the region's leaf logs in with its nkey seed
                assert "@" not in v, (f.name, k)


def test_deploy_init_fills_consistently_and_is_idempotent(tmp_path, capsys):
    shutil.copytree(SHIPPED_ENV, tmp_path / "env")
    assert cli_main(["deploy", "init", "--dir", str(tmp_path / "env")]) == 0
    server = read_env(tmp_path / "env" / "nats.env")
    pw = {k: v for k, v in server.items() if k.endswith("_PASSWORD")}
    assert len(set(pw.values())) == len(pw) and all(len(v) == 48 and "CHANGE" not in v for v in pw.values())
    for comp, user in (
        ("trainer", "trainer"),
        ("rollout_worker", "worker"),
        ("scorer", "scorer"),
        ("region-admin", "admin"),
    ):
        env = read_env(tmp_path / "env" / f"{comp}.env")
        cfg = load_config(BusConfig, env_prefix="ASYNCRL_BUS__", environ=env)  # accepted now
        assert cfg.password == server[f"ASYNCRL_NATS_{user.upper()}_PASSWORD"]
    region = read_env(tmp_path / "env" / "nats-region.env")
    assert region["ASYNCRL_NATS_HUB_LEAF_URL"] == "nats-leaf://nats:7422"  # no password in the URL
    from bus.nkeys import public_of

    assert server["ASYNCRL_NATS_REGION_NKEY"] == public_of(region["ASYNCRL_NATS_REGION_SEED"])
    assert "CHANGE-ME" not in read_env(tmp_path / "env" / "grafana.env")["GF_SECURITY_ADMIN_PASSWORD"]
    for f in (tmp_path / "env").glob("*.env"):
        if "CHANGE-ME" in (SHIPPED_ENV / f.name).read_text():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f.name
    key, pub = tmp_path / "keys" / "trainer-signing.key", tmp_path / "keys" / "trainer-signing.pub"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    signing.verify(pub.read_text().strip(), b"x", signing.sign(key.read_text().strip(), b"x"))
    before = {f.name: f.read_text() for f in (tmp_path / "env").glob("*.env")}
    assert cli_main(["deploy", "init", "--dir", str(tmp_path / "env")]) == 0  # again: nothing changes
    assert before == {f.name: f.read_text() for f in (tmp_path / "env").glob("*.env")}
    assert "already initialised" in capsys.readouterr().out


@needs_compose
def test_init_then_signed_compose_validates(tmp_path):
    d = tmp_path / "deploy"
    shutil.copytree(DEPLOY, d, ignore=shutil.ignore_patterns("keys"))
    assert cli_main(["deploy", "init", "--dir", str(d / "env")]) == 0
    r = subprocess.run(
        compose_cmd() + ["-f", str(d / "docker-compose.yml"), "--profile", "region", "config"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    svc = yaml.safe_load(r.stdout)["services"]
    keys = d / "keys"
    for name, var, f in (
        ("trainer", "ASYNCRL_PUBLISH__SIGNING_KEY", "trainer-signing.key"),
        ("trainer-standby", "ASYNCRL_PUBLISH__SIGNING_KEY", "trainer-signing.key"),
        ("rollout_worker", "ASYNCRL_WEIGHTS__PUBLIC_KEY", "trainer-signing.pub"),
        ("rollout_worker-region", "ASYNCRL_WEIGHTS__PUBLIC_KEY", "trainer-signing.pub"),
    ):
        if name not in svc:  # docker-compose v2 leaves profiled services out
            continue
        s = svc[name]
        assert s["environment"][var] == f"/etc/asyncrl/keys/{f}", name
        mounts = [str(v) if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in s["volumes"]]
        assert any(m.startswith(f"{keys / f}:/etc/asyncrl/keys/{f}") for m in mounts), (name, mounts)
        assert (keys / f).is_file()
        assert "CHANGE-ME" not in s["environment"].get("ASYNCRL_BUS__PASSWORD", "")
