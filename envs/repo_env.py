"""A repository's environment: the packages its tests need, installed once per repository and
version into a task set, and mounted read-only into the sandbox for the agent's commands and the
scoring run alike.

    reqs = requirements(repo_dir)                     # declared dependencies + test extras
    env  = build(TASKS/envs, key, reqs, find_links)   # TASKS/envs/<key>/{site/, manifest.json}
    site = mount(root_dir, env_dir)                   # a copy the sandbox uid can read (cached)

What a repository declares is read, never run: `pyproject.toml` ([project] dependencies and the
test / tests / testing optional dependencies, its own extras followed), `setup.cfg`
([options] install_requires, [options.extras_require] of those names) and its requirements files
(`requirements.txt`, the ones naming tests, `requirements/{base,test,tests,testing}.txt`, with
`-r` followed inside the repository); `setup.py` is never executed. The code under test is not
installed (it comes from the workspace), nor is pytest (the sandbox brings its own, which the
runner imports before this environment is on the path: envs/workspace_tools.py CODE_PATH).

`pip install --target` from the package index, or with `find_links` from that directory only
(`--no-index`; the sdists are then built with this environment's build backends, setuptools, since
an offline directory rarely holds them). Written in a directory beside its place and renamed there
only when complete; a failure raises EnvError with pip's reason and leaves nothing behind.
"""

from __future__ import annotations

import configparser
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import tomllib

MANIFEST = "manifest.json"
SITE = "site"
EXTRAS = ("test", "tests", "testing")
PROVIDED = frozenset({"pytest"})  # the sandbox's own (its runner imports it first)
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?")


class EnvError(Exception):
    """A repository environment that cannot be built (or used), with the reason."""


