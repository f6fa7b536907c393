"""A real package's bugs as SWE-bench instances: one git repository per package, one commit per bug.

`asyncrl tasks build --packages NAME` (or `--sdist FILE`) makes tasks of one package's source
distribution, each one AST mutation of its source that breaks some of its own tests. Exported, the
tasks of one package become the history of one repository, as SWE-bench's instances of one project
share its clone:

    OUT/repos/pypi__<name>/      main: the pristine sdist (root commit, `environment_setup_commit`)
                                 bugs/<instance_id>: the bug injected, a child of the root (`base_commit`)

and each instance names `repo` "pypi/<name>", `version` the package's version (so `asyncrl tasks
import` builds one environment per package and version, shared by its instances), `patch` the
fix (`git diff base_commit root`), `test_patch` what the hidden tests change over the tree ("" for
a package: its own tests are the hidden tests, restored before every scoring run anyway).

    instances, notes = package_instances(tasks, out_dir)

Commits have a fixed author and date: the same tasks give the same commits.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from .episode import EpisodeTask

OWNER = "pypi"  # the repositories are the sdists published on the package index, not upstream clones
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "asyncrl",
    "GIT_AUTHOR_EMAIL": "asyncrl@localhost",
    "GIT_COMMITTER_NAME": "asyncrl",
    "GIT_COMMITTER_EMAIL": "asyncrl@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_TERMINAL_PROMPT": "0",
}


def is_package_task(task: EpisodeTask) -> bool:
    """A bug of a package's source distribution (asyncrl tasks build --packages / --sdist)."""
    return bool(task.base_dir) and isinstance(task.meta.get("package"), str) and "swebench" not in task.meta


def name_version(package: str) -> tuple[str, str]:
    """("more-itertools", "10.5.0") of an unpacked sdist's directory name "more-itertools-10.5.0"."""
    name, _, version = package.rpartition("-")
    if not name or not version[:1].isdigit():
        return package, "0"
    return name, version


def _git(repo: str, *args: str, inp: bytes | None = None) -> str:
    # the ceiling keeps git from taking a repository above `repo` for the one to work in
    env = {**os.environ, **GIT_IDENTITY, "GIT_CEILING_DIRECTORIES": os.path.dirname(os.path.abspath(repo))}
    r = subprocess.run(["git", *args], cwd=repo, input=inp, capture_output=True, timeout=300, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"git {args[0]} in {repo}: {r.stderr.decode(errors='replace').strip()[-400:]}")
    return r.stdout.decode("utf-8", "replace")


def _write(repo: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = os.path.join(repo, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w", encoding="utf-8") as f:
            f.write(text)


def _commit_all(repo: str, message: str) -> str:
    # --force: a .gitignore shipped in the sdist must not leave part of the package out of the commit
    _git(repo, "add", "-A", "--force")
    _git(repo, "commit", "-q", "--no-verify", "--allow-empty", "-m", message)
    return _git(repo, "rev-parse", "HEAD").strip()


def package_repository(package: str, base_dir: str, out_dir: str) -> tuple[str, str]:
    """(repo "pypi/<name>", its root commit): OUT/repos/pypi__<name> made from the pristine tree."""
    name, version = name_version(package)
    repo = f"{OWNER}/{name}"
    dest = os.path.join(out_dir, "repos", repo.replace("/", "__"))
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(base_dir, dest, symlinks=True)
    _git(dest, "init", "-q", "-b", "main")
    _git(dest, "config", "core.autocrlf", "false")
    root = _commit_all(dest, f"{name} {version}: the source distribution")
    _git(dest, "checkout", "-q", "--detach")  # bugs are committed off main, which stays pristine
    return repo, root


def bug_instance(task: EpisodeTask, repo: str, root: str, out_dir: str) -> dict:
    """The instance of one package task: its bug committed on the root, the fix and test patches."""
    dest = os.path.join(out_dir, "repos", repo.replace("/", "__"))
    _git(dest, "reset", "-q", "--hard", root)
    _write(dest, task.files)
    base = _commit_all(
        dest, f"{task.task_id}: {task.meta.get('kind', 'a bug')} in {task.meta.get('path', '')}"
    )
    _git(dest, "update-ref", f"refs/heads/bugs/{task.task_id}", base)
    patch = _git(dest, "diff", "--binary", base, root)
    _write(dest, task.hidden_tests)  # what the hidden tests change over the tree (nothing, for a package)
    _git(dest, "add", "-A", "--force")
    test_patch = _git(dest, "diff", "--cached", "--binary", base)
    _git(dest, "reset", "-q", "--hard", root)
    _git(dest, "clean", "-q", "-fdx")
    if not patch.strip():
        raise ValueError(f"{task.task_id}: its bug changes nothing in {repo}")
    _, version = name_version(task.meta["package"])
    return {
        "instance_id": task.task_id,
        "repo": repo,
        "base_commit": base,
        "problem_statement": task.instruction,
        "patch": patch,
        "test_patch": test_patch,
        "FAIL_TO_PASS": list(task.fail_to_pass),
        "PASS_TO_PASS": list(task.pass_to_pass),
        "version": version,
        "environment_setup_commit": root,
        "hints_text": "",
        "created_at": "",
        "repo_path": os.path.relpath(dest, out_dir),
        "runner": task.runner,
        "split": task.split,
    }


def package_instances(tasks: list[EpisodeTask], out_dir: str) -> tuple[list[dict], list[str]]:
    """(instances, notes) of package tasks: one repository per package under out_dir/repos/, one
    instance per task; a task that cannot be written is left out with a note naming it."""
    by_package: dict[str, list[EpisodeTask]] = {}
    for t in tasks:
        by_package.setdefault(t.meta["package"], []).append(t)
    names = [name_version(p)[0] for p in by_package]
    twice = sorted({n for n in names if names.count(n) > 1})
    out, notes = [], []
    for package, group in sorted(by_package.items()):
        if name_version(package)[0] in twice:  # one repository per name: which version would it hold?
            notes += [f"{t.task_id}: left out: two versions of {twice} in one export" for t in group]
            continue
        repo, root = package_repository(package, group[0].base_dir, out_dir)
        for t in group:
            if os.path.realpath(t.base_dir) != os.path.realpath(group[0].base_dir):
                notes.append(f"{t.task_id}: left out: {package} from two trees")
                continue
            out.append(bug_instance(t, repo, root, out_dir))
        dest = os.path.join(out_dir, "repos", repo.replace("/", "__"))
        _git(dest, "checkout", "-q", "main")
    return out, notes
