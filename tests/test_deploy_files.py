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

from kernel import load_config
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
    run_toml = ["--config", "/etc/asyncrl/run.toml"]
    assert (
        svc["trainer"]["command"]
        == svc["trainer-standby"]["command"]
        == ["python", "-m", "trainer", *run_toml]
    )
    assert svc["trainer"]["environment"]["ASYNCRL_BUS__USER"] == "trainer"
    # scalable: no fixed container name or host port, and it logs in as `worker`
    w = svc["rollout_worker"]
    assert "container_name" not in w and "ports" not in w
    assert w["environment"]["ASYNCRL_BUS__USER"] == "worker"
    assert svc["scorer"]["environment"]["ASYNCRL_BUS__USER"] == "scorer"
    # the GPU override validates on top (what it sets: test_compose_takes_one_run_toml_and_pins_gpus)
    rc, out, err = compose_config(DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.gpu.yml")
    assert rc == 0, err


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


# -- one run TOML, GPUs pinned per process -----------------------------------------------------
ASYNCRL_SERVICES = ("trainer", "trainer-standby", "rollout_worker", "scorer")
GPU_WORKERS = {f"rollout_worker-gpu{n}": n for n in (4, 5, 6, 7)}


def compose_config_env(env: dict[str, str], *files: Path) -> dict:
    import os

    args = compose_cmd() + [a for f in files for a in ("-f", str(f))] + ["config"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)["services"]


def _run_toml_source(service: dict) -> str | None:
    for v in service.get("volumes", []):
        if isinstance(v, dict) and v.get("target") == "/etc/asyncrl/run.toml":
            return v["source"]
        if isinstance(v, str) and ":/etc/asyncrl/run.toml" in v:
            return v.split(":/etc/asyncrl/run.toml")[0]
    return None


@needs_compose
def test_compose_takes_one_run_toml_and_pins_gpus(tmp_path):
    """`docker-compose config` with a run TOML (ASYNCRL_RUN_TOML) and the GPU overlay: every asyncrl
    process mounts that one file read-only and reads it (--config), the trainer group gets its GPUs
    and the torchrun agent, each GPU worker exactly its own GPU and metrics offset; the CPU workers
    and the standby (it would hold the same GPUs) are left to their profiles."""
    run = tmp_path / "my-run.toml"
    run.write_text((DEPLOY / "run-gpu.toml").read_text())
    cmd = lambda mod: ["python", "-m", mod, "--config", "/etc/asyncrl/run.toml"]  # noqa: E731
    base = compose_config_env({"ASYNCRL_RUN_TOML": str(run)}, DEPLOY / "docker-compose.yml")
    for name in ASYNCRL_SERVICES:
        assert _run_toml_source(base[name]) == str(run), name
        assert base[name]["command"] == cmd({"trainer-standby": "trainer"}.get(name, name).replace("-", "_"))
        assert base[name]["environment"]["ASYNCRL_RUN__METRICS_HOST"] == "0.0.0.0"  # container network
    # default: the shipped example next to the compose file
    default = compose_config_env({}, DEPLOY / "docker-compose.yml")
    assert _run_toml_source(default["scorer"]) == str(DEPLOY / "run.toml")
    # env is for secrets and per-host values: no run setting of the worker or scorer in their env files
    for f in ("rollout_worker.env", "scorer.env"):
        keys = set(read_env(DEPLOY / "env" / f))
        assert not {k for k in keys if k.startswith(("ASYNCRL_ENGINE__", "ASYNCRL_ADMISSION__"))}, f
        assert "ASYNCRL_RUN__CONCURRENCY" not in keys, f

    svc = compose_config_env(
        {"ASYNCRL_RUN_TOML": str(run), "ASYNCRL_TRAINER_GPUS": "0,1", "ASYNCRL_TRAINER_NPROC": "2"},
        DEPLOY / "docker-compose.yml",
        DEPLOY / "docker-compose.gpu.yml",
    )
    t = svc["trainer"]
    assert t["command"] == [*cmd("trainer"), "--elastic"]
    assert t["environment"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert t["environment"]["ASYNCRL_ELASTIC__NPROC_PER_NODE"] == "2"
    assert t["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    ]
    assert _run_toml_source(t) == str(run)
    assert svc["trainer-standby"]["profiles"] == ["standby"]
    assert svc["rollout_worker"]["profiles"] == ["cpu-workers"]
    cpu_worker = base["rollout_worker"]
    for name, gpu in GPU_WORKERS.items():
        w = svc[name]
        assert not w.get("profiles"), name
        assert w["command"] == cmd("rollout_worker") and _run_toml_source(w) == str(run), name
        devices = w["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [str(gpu)], "capabilities": ["gpu"]}], name
        env = w["environment"]
        assert (env["CUDA_VISIBLE_DEVICES"], env["ASYNCRL_RUN__INSTANCE"]) == ("0", str(gpu)), name
        # the same process as the CPU worker: its env files, sandbox options, user, keys
        assert sorted(w["security_opt"]) == sorted(cpu_worker["security_opt"]), name
        for key in ("user", "depends_on", "stop_signal", "restart"):
            assert w.get(key) == cpu_worker.get(key), (name, key)
        # (the validator folds env_file into environment)
        assert {k: v for k, v in env.items() if k in cpu_worker["environment"]} == cpu_worker["environment"]
        assert {str(v) for v in cpu_worker["volumes"]} <= {str(v) for v in w["volumes"]}, name
    assert {n for n in svc if n.startswith("rollout_worker-gpu")} == set(GPU_WORKERS)
    # the instance is read by the worker: its metrics port is the role's base + its GPU
    from rollout_worker.config import WorkerConfig

    for name, gpu in GPU_WORKERS.items():
        env = {**read_env(ENV_DIR / "common.env"), **read_env(ENV_DIR / "rollout_worker.env")}
        env.update({k: str(v) for k, v in svc[name]["environment"].items() if k.startswith("ASYNCRL_RUN__")})
        w = load_config(WorkerConfig, run, section="worker", environ=env)
        assert (w.run.metrics_port + w.run.instance, w.run.metrics_host) == (9600 + gpu, "0.0.0.0")
        assert w.engine.kind == "vllm" and w.engine.model == "/models/policy"
    # and Prometheus (compose) scrapes them there
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert set(jobs["rollout_worker"]["static_configs"][0]["targets"]) == {
        f"{n}:{9600 + g}" for n, g in GPU_WORKERS.items()
    }
    ports = {n: j["dns_sd_configs"][0]["port"] for n, j in jobs.items()}
    assert ports == {"trainer": 9400, "rollout_worker": 9600, "scorer": 9500}
    for role, port in (("trainer", 9400), ("rollout_worker", 9600), ("scorer", 9500)):
        assert read_env(DEPLOY / "env" / f"{role}.env")["ASYNCRL_RUN__METRICS_PORT"] == str(port)


def test_prometheus_file_sd_config_for_hosts():
    """Outside compose: a scrape config reading file_sd target files, the example host's targets in
    the systemd units' port scheme, the same format `asyncrl up` writes for a run."""
    import json

    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-hosts.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == ["/etc/asyncrl/prometheus/targets/*.json"]
    groups = json.loads((DEPLOY / "prometheus" / "targets" / "example-host.json").read_text())
    by_job = {g["labels"]["job"]: g["targets"] for g in groups}
    assert by_job["trainer"] == ["127.0.0.1:9400"]
    assert all(9500 < int(t.rsplit(":", 1)[1]) < 9600 for t in by_job["scorer"])
    assert all(9600 <= int(t.rsplit(":", 1)[1]) < 9700 for t in by_job["rollout_worker"])


def test_systemd_units_read_the_run_toml_and_pin_by_instance():
    worker = (UNITS / "asyncrl-rollout-worker@.service").read_text()
    assert (
        "Environment=CUDA_VISIBLE_DEVICES=%i" in worker and "Environment=ASYNCRL_RUN__INSTANCE=%i" in worker
    )
    assert "Environment=ASYNCRL_RUN__INSTANCE=%i" in (UNITS / "asyncrl-scorer@.service").read_text()
    for unit, mod in (("trainer", "trainer"), ("rollout-worker", "rollout_worker"), ("scorer", "scorer")):
        text = (UNITS / f"asyncrl-{unit}@.service").read_text()
        assert re.search(rf"^ExecStart=\S+ -m {mod} --config /etc/asyncrl/run.toml", text, re.M), unit
    # a unit instance that is not a number is refused at start, not run on a guessed GPU
    from rollout_worker.config import WorkerConfig

    with pytest.raises(ValueError, match="instance"):
        load_config(WorkerConfig, None, environ={"ASYNCRL_RUN__INSTANCE": "a"})


# -- deploy/install.sh -------------------------------------------------------------------------
def _wheel(tmp_path: Path) -> Path:
    """This tree as a wheel, built from a copy (no build dir left in the checkout), offline."""
    import sys
    import tomllib

    src = tmp_path / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    pkgs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for pat in pkgs["include"]:
        name = pat.rstrip("*")
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheel"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            ".",
        ],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return next(out.glob("asyncrl-*.whl"))


def _install(dest: Path, wheel: Path, *extra: str) -> subprocess.CompletedProcess:
    import os
    import sys

    from asyncrl.nats_server import find_binary

    return subprocess.run(
        ["sh", str(DEPLOY / "install.sh"), "--destdir", str(dest), "--nats-server", find_binary()]
        + ["--package", str(wheel), "--pip-args", "--no-deps --no-index", *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
    )


def _named_paths(unit_text: str) -> set[str]:
    """Every absolute path a unit names: executables, env files, config files on its command lines."""
    out = set()
    for line in unit_text.splitlines():
        m = re.match(r"(Exec\w+|EnvironmentFile)=[-@:+!]*(.*)$", line)
        if m:
            out |= {w for w in m.group(2).split() if w.startswith("/")}
    return out


@needs_systemd
def test_install_script_into_a_staging_root_passes_systemd_verify(tmp_path):
    """deploy/install.sh --destdir: units, configs, env files, check-secrets.sh, nats-server and the
    venv land in the staging root; every path a unit names is there; `systemd-analyze verify` on
    the installed units (in that root) reports nothing; a second install keeps the secrets."""
    import os
    import stat

    dest = tmp_path / "root"
    r = _install(dest, _wheel(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    sysdir = dest / "etc/systemd/system"
    units = sorted(p for p in sysdir.iterdir() if p.suffix in (".service", ".target"))
    assert {p.name for p in units} == {p.name for p in unit_files()}
    host_tools = {"/bin/sh", "/bin/kill"}  # the system's, not ours to install
    named = set().union(*(_named_paths(p.read_text()) for p in units))
    assert {
        "/etc/asyncrl/run.toml",
        "/usr/local/bin/nats-server",
        "/etc/asyncrl/nats/check-secrets.sh",
    } <= named
    for path in sorted(named - host_tools):
        assert (dest / path.lstrip("/")).is_file(), f"{path} named by a unit, not installed"
        assert Path(path).suffix or os.access(dest / path.lstrip("/"), os.X_OK), path
    for tool in host_tools:
        assert Path(tool).is_file(), tool
    # nats-server runs from the root, the configs it is started with are there and parse
    binary = dest / "usr/local/bin/nats-server"
    assert subprocess.run([binary, "--version"], capture_output=True, timeout=30).returncode == 0
    # the venv holds this tree (installed --no-deps here: the packages themselves)
    py = dest / "opt/asyncrl/.venv/bin/python"
    probe = "import importlib.util as u; print(u.find_spec('trainer').origin)"
    found = subprocess.run(
        [py, "-c", probe], capture_output=True, text=True, timeout=60, env={}, cwd=tmp_path
    )
    assert str(dest / "opt/asyncrl/.venv") in found.stdout, found.stdout + found.stderr
    # secrets are private; users come from sysusers.d
    for env in (dest / "etc/asyncrl").glob("*.env"):
        assert stat.S_IMODE(env.stat().st_mode) == 0o600, env
    assert "u nats" in (dest / "usr/lib/sysusers.d/asyncrl.conf").read_text()
    assert (dest / "etc/asyncrl/prometheus/prometheus.yml").is_file()

    # systemd-analyze verify in the staging root (the host's own units for the targets named)
    shutil.copytree("/usr/lib/systemd/system", dest / "usr/lib/systemd/system", symlinks=True)
    for tool in host_tools:
        (dest / tool.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tool, dest / tool.lstrip("/"))
    names = [p.name.replace("@.", "@4.") for p in units]
    v = subprocess.run(
        ["systemd-analyze", "verify", f"--root={dest}", *names],
        cwd=sysdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert v.returncode == 0 and not (v.stdout + v.stderr).strip(), v.stdout + v.stderr
    # the verifier does look: a unit naming a file that is not in the root fails it
    (dest / "opt/asyncrl/.venv/bin/python").rename(dest / "opt/asyncrl/.venv/bin/python.moved")
    v = subprocess.run(
        ["systemd-analyze", "verify", f"--root={dest}", "asyncrl-scorer@1.service"],
        cwd=sysdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "/opt/asyncrl/.venv/bin/python" in v.stdout + v.stderr
    (dest / "opt/asyncrl/.venv/bin/python.moved").rename(dest / "opt/asyncrl/.venv/bin/python")

    # reinstall: filled env files (secrets) and the installed run are kept; --run-toml replaces it
    (dest / "etc/asyncrl/nats.env").write_text("ASYNCRL_NATS_ADMIN_PASSWORD=real-secret\n")
    (dest / "etc/asyncrl/run.toml").write_text("[up]\nworkers = 9\n")
    r = _install(dest, next((tmp_path / "wheel").glob("*.whl")), "--no-venv")
    assert r.returncode == 0, r.stderr
    assert "real-secret" in (dest / "etc/asyncrl/nats.env").read_text()
    assert "workers = 9" in (dest / "etc/asyncrl/run.toml").read_text()
    r = _install(dest, tmp_path, "--no-venv", "--run-toml", str(DEPLOY / "run-gpu.toml"))
    assert r.returncode == 0, r.stderr
    assert (dest / "etc/asyncrl/run.toml").read_text() == (DEPLOY / "run-gpu.toml").read_text()
    r = _install(dest, tmp_path, "--no-venv", "--run-toml", str(tmp_path / "absent.toml"))
    assert r.returncode == 2 and "absent.toml" in r.stderr


# -- the image's pins are the package's --------------------------------------------------------
def dockerfile_pin_errors(dockerfile: str, pyproject: str, makefile: str) -> list[str]:
    """Where the Dockerfile's versions disagree with pyproject.toml (and the Makefile's torch)."""
    import tomllib

    from packaging.requirements import Requirement

    proj = tomllib.loads(pyproject)["project"]
    reqs = [Requirement(r) for r in proj["dependencies"]]
    extras = proj["optional-dependencies"]
    for rs in extras.values():
        reqs += [Requirement(r) for r in rs]
    spec = {}
    for r in reqs:
        spec.setdefault(r.name.lower(), []).append(r.specifier)
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.M))
    errors = []
    # every pip-installed "name<op>version" (ARG defaults filled in) satisfies pyproject's spec
    for name, op, ver in re.findall(r'pip install[^\n]*?"([A-Za-z0-9_.-]+)(==|>=|~=)([^"]+)"', dockerfile):
        ver = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), ver)
        if name.lower() not in spec:
            errors.append(f"{name} is installed by the Dockerfile but not a requirement of pyproject.toml")
        elif op == "==" and not all(s.contains(ver, prereleases=True) for s in spec[name.lower()]):
            errors.append(
                f"{name}=={ver} does not satisfy pyproject's {[str(s) for s in spec[name.lower()]]}"
            )
    torch_pin = re.search(r"torch==([\w.]+)", makefile)
    if torch_pin and args.get("TORCH_VERSION") != torch_pin.group(1):
        errors.append(f"TORCH_VERSION {args.get('TORCH_VERSION')} is not the Makefile's {torch_pin.group(1)}")
    # the CUDA image: the project with the GPU extras, their requirements exactly as pyproject states
    cuda = args.get("CUDA_EXTRAS", "")
    for e in cuda.split(","):
        if e not in extras:
            errors.append(f"CUDA_EXTRAS names {e!r}, not an extra of pyproject.toml")
    gpu_reqs = {Requirement(r).name for e in cuda.split(",") if e in extras for r in extras[e]}
    for need in ("vllm", "wandb", "mini-swe-agent"):
        if need not in gpu_reqs:
            errors.append(f"the CUDA image lacks {need} (CUDA_EXTRAS={cuda!r})")
    if '".[${CUDA_EXTRAS}]"' not in dockerfile:
        errors.append("the CUDA image does not install the project with ${CUDA_EXTRAS}")
    return errors


def test_dockerfile_pins_agree_with_pyproject():
    text = (ROOT / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert dockerfile_pin_errors(text, pyproject, makefile) == []
    # the check sees a disagreement: the image as it was (vLLM 0.10.2 against >= 0.32, no W&B)
    old = text.replace(
        "ARG CUDA_EXTRAS=vllm,agents,wandb",
        'ARG VLLM_VERSION=0.10.2\nRUN pip install "vllm==${VLLM_VERSION}"',
    ).replace('".[${CUDA_EXTRAS}]"', '".[vllm]"')
    errors = dockerfile_pin_errors(old, pyproject, makefile)
    assert any("vllm==0.10.2" in e for e in errors) and any("wandb" in e for e in errors), errors
    assert dockerfile_pin_errors(
        text.replace("TORCH_VERSION=2.13.0", "TORCH_VERSION=2.3.0"), pyproject, makefile
    )
