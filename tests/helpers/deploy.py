"""The shipped deploy/ tree: its paths, an initialised copy (env files and keys), env-file parsing,
the compose validator."""

from __future__ import annotations

import atexit
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SHIPPED_ENV = DEPLOY / "env"


def initialized_deploy() -> Path:
    """A copy of deploy/env after `asyncrl deploy init` (<tmp>/env, <tmp>/keys): the shipped
    files hold placeholders that no process accepts."""
    from asyncrl.deploy import init

    root = Path(tempfile.mkdtemp(prefix="asyncrl-deploy-"))
    shutil.copytree(SHIPPED_ENV, root / "env")
    init(root / "env", root / "keys")
    atexit.register(shutil.rmtree, root, True)
    return root


INIT_DEPLOY = initialized_deploy()
ENV_DIR = INIT_DEPLOY / "env"
KEYS_DIR = INIT_DEPLOY / "keys"


def read_env(path: Path) -> dict[str, str]:
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        assert "=" in line, f"{path.name}:{n}: not KEY=VALUE: {line!r}"
        k, v = line.split("=", 1)
        assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", k), f"{path.name}:{n}: bad variable name {k!r}"
        out[k] = v
    return out


def compose_cmd() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        return ["docker", "compose"]
    return None


needs_compose = pytest.mark.skipif(
    compose_cmd() is None, reason="no compose validator: apt-get install docker-compose"
)
