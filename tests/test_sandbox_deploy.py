"""The shipped deployment gives the sandbox its full isolation (docs/environments.md#containment):
the compose file (checked by `docker-compose config`) runs the processes that execute untrusted
code as root with the security options namespaces need, the systemd units run them as root with
a small capability bounding set (checked by `systemd-analyze verify`), and the start-up check
(envs/isolation.py) passes under exactly those capabilities."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.helpers.deploy import DEPLOY, ROOT, compose_cmd, needs_compose

UNITS = DEPLOY / "systemd"
SANDBOXED_UNITS = ("asyncrl-rollout-worker@.service", "asyncrl-scorer@.service")
SECURITY = {"seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined"}
# Docker's default capability set: what a compose service has when it adds none
DOCKER_CAPS = (
    "chown",
    "dac_override",
    "fsetid",
    "fowner",
    "mknod",
    "net_raw",
    "setgid",
    "setuid",
    "setfcap",
    "setpcap",
    "net_bind_service",
    "sys_chroot",
    "kill",
    "audit_write",
)
# unit directives that would take a layer away (namespaces, a fresh /proc, devices)
FORBIDDEN = (
    "RestrictNamespaces",
    "ProtectKernelTunables",
    "ProtectKernelLogs",
    "ProtectProc",
    "PrivateUsers",
    "ProcSubset",
    "DevicePolicy",
    "ProtectClock",
    "SystemCallFilter",
)


def compose_services(*files) -> dict:
    args = compose_cmd() + [a for f in files for a in ("-f", str(f))] + ["config"]
    r = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "ASYNCRL_REGION": "eu"},
    )
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)["services"]


def runs_untrusted_code(svc: dict) -> bool:
    cmd = svc.get("command") or []
    return any(m in (cmd if isinstance(cmd, list) else cmd.split()) for m in ("rollout_worker", "scorer"))


@needs_compose
@pytest.mark.parametrize("overlay", [(), ("docker-compose.gpu.yml",)])
def test_compose_runs_sandboxing_services_as_root_with_namespace_options(overlay):
    services = compose_services(DEPLOY / "docker-compose.yml", *(DEPLOY / o for o in overlay))
    sandboxed = {n for n, s in services.items() if runs_untrusted_code(s)}
    assert {"rollout_worker", "scorer"} <= sandboxed, sorted(services)
    for name in sandboxed:
        s = services[name]
        assert str(s.get("user", "")).split(":")[0] == "0", (name, s.get("user"))
        assert SECURITY <= set(s.get("security_opt", [])), (name, s.get("security_opt"))
        assert not s.get("cap_add") and not s.get("privileged"), name  # nothing added
    for name in set(services) - sandboxed:  # the rest stays as it was
        assert "user" not in services[name] or str(services[name]["user"]).split(":")[0] != "0", name


def unit_directives(name: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        m = re.match(r"^(\w+)=(.*)$", line)
        if m:
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


@pytest.mark.parametrize("unit", SANDBOXED_UNITS)
def test_units_run_as_root_with_a_small_bounding_set_and_keep_the_namespaces(unit):
    d = unit_directives(unit)
    assert d.get("User") == ["root"] and "Group" not in d, d.get("User")
    caps = set(" ".join(d["CapabilityBoundingSet"]).split())
    assert {"CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_KILL"} <= caps and "CAP_SYS_ADMIN" not in caps, caps
    assert d.get("NoNewPrivileges") == ["true"] and d.get("PrivateTmp") == ["true"]
    assert not set(d) & set(FORBIDDEN), set(d) & set(FORBIDDEN)


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="no systemd-analyze: apt-get install systemd"
)
def test_sandboxed_units_verify(tmp_path):
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    sysdir = root / "etc/systemd/system"
    sysdir.mkdir(parents=True)
    for p in UNITS.iterdir():
        shutil.copy(p, sysdir / p.name)
    exe = root / "opt/asyncrl/.venv/bin/python"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    names = [u.replace("@.", "@1.") for u in SANDBOXED_UNITS]
    r = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", *names],
        cwd=sysdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


CHECK = "from envs import isolation; isolation.require(); print('full isolation')"


def _check_under(caps: list[str]) -> subprocess.CompletedProcess:
    bounding = "-all," + ",".join(f"+{c}" for c in caps)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [
            "setpriv",
            "--no-new-privs",
            f"--bounding-set={bounding}",
            "--inh-caps=-all",
            "--",
            sys.executable,
            "-c",
            CHECK,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


needs_root_ns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="the start-up check's full isolation needs root with namespaces",
)


@needs_root_ns
@pytest.mark.parametrize("unit", SANDBOXED_UNITS)
def test_start_up_check_passes_under_the_units_capabilities(unit):
    """The running code's own check, as the unit runs it: root, no_new_privs, only the unit's
    bounding set (without CAP_SYS_ADMIN the namespaces are the fresh uid's own)."""
    caps = " ".join(unit_directives(unit)["CapabilityBoundingSet"]).split()
    r = _check_under([c.removeprefix("CAP_").lower() for c in caps])
    assert r.returncode == 0 and "full isolation" in r.stdout, r.stderr[-2000:]


@needs_root_ns
def test_start_up_check_passes_under_dockers_default_capabilities():
    r = _check_under(list(DOCKER_CAPS))
    assert r.returncode == 0 and "full isolation" in r.stdout, r.stderr[-2000:]


def test_dockerfile_image_has_the_sandbox_tools():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^RUN command -v unshare && command -v setpriv && command -v mount", text, re.M)
