"""The scoring copy of a workspace: the task's pristine snapshot plus the agent's changes to
*source* files only.

Tests and test infrastructure come from the task, whatever the agent did to them: a file of one
of the kinds below that the agent created, changed or deleted is dropped from the copy (the
task's version, or nothing, is used) and named in the episode record (`EpisodeResult.dropped`).

    test files          hidden tests, the task's test paths, test_*.py / *_test.py, tests/ test/ testing/
    conftest.py         pytest hooks (a hook wrapper can rewrite every report)
    test configuration  pytest.ini .pytest.ini tox.ini setup.cfg pyproject.toml (addopts, plugins)
    interpreter hooks   sitecustomize.py usercustomize.py *.pth
    plugins on the path *.dist-info / *.egg-info / *.egg-link (pytest11 entry points), pytest_*.py
    compiled code       __pycache__/, *.pyc, *.pyo (stale bytecode of the tests), *.so, *.pyd
    links               any symlink the agent made or changed (regular files only cross over)

Everything else the agent changed (its fix) is copied over the snapshot; a source file it deleted
is deleted. `changed` lists those paths (the tamper checks of envs/tamper.py read them).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from .safe_path import clear_for_write

CONFIG_FILES = {"pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"}
HOOK_FILES = {"sitecustomize.py", "usercustomize.py"}
TEST_DIRS = {"tests", "test", "testing"}
MAX_LISTED = 64  # dropped paths named in the episode record (the count is always exact)


def is_test_path(rel: str, task) -> bool:
    """A test file of the task (hidden tests, test paths) or one named like a test."""
    rel = rel.replace(os.sep, "/")
    if rel in task.hidden_tests:
        return True
    for p in task.test_paths:
        p = p.rstrip("/")
        if rel == p or rel.startswith(p + "/"):
            return True
    parts = rel.split("/")
    base = parts[-1]
    return base.startswith("test_") or base.endswith("_test.py") or any(p in TEST_DIRS for p in parts[:-1])


def infra_kind(rel: str, task) -> str:
    """Why `rel` is test infrastructure (never taken from the agent), or "" for a source file."""
    parts = rel.replace(os.sep, "/").split("/")
    base = parts[-1]
    if "__pycache__" in parts or base.endswith((".pyc", ".pyo")):
        return "bytecode"
    if base.endswith((".so", ".pyd")):
        return "compiled extension"
    if any(p.endswith((".dist-info", ".egg-info")) for p in parts) or base.endswith((".pth", ".egg-link")):
        return "path hook / plugin metadata"
    if base == "conftest.py":
        return "conftest"
    if base in CONFIG_FILES:
        return "test configuration"
    if base in HOOK_FILES:
        return "interpreter hook"
    if base.startswith("pytest_") and base.endswith(".py"):
        return "pytest plugin"
    if is_test_path(rel, task):
        return "test file"
    return ""


@dataclass
class ScoringCopy:
    dropped: list[str] = field(default_factory=list)  # "path (kind)" of agent files not used
    n_dropped: int = 0
    changed: list[str] = field(default_factory=list)  # source paths the agent changed (or deleted)
    originals: dict[str, bytes | None] = field(default_factory=dict)  # changed path -> task's bytes

    def drop(self, rel: str, why: str) -> None:
        self.n_dropped += 1
        if len(self.dropped) < MAX_LISTED:
            self.dropped.append(f"{rel} ({why})")


def snapshot(task) -> dict[str, tuple[str, bytes]]:
    """The task's pristine tree: rel path -> ("file", bytes) | ("link", target): base_dir, then
    `files`, then `hidden_tests` over it."""
    out: dict[str, tuple[str, bytes]] = {}
    if task.base_dir:
        for d, dirs, files in os.walk(task.base_dir):
            for name in dirs + files:
                p = os.path.join(d, name)
                rel = os.path.relpath(p, task.base_dir).replace(os.sep, "/")
                st = os.lstat(p)
                if stat.S_ISLNK(st.st_mode):
                    out[rel] = ("link", os.readlink(p).encode())
                elif stat.S_ISREG(st.st_mode):
                    with open(p, "rb") as f:
                        out[rel] = ("file", f.read())
    for src in (task.files, task.hidden_tests):
        for rel, text in src.items():
            out[os.path.normpath(rel).replace(os.sep, "/")] = ("file", text.encode("utf-8"))
    return out


def build(task, repo: str, dest: str, with_tests: bool = True, snap: dict | None = None) -> ScoringCopy:
    """Write the scoring copy of workspace `repo` into `dest` (made here, as the caller's user).
    with_tests=False leaves every test file out (value-mode scoring: the expected values must not
    be readable by the code under test)."""
    snap = snapshot(task) if snap is None else snap
    res = ScoringCopy()
    os.makedirs(dest, exist_ok=True)
    for rel, (kind, data) in snap.items():
        if not with_tests and is_test_path(rel, task):
            continue
        _put(dest, rel, kind, data)
    seen = set()
    for d, dirs, files in os.walk(repo):
        for name in sorted(dirs + files):
            p = os.path.join(d, name)
            rel = os.path.relpath(p, repo).replace(os.sep, "/")
            st = os.lstat(p)
            if stat.S_ISDIR(st.st_mode):
                continue
            seen.add(rel)
            orig = snap.get(rel)
            why = infra_kind(rel, task)
            if stat.S_ISLNK(st.st_mode):
                if orig != ("link", os.readlink(p).encode()):
                    res.drop(rel, "symlink")
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            with open(p, "rb") as f:
                data = f.read()
            if orig == ("file", data):
                continue
            if why:
                res.drop(rel, why)
                continue
            _put(dest, rel, "file", data)
            res.changed.append(rel)
            res.originals[rel] = orig[1] if orig and orig[0] == "file" else None
    for rel, (kind, data) in snap.items():
        if rel in seen or (kind == "file" and os.path.isdir(os.path.join(repo, rel))):
            continue
        if infra_kind(rel, task):
            res.drop(rel, "deleted " + infra_kind(rel, task))
        else:  # the agent deleted a source file: so does the copy
            _remove(dest, rel)
            res.changed.append(rel)
            res.originals[rel] = data if kind == "file" else None
    return res


def _put(dest: str, rel: str, kind: str, data: bytes) -> None:
    """Create dest/rel (never through a symlink: parents are real directories made here)."""
    path = clear_for_write(dest, rel, "path", "the scoring copy")
    if kind == "link":
        os.symlink(data.decode(), path)
    else:
        with open(path, "wb") as f:
            f.write(data)


def _remove(dest: str, rel: str) -> None:
    path = os.path.join(dest, rel)
    if os.path.lexists(path) and not os.path.isdir(path):
        os.unlink(path)
