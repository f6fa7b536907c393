"""deploy/: docker compose, systemd units, env files and the Dockerfile, checked by the real
validators (docker-compose config, systemd-analyze verify) and against the process configs.

No Docker engine runs here; `docker-compose config` (Debian package docker-compose) or the
`docker compose` plugin validates without one. CI installs both validators:
    apt-get install -y docker-compose systemd
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from bus import load_config
from tests.helpers.deploy import DEPLOY, ENV_DIR, INIT_DEPLOY, ROOT, compose_cmd, needs_compose, read_env

UNITS = DEPLOY / "systemd"
COMPONENTS = {"trainer": "trainer", "rollout_worker": "worker", "scorer": "scorer"}  # env file -> NATS user


needs_systemd = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="no systemd-analyze: apt-get install systemd"
)


def compose_config(*files: Path) -> tuple[int, str, str]:
    args = compose_cmd() + [a for f in files for a in ("-f", str(f))] + ["config"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    return r.returncode, r.stdout, r.stderr


# -- env files --------------------------------------------------------------------------------
def test_env_files_parse_into_the_process_configs_and_passwords_match():
    """Every component's env file is accepted by its process config (load_config), logs in as
    its own role, and its password is the one the server gets for that role."""
    from rollout_worker.config import WorkerConfig
    from scorer.config import ScorerConfig
    from trainer.config import TrainerConfig

    classes = {"trainer": TrainerConfig, "rollout_worker": WorkerConfig, "scorer": ScorerConfig}
    server = read_env(ENV_DIR / "nats.env")
    common = read_env(ENV_DIR / "common.env")
    for comp, user in COMPONENTS.items():
        env = {**common, **read_env(ENV_DIR / f"{comp}.env")}
        cfg = load_config(classes[comp], environ=env)
        assert cfg.bus.user == user and cfg.bus.servers == ["nats://nats:4222"]
        assert cfg.bus.password == server[f"ASYNCRL_NATS_{user.upper()}_PASSWORD"], comp
    obs = read_env(ENV_DIR / "observer.env")
    assert obs["NATS_USER"] == "observer" and obs["NATS_PASSWORD"] == server["ASYNCRL_NATS_OBSERVER_PASSWORD"]
    # every password the server configs ask for is provided
    wanted = set(
        re.findall(r"\$(ASYNCRL_NATS_[A-Z]+_PASSWORD)", (DEPLOY / "nats" / "accounts.conf").read_text())
    )
    assert wanted and wanted <= set(server)


# -- docker compose ---------------------------------------------------------------------------
@needs_compose
def test_compose_validates_and_has_the_services():
    rc, out, err = compose_config(DEPLOY / "docker-compose.yml")
    assert rc == 0, err
    cfg = yaml.safe_load(out)
    svc = cfg["services"]
    # (profiled services, e.g. `region`, are listed by docker-compose v1 and left out by v2)
    assert {n for n, s in svc.items() if not s.get("profiles")} == {
        "nats",
        "nats-box",
        "trainer",
        "trainer-standby",
        "rollout_worker",
        "scorer",
    }
    for name, profile in (("prometheus", "monitoring"), ("grafana", "monitoring"), ("nats-region", "region")):
        assert name not in svc or svc[name]["profiles"] == [profile], name
    nats = svc["nats"]
    assert nats["image"].startswith("nats:")  # the official image
    assert any("/healthz?js-enabled-only=true" in part for part in nats["healthcheck"]["test"])
    # JetStream's store dir (single.conf) is a named volume
    assert any(str(v).startswith("nats-data:/var/lib/nats") for v in nats["volumes"]), nats["volumes"]
    assert svc["nats-box"]["image"].startswith("natsio/nats-box")
    for name in ("trainer", "trainer-standby", "rollout_worker", "scorer"):
        s = svc[name]
        assert s["depends_on"]["nats"]["condition"] == "service_healthy", name
        assert s["build"]["dockerfile"] == "Dockerfile" and s["restart"] in ("always", "unless-stopped")
    assert svc["trainer"]["command"] == svc["trainer-standby"]["command"] == ["python", "-m", "trainer"]
    assert svc["trainer"]["environment"]["ASYNCRL_BUS__USER"] == "trainer"
    # scalable: no fixed container name or host port, and it logs in as `worker`
    w = svc["rollout_worker"]
    assert "container_name" not in w and "ports" not in w
    assert w["environment"]["ASYNCRL_BUS__USER"] == "worker"
    assert svc["scorer"]["environment"]["ASYNCRL_BUS__USER"] == "scorer"
    # the GPU override validates on top
    rc, out, err = compose_config(DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.gpu.yml")
    assert rc == 0, err
    gpu = yaml.safe_load(out)["services"]["rollout_worker"]
    assert gpu["environment"]["ASYNCRL_ENGINE__KIND"] == "vllm"
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


@needs_compose
def test_compose_validator_rejects_a_broken_file(tmp_path):
    """The validator used above does fail on a wrong file (so its pass means something)."""
    text = (DEPLOY / "docker-compose.yml").read_text()
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(text.replace("      interval: 5s", "      intervall: 5s"))
    shutil.copytree(ENV_DIR, tmp_path / "env")
    rc, _, err = compose_config(bad)
    assert rc != 0 and "intervall" in err


# -- systemd ----------------------------------------------------------------------------------
def unit_files() -> list[Path]:
    return sorted(p for p in UNITS.iterdir() if p.suffix in (".service", ".target"))


@needs_systemd
def test_systemd_units_verify(tmp_path):
    """systemd-analyze verify on every unit, in a scratch root holding the units, the host's
    system units and stand-ins for the binaries they start (verify checks ExecStart exists).
    Any diagnostic counts as a failure: verify exits 0 on unknown keys and bad values."""
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    sysdir = root / "etc/systemd/system"
    sysdir.mkdir(parents=True)
    for p in unit_files():
        shutil.copy(p, sysdir / p.name)
    for unit in unit_files():
        for line in unit.read_text().splitlines():
            m = re.match(r"Exec\w+=[-@:+!]*(/\S+)", line)
            if m:
                exe = root / m.group(1).lstrip("/")
                exe.parent.mkdir(parents=True, exist_ok=True)
                exe.write_text("#!/bin/sh\n")
                exe.chmod(0o755)
    names = [p.name.replace("@.", "@1.") for p in unit_files()]
    r = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", *names],
        cwd=sysdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_systemd_units_restart_and_wait_for_the_network():
    services = [p for p in unit_files() if p.suffix == ".service"]
    assert {p.name for p in services} == {
        "asyncrl-nats.service",
        "asyncrl-trainer@.service",
        "asyncrl-rollout-worker@.service",
        "asyncrl-scorer@.service",
        "asyncrl-nats-region.service",
    }
    for p in services:
        text = p.read_text()
        for need in ("Restart=always", "After=network-online.target", "Wants=network-online.target"):
            assert need in text, (p.name, need)
        envs = re.findall(r"^EnvironmentFile=/etc/asyncrl/(\S+)$", text, re.M)
        assert envs and all((ENV_DIR / e).is_file() for e in envs), (p.name, envs)
    assert "-c /etc/asyncrl/nats/single.conf" in (UNITS / "asyncrl-nats.service").read_text()


# -- Dockerfile -------------------------------------------------------------------------------
def test_dockerfile_copies_every_package_and_builds_both_variants():
    text = (ROOT / "Dockerfile").read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, re.M))
    assert {"base-cpu", "base-cuda", "final"} <= stages and "FROM base-${VARIANT} AS final" in text
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    copied = {m.split()[0] for m in re.findall(r"^COPY (.+)$", text, re.M)}
    for src in copied:
        for part in src.split():
            assert (ROOT / part).exists(), f"Dockerfile copies missing {part}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.findall(r'"(\w+)\*"', pyproject.split("[tool.setuptools.packages.find]")[1])
    assert packages and set(packages) <= copied, set(packages) - copied


# -- compose profile `region` ------------------------------------------------------------------
def _region_env(service: dict) -> dict[str, str]:
    """A service's env as compose gives it, with ${VAR:-default} at its default."""
    env = {}
    for f in service.get("env_file", []):
        env.update(read_env(INIT_DEPLOY / f))
    for k, v in (service.get("environment") or {}).items():
        env[k] = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v))
    return env