def norm(name: str) -> str:
    """A distribution name as the package index compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def env_key(repo: str, version: str | None = None) -> str:
    """The directory name of a (repository, version) environment: `owner__name-version`."""
    key = repo.replace("/", "__") + (f"-{version}" if version else "")
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", key)


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


def _digest(site: str) -> str:
    h = hashlib.sha256()
    for d, dirs, files in os.walk(site):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(d, f)
            h.update(os.path.relpath(p, site).encode() + b"\0")
            if os.path.islink(p):
                h.update(b"L" + os.readlink(p).encode())
            else:
                with open(p, "rb") as fh:
                    h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()


def _installed(site: str) -> list[dict]:
    out = []
    for d in sorted(os.listdir(site)):
        meta = os.path.join(site, d, "METADATA")
        if d.endswith(".dist-info") and os.path.isfile(meta):
            fields = {}
            with open(meta, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if not line.strip():
                        break
                    k, _, v = line.partition(":")
                    fields.setdefault(k.strip(), v.strip())
            out.append({"name": fields.get("Name", d), "version": fields.get("Version", "")})
    return out


def _pip_reason(text: str) -> str:
    errs = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("ERROR:")]
    why = "; ".join(errs[:2]) if errs else " ".join(text.strip().splitlines()[-3:])
    return why[:600] or "pip failed without a message"


def _readable(path: str) -> None:
    """Directories 0755, files 0644 (0755 when executable): the sandbox uid reads, never writes."""
    for d, _dirs, files in os.walk(path):
        os.chmod(d, 0o755)
        for f in files:
            p = os.path.join(d, f)
            if not os.path.islink(p):
                os.chmod(p, 0o755 if os.stat(p).st_mode & 0o111 else 0o644)


def build(
    envs_dir: str,
    key: str,
    reqs: list[str],
    find_links: str | None = None,
    timeout_s: float = 900.0,
    info: dict | None = None,
) -> str:
    """`envs_dir/key` holding `site/` (the packages of `reqs` and what they need) and MANIFEST;
    built whole or not at all (EnvError with pip's reason). An environment already there is
    replaced."""
    os.makedirs(envs_dir, exist_ok=True)
    dest = os.path.join(envs_dir, key)
    tmp = tempfile.mkdtemp(prefix=f".{key}.building-", dir=envs_dir)
    try:
        site = os.path.join(tmp, SITE)
        cmd = [
            sys.executable, "-m", "pip", "install", "--target", site, "--no-input", "--no-compile",
            "--disable-pip-version-check", "--no-warn-script-location", "--progress-bar", "off",
        ]  # fmt: skip
        env = dict(os.environ)
        if find_links:
            if not os.path.isdir(find_links):
                raise EnvError(f"--find-links {find_links} is not a directory")
            direct = [r for r in reqs if re.search(r"@\s*\S+://", r)]
            if direct:  # pip would fetch these whatever --no-index says
                raise EnvError(
                    f"{direct[0]!r} is a direct URL; offline, packages come from {find_links} only"
                )
            # offline: this directory and nothing else (no pip configuration's index or links)
            cmd += ["--no-index", "--find-links", os.path.abspath(find_links), "--no-build-isolation"]
            env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
            env["PIP_CONFIG_FILE"] = os.devnull
        try:
            r = subprocess.run(
                cmd + reqs,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as e:
            raise EnvError(f"pip install did not finish in {timeout_s:.0f}s") from e
        if r.returncode != 0:
            raise EnvError(_pip_reason(r.stderr + "\n" + r.stdout))
        os.makedirs(site, exist_ok=True)
        _readable(tmp)
        manifest = {
            **(info or {}),
            "key": key,
            "requirements": reqs,
            "installed": _installed(site),
            "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
            "source": {"find_links": os.path.abspath(find_links)} if find_links else {"index": True},
            "digest": _digest(site),
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
        os.chmod(os.path.join(tmp, MANIFEST), 0o644)
        if os.path.lexists(dest):
            old = tempfile.mkdtemp(prefix=f".{key}.old-", dir=envs_dir)
            os.rename(dest, os.path.join(old, key))
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def read_manifest(env_dir: str) -> dict:
    try:
        with open(os.path.join(env_dir, MANIFEST)) as f:
            man = json.load(f)
    except (OSError, ValueError) as e:
        raise EnvError(f"environment {env_dir} is not a built environment ({e})") from e
    if not isinstance(man, dict) or not isinstance(man.get("digest"), str):
        raise EnvError(f"environment {env_dir}: manifest without a digest")
    return man


_lock = threading.Lock()


def mount(root_dir: str, env_dir: str) -> str:
    """The environment's site dir as the sandbox sees it: a root-owned copy under `root_dir/envs/`
    (0755/0644: readable, not writable, by the sandbox uid; the task set itself is closed to it),
    made once per environment digest and shared by every workspace after."""
    man = read_manifest(env_dir)
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if man.get("python") != here:
        raise EnvError(
            f"environment {os.path.basename(env_dir)} was built for python {man.get('python')}, "
            f"this process runs {here}: build it again here"
        )
    name = f"{os.path.basename(env_dir)}-{man['digest'][:16]}"
    base = os.path.join(root_dir, "envs")
    dest = os.path.join(base, name)
    if os.path.isfile(os.path.join(dest, ".complete")):
        return os.path.join(dest, SITE)
    with _lock:
        os.makedirs(base, exist_ok=True)
        os.chmod(base, 0o711)
        if not os.path.isfile(os.path.join(dest, ".complete")):
            _reap_copies(base)
            tmp = tempfile.mkdtemp(prefix=f".copy-{os.getpid()}-", dir=base)
            try:
                shutil.copytree(os.path.join(env_dir, SITE), os.path.join(tmp, SITE), symlinks=True)
                _readable(tmp)
                open(os.path.join(tmp, ".complete"), "w").close()
                try:
                    os.rename(tmp, dest)  # another process may have got there first: theirs stays
                except OSError:
                    shutil.rmtree(tmp, ignore_errors=True)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    if not os.path.isfile(os.path.join(dest, ".complete")):
        raise EnvError(f"environment {name} could not be made ready under {base}")
    return os.path.join(dest, SITE)


def _reap_copies(base: str) -> None:
    """Remove the half-made copies of processes that died making them (`.copy-<pid>-*`)."""
    for n in os.listdir(base):
        pid = n.split("-")[1] if n.startswith(".copy-") else ""
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join(base, n), ignore_errors=True)
            except PermissionError:
                pass  # alive, another user's


class Builder:
    """The environments of one import or build, under `envs_dir`: each key built once, its outcome
    (the directory, None when the repository declares nothing to install, or the EnvError) shared
    by every instance of that repository and version."""

    def __init__(self, envs_dir: str, find_links: str | None = None, timeout_s: float = 900.0):
        self.envs_dir, self.find_links, self.timeout_s = envs_dir, find_links, timeout_s
        self.done: dict[str, str | None | EnvError] = {}

    def for_repo(self, key: str, repo_dir: str, info: dict | None = None) -> str | None:
        """The environment of `key`, built from `repo_dir`'s declarations the first time; raises
        EnvError ("environment KEY cannot be built: why") for every instance of a failed one."""
        if key not in self.done:
            try:
                reqs = requirements(repo_dir)
                self.done[key] = (
                    build(self.envs_dir, key, reqs, self.find_links, self.timeout_s, info) if reqs else None
                )
            except (EnvError, OSError) as e:
                self.done[key] = EnvError(f"environment {key} cannot be built: {e}")
        got = self.done[key]
        if isinstance(got, EnvError):
            raise got
        return got

    def summary(self) -> dict[str, dict]:
        """Per key: {"installed": ["name==version", ...]}, {"error": why}, or {} (nothing declared)."""
        out = {}
        for key, got in sorted(self.done.items()):
            if isinstance(got, EnvError):
                out[key] = {"error": str(got)}
            elif got is None:
                out[key] = {}
            else:
                man = read_manifest(got)
                out[key] = {"installed": [f"{d['name']}=={d['version']}" for d in man["installed"]]}
        return out
