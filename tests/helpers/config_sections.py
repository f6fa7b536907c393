"""What the tests of the sectioned process configs (trainer, worker, scorer) share: running a
process or `asyncrl config check` with a clean environment, the printed tree, the layout check, the
shipped configs' tables (and stand-ins for the task sets they name)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import tomllib
import typing
from pathlib import Path

from kernel.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python *argv` from the repository root (a process as deployed: its own config, its own env)."""
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without ASYNCRL_* settings (the cache excepted), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_") or k == "ASYNCRL_CACHE"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def run_config_check(path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`asyncrl config check FILE` as a process."""
    return run("-m", "asyncrl.cli", "config", "check", str(path), env=env)


def printed_tree(stdout: str, table: str) -> dict:
    """The resolved config `asyncrl config check` printed for `[table]` (a JSON object after it)."""
    start = stdout.index(f"[{table}]\n") + len(f"[{table}]\n")
    return json.JSONDecoder().raw_decode(stdout[start:])[0]


def check_layout(cls, top: list[str], sections: dict[str, set[str]]) -> None:
    """`cls` has the fields `top` then one section per `sections` entry, each with exactly its keys."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    assert names == [*top, *sections], names
    for sect, keys in sections.items():
        assert dataclasses.is_dataclass(hints[sect]), sect
        assert {f.name for f in dataclasses.fields(hints[sect])} == keys, sect


def shipped_tables(table: str) -> list[tuple[Path, dict]]:
    """(file, its `[table]`) of every shipped run config (deploy/*.toml, bench/async.toml)."""
    paths = sorted((ROOT / "deploy").glob("*.toml")) + [ROOT / "bench" / "async.toml"]
    return [(p, tomllib.loads(p.read_text()).get(table, {})) for p in paths]


@contextlib.contextmanager
def shipped_task_sets():
    """The working directory moved to a scratch one holding a small task set (one train task, one
    eval task) wherever a shipped config's `[trainer.tasks.swe] task_set` points (relative to where
    `asyncrl up` runs): those sets are made by the commands the config's header gives, not shipped,
    and the trainer refuses a config whose set is missing."""
    from envs.task_set import write_task_set
    from tests.helpers.agentic import bug_task

    train = bug_task()
    held_out = dataclasses.replace(train, task_id="t-add-eval", split="eval")
    with tempfile.TemporaryDirectory(prefix="shipped-sets-") as tmp, contextlib.chdir(tmp):
        for _, trainer in shipped_tables("trainer"):
            path = trainer.get("tasks", {}).get("swe", {}).get("task_set")
            if path and not os.path.isabs(path):
                write_task_set(path, [train, held_out], {})
        yield tmp


def check_shipped(cls, table: str) -> None:
    """Every shipped config's `[table]` loads as the process reads it (unknown keys refused)."""
    with shipped_task_sets():
        for _path, values in shipped_tables(table):
            load_config(cls, None, overrides=values, environ={}, table=table)