def test_compose_region_profile_points_workers_at_the_region_mirrors():
    """Profile `region`: a region nats-server running deploy/nats/region.conf, a one-shot that
    declares its mirrors (as the region's admin, on its own domain), and workers that take work
    from the hub's domain and weights from the region's (accepted by WorkerConfig)."""
    from bus import BusConfig
    from bus import topology as topo
    from rollout_worker.config import WorkerConfig

    svc = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    region = {n: s for n, s in svc.items() if "region" in (s.get("profiles") or [])}
    assert set(region) == {"nats-region", "region-mirrors", "rollout_worker-region"}
    assert not any(
        s.get("profiles") for n, s in svc.items() if n not in set(region) | {"prometheus", "grafana"}
    )  # the hub stays default
    server = read_env(ENV_DIR / "nats.env")
    nr = region["nats-region"]
    assert (
        nr["command"] == ["-c", "/etc/nats/asyncrl/region.conf"]
        and (DEPLOY / "nats" / "region.conf").is_file()
    )
    assert any(str(v).startswith("nats-region-data:/var/lib/nats") for v in nr["volumes"])
    env = _region_env(nr)
    # the leaf URL carries no password: the region logs in with its nkey, the hub knows the public half
    assert env["ASYNCRL_NATS_HUB_LEAF_URL"] == "nats-leaf://nats:7422"
    from bus.nkeys import public_of

    assert server["ASYNCRL_NATS_REGION_NKEY"] == public_of(env["ASYNCRL_NATS_REGION_SEED"])
    w = load_config(WorkerConfig, environ=_region_env(region["rollout_worker-region"]))
    assert (w.bus.servers, w.bus.js_domain, w.bus.weights_domain) == (
        ["nats://nats-region:4222"],
        "hub",
        env["ASYNCRL_REGION"],
    )
    assert w.bus.user == "worker" and w.bus.password == server["ASYNCRL_NATS_WORKER_PASSWORD"]
    assert region["rollout_worker-region"]["depends_on"] == {
        "region-mirrors": {"condition": "service_completed_successfully"}
    }
    m = region["region-mirrors"]
    assert m["command"] == ["python", "-m", "bus.weights.regions"]
    menv = _region_env(m)
    b = load_config(BusConfig, env_prefix="ASYNCRL_BUS__", environ=menv)
    assert b.servers == ["nats://nats-region:4222"] and b.js_domain is None
    assert b.user == "admin" and b.password == server["ASYNCRL_NATS_ADMIN_PASSWORD"]
    assert load_config(topo.MirrorConfig, env_prefix="ASYNCRL_MIRROR__", environ=menv).weights_keep == 64


@needs_compose
def test_compose_region_profile_validates():
    args = compose_cmd() + ["-f", str(DEPLOY / "docker-compose.yml"), "--profile", "region", "config"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    svc = yaml.safe_load(r.stdout)["services"]
    assert {"nats-region", "region-mirrors", "rollout_worker-region", "nats", "rollout_worker"} <= set(svc)
    assert "nats" not in svc["rollout_worker-region"]["depends_on"]  # a region does not wait for a local hub
