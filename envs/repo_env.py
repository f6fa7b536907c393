"""A repository's environment: the packages its tests need, installed once per repository and
version into a task set, and mounted read-only into the sandbox for the agent's commands and the
scoring run alike.

    reqs = requirements(repo_dir)                     # declared dependencies + test extras
    env  = build(TASKS/envs, key, reqs, find_links)   # TASKS/envs/<key>/{site/, manifest.json}
    site = mount(root_dir, env_dir)                   # a copy the sandbox uid can read (cached)

What a repository declares is read, never run (envs/repo_requirements.py).

`pip install --target` from the package index, or with `find_links` from that directory only
(`--no-index`; the sdists are then built with this environment's build backends, setuptools, since
an offline directory rarely holds them). Written in a directory beside its place and renamed there
only when complete; a failure raises EnvError with pip's reason and leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

from .repo_requirements import EnvError, requirements

MANIFEST = "manifest.json"
SITE = "site"


def env_key(repo: str, version: str | None = None) -> str:
    """The directory name of a (repository, version) environment: `owner__name-version`."""
    key = repo.replace("/", "__") + (f"-{version}" if version else "")
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", key)


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
