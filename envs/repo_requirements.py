"""What a repository declares its tests need: read, never run.

    requirements(repo_dir) -> ["inflection>=0.5", ...]    EnvError on a declaration that does not parse

Read: `pyproject.toml` ([project] dependencies and the test / tests / testing optional
dependencies, its own extras followed), `setup.cfg` ([options] install_requires,
[options.extras_require] of those names) and its requirements files (`requirements.txt`, the ones
naming tests, `requirements/{base,main,test,tests,testing}.txt`, with `-r` followed inside the
repository); `setup.py` is never executed. Left out: the project itself (its code comes from the
workspace) and pytest (the sandbox brings its own: envs/repo_env.py)."""

from __future__ import annotations

import configparser
import os
import re
import tomllib

EXTRAS = ("test", "tests", "testing")
PROVIDED = frozenset({"pytest"})  # the sandbox's own (its runner imports it first)
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?")


class EnvError(Exception):
    """A repository environment that cannot be built (or used), with the reason."""


def norm(name: str) -> str:
    """A distribution name as the package index compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> tuple[str, list[str]]:
    m = _NAME.match(req)
    if not m:
        return "", []
    extras = [e.strip() for e in (m.group(2) or "[]")[1:-1].split(",") if e.strip()]
    return norm(m.group(1)), extras


def _declared(repo: str, rel: str) -> str | None:
    """`repo/rel` when it is a file inside the repository (a link out of it is not read)."""
    real = os.path.realpath(os.path.join(repo, rel))
    return real if real.startswith(os.path.realpath(repo) + os.sep) and os.path.isfile(real) else None


def _pyproject(repo: str) -> tuple[str, list[str], dict[str, list[str]]]:
    path = _declared(repo, "pyproject.toml")
    if path is None:
        return "", [], {}
    try:
        with open(path, "rb") as f:
            proj = tomllib.load(f).get("project") or {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise EnvError(f"pyproject.toml does not parse: {e}") from e
    deps, opt = proj.get("dependencies") or [], proj.get("optional-dependencies") or {}
    if not isinstance(deps, list) or not isinstance(opt, dict):
        raise EnvError("pyproject.toml: [project] dependencies must be a list, optional-dependencies a table")
    return (
        str(proj.get("name") or ""),
        [str(r) for r in deps],
        {norm(k): [str(r) for r in v] for k, v in opt.items() if isinstance(v, list)},
    )


def _setup_cfg(repo: str) -> tuple[str, list[str], dict[str, list[str]]]:
    path = _declared(repo, "setup.cfg")
    if path is None:
        return "", [], {}
    cfg = configparser.ConfigParser(interpolation=None)
    try:
        cfg.read(path, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError) as e:
        raise EnvError(f"setup.cfg does not parse: {e}") from e

    # one requirement a line (`a; python_version<"3"`: the marker stays with it), comments dropped
    def reqs(text: str) -> list[str]:
        return [r.split("#", 1)[0].strip() for r in text.splitlines() if r.split("#", 1)[0].strip()]

    name = cfg.get("metadata", "name", fallback="")
    deps = reqs(cfg.get("options", "install_requires", fallback=""))
    extras = (
        {norm(k): reqs(v) for k, v in cfg["options.extras_require"].items()}
        if cfg.has_section("options.extras_require")
        else {}
    )
    return name, deps, extras


def _requirement_files(repo: str) -> list[str]:
    out = []
    for f in sorted(os.listdir(repo)):
        low = f.lower()
        if low.endswith(".txt") and "requirement" in low and (low == "requirements.txt" or "test" in low):
            out.append(f)
    sub = os.path.join(repo, "requirements")
    if os.path.isdir(sub):
        out += [f"requirements/{f}" for f in sorted(os.listdir(sub)) if f in _REQ_DIR_FILES]
    return out


_REQ_DIR_FILES = {"base.txt", "main.txt", "test.txt", "tests.txt", "testing.txt"}


def _read_requirements(repo: str, rel: str, seen: set[str]) -> list[str]:
    real = _declared(repo, rel)
    if real is None or real in seen:
        return []
    seen.add(real)
    out = []
    with open(real, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.split(" #", 1)[0].strip()
            if not line or line.startswith("#"):
                continue
            if not line.startswith("-"):
                line = re.split(r"\s+-", line, maxsplit=1)[0]  # per-line options (`--hash=...`)
            if not line:
                continue
            for opt in ("-r", "--requirement"):
                if line.startswith(opt + " ") or line.startswith(opt + "="):
                    inc = line[len(opt) + 1 :].strip()
                    out += _read_requirements(repo, os.path.join(os.path.dirname(rel), inc), seen)
            if line.startswith("-") or line.startswith((".", "/")) or "://" in line.split("@")[0]:
                continue  # options, the repository itself (`-e .`, `.`), local paths, bare URLs
            out.append(line)
    return out


def requirements(repo: str) -> list[str]:
    """What the repository declares it needs to run its tests (in the order found, each line once;
    the repository itself and pytest left out: see the module's note)."""
    found: list[str] = []
    own: set[str] = set()
    for read in (_pyproject, _setup_cfg):
        name, deps, extras = read(repo)
        if name:
            own.add(norm(name))
        groups, todo = set(), [g for g in EXTRAS if g in extras]
        found += deps
        while todo:  # the test extras, and the extras of the project they name (`pkg[all]`)
            g = todo.pop(0)
            if g in groups:
                continue
            groups.add(g)
            for r in extras.get(g, []):
                n, ex = _req_name(r)
                if n in own or (name and n == norm(name)):
                    todo += [norm(e) for e in ex if norm(e) in extras]
                else:
                    found.append(r)
    seen: set[str] = set()
    for rel in _requirement_files(repo):
        found += _read_requirements(repo, rel, seen)
    out: list[str] = []
    for r in found:
        n, _ = _req_name(r)
        if n and n not in own and n not in PROVIDED and r not in out:
            out.append(r)
    return out
