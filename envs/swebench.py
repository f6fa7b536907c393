"""SWE-bench-format task data: instances in, this project's tasks out as instances, predictions scored.

SWE-bench, SWE-Gym and SWE-smith share one instance format (one JSON object per line):

    instance_id, repo ("owner/name"), base_commit, problem_statement, patch (the gold fix),
    test_patch (the tests that judge it), FAIL_TO_PASS, PASS_TO_PASS (pytest ids "path::name";
    a list or, as in the published datasets, a JSON string of one), version,
    environment_setup_commit, plus extras (hints_text, created_at; SWE-smith: image_name, ...)

Everything here is offline. The repository at `base_commit` comes from, in order:
`repo_path` (this project's extension: a git repository holding base_commit, or a directory
that *is* the snapshot; relative to the instance file), `<repos>/<owner>__<name>` (a git clone,
SWE-bench's own naming), or nothing when the instance names an `image_name` (the docker
workspace backend runs it from the image's workdir, the local backend refuses it; then the
test_patch may only create files). An instance with both keeps its image (`meta["image"]`): the
docker backend runs the snapshot in it, the local backend the snapshot alone. Further extensions this
project writes and reads (other tools ignore them): `runner` ("pytest" | "mini"), `split`,
`family`.

    task   = instance_to_task(inst, out_dir, repos_dir)   # EpisodeTask; snapshot in out_dir/repos/
    inst   = task_to_instance(task, out_dir)              # git repository out_dir/repos/<owner__name>
    result = evaluate_patch(task, model_patch)            # the SWE-bench verdict for one prediction

An imported task is an ordinary EpisodeTask: the workspace starts from the snapshot, the hidden
tests are the test_patch's files, and F2P + P2P are its tests; with a `Builder`
(envs/repo_env.py) it also gets its repository's environment, one per repository and version.
`evaluate_patch` scores a patch the way the SWE-bench harness does (pristine snapshot + model
patch, test patch over it, every F2P and P2P test must pass: resolved) through
envs.episode.Episode, i.e. the same scoring path as every episode (the hidden tests run on a
scoring copy, so the patch cannot touch them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

from .episode import SPLITS, Episode, EpisodeLimits, EpisodeTask
from .node_ids import ELSEWHERE, unknown_ids
from .repo_env import Builder, EnvError, env_key

REQUIRED = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)
# the fields read as strings (required ones may not be null; optional ones null: absent)
STRINGS = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "test_patch",
    "patch",
    "repo_path",
    "image_name",
    "runner",
    "split",
    "family",
)
FAMILY = "swebench"
# a deterministic identity for the commits export makes (same task set -> same base_commit)
_GIT_ENV = {
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
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.\-]+$")
_REPO = re.compile(r"^[A-Za-z0-9_.\-]+/[A-Za-z0-9_.\-]+$")
_COMMIT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-/]{0,255}$")  # never an option to git


class InstanceError(ValueError):
    """An instance (or prediction) that cannot be used, with the reason; `instance` and `field` name
    the instance (its id, else its place in the file) and the field at fault, where known."""

    def __init__(self, message: str, instance: str | None = None, field: str | None = None):
        super().__init__(message)
        self.instance, self.field = instance, field


def _bad(iid: str, field: str, text: str) -> InstanceError:
    return InstanceError(f"{iid}: {field} {text}", iid, field)


# -- reading --------------------------------------------------------------------------------------
def read_jsonl(path: str) -> list[dict]:
    """Objects of a .jsonl file, or of a .json file holding a list (or a map id -> object, the
    form SWE-bench also accepts for predictions); a clear error naming the line otherwise."""
    out = []
    for where, d in iter_instances(path):
        if isinstance(d, InstanceError):
            raise InstanceError(f"{path}:{where.split()[-1]}: {d}")
        out.append(d)
    return out


def iter_instances(path: str) -> Iterator[tuple[str, dict | InstanceError]]:
    """(where, object) of each object of a .jsonl file ("line N"), read line by line (a file of any
    size, or a pipe), or of a .json file holding a list or a map id -> object ("item N"). A line that
    is no JSON object comes as an InstanceError in its place, so the rest are still read; a .json
    file that is not one is an InstanceError raised."""
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise InstanceError(f"{path}: not JSON: {e}") from None
        if isinstance(data, dict):
            data = [{"instance_id": k, **v} if isinstance(v, dict) else v for k, v in data.items()]
        if not isinstance(data, list):
            raise InstanceError(f"{path}: expected a list of objects, got {type(data).__name__}")
        for n, d in enumerate(data, 1):
            ok = isinstance(d, dict)
            yield f"item {n}", d if ok else InstanceError(f"expected an object, got {type(d).__name__}")
        return
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                d = json.loads(raw.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield f"line {n}", InstanceError(f"not JSON: {e}")
                continue
            ok = isinstance(d, dict)
            yield f"line {n}", d if ok else InstanceError(f"expected an object, got {type(d).__name__}")


def test_list(inst: dict, key: str, iid: str | None = None) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS as a list (the published datasets store a JSON string)."""
    iid = iid or str(inst.get("instance_id"))
    v = inst.get(key, [])
    if isinstance(v, str):
        try:
            v = json.loads(v) if v.strip() else []
        except json.JSONDecodeError:
            raise _bad(iid, key, "is a string that is not a JSON list of test ids") from None
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        odd = next((t for t in v if not isinstance(t, str)), None) if isinstance(v, list) else None
        got = type(v).__name__ if not isinstance(v, list) else f"a list holding {odd!r}"
        raise _bad(iid, key, f"must be a list of test ids (or a JSON string of one), got {got}")
    return v


def check_instance(inst: dict, where: str = "") -> str:
    """The instance's id, once its fields are there and of their types; InstanceError naming the
    instance (its id, else `where`) and the field otherwise."""
    iid = inst.get("instance_id")
    if "instance_id" not in inst:
        raise InstanceError(f"{where}: instance_id missing (a required field)", where, "instance_id")
    if not isinstance(iid, str) or not _SAFE_ID.match(iid):
        raise InstanceError(
            f"{where}: instance_id {iid!r}: a string of letters, digits, '_', '-', '.' only",
            where,
            "instance_id",
        )
    missing = [k for k in REQUIRED if k not in inst]
    if missing:
        s = "s" if len(missing) > 1 else ""
        raise InstanceError(f"{iid}: missing required field{s} {', '.join(missing)}", iid, missing[0])
    for k in STRINGS:
        if k in inst and not isinstance(inst[k], str) and (inst[k] is not None or k in REQUIRED):
            got = "null" if inst[k] is None else f"{type(inst[k]).__name__} {str(inst[k])[:40]!r}"
            raise _bad(iid, k, f"must be a string, got {got}")
    if not _REPO.match(inst["repo"]) or any(p in (".", "..") for p in inst["repo"].split("/")):
        raise _bad(iid, "repo", f"must be 'owner/name', got {inst['repo']!r}")
    if not _COMMIT.match(inst["base_commit"]):
        raise _bad(iid, "base_commit", f"must be a commit id, got {inst['base_commit'][:200]!r}")
    if not inst["problem_statement"].strip():
        raise _bad(iid, "problem_statement", "is empty: it is the task's instruction")
    f2p, p2p = test_list(inst, "FAIL_TO_PASS", iid), test_list(inst, "PASS_TO_PASS", iid)
    if not f2p:
        raise _bad(iid, "FAIL_TO_PASS", "is empty: no test tells a fix from the starting code")
    both = sorted(set(f2p) & set(p2p))
    if both:
        raise _bad(iid, "FAIL_TO_PASS", f"and PASS_TO_PASS both list {both[:3]}")
    for key, ids in (("FAIL_TO_PASS", f2p), ("PASS_TO_PASS", p2p)):
        bad = [t for t in ids if "::" not in t]
        if bad:
            raise _bad(
                iid,
                key,
                f"ids must be pytest node ids 'path::name' (the runners here report those), got {bad[:3]}",
            )
    if inst.get("runner") not in (None, "pytest", "mini"):
        raise _bad(iid, "runner", f"must be 'pytest' or 'mini', got {inst.get('runner')!r}")
    if inst.get("split") not in (None, *SPLITS):
        raise _bad(iid, "split", f"must be one of {SPLITS}, got {inst.get('split')!r}")
    return iid


# -- import ---------------------------------------------------------------------------------------
def _git(args: list[str], cwd: str, inp: bytes | None = None) -> bytes:
    # the ceiling keeps git from taking a repository above cwd for the one to work in
    env = {**os.environ, **_GIT_ENV, "GIT_CEILING_DIRECTORIES": os.path.dirname(os.path.abspath(cwd))}
    r = subprocess.run(["git", *args], cwd=cwd, input=inp, capture_output=True, timeout=300, env=env)
    if r.returncode != 0:
        why = r.stderr.decode(errors="replace").strip()[-400:]
        raise InstanceError(f"git {args[0]} failed in {cwd}: {why}")
    return r.stdout


def repo_source(inst: dict, base: str, repos_dir: str | None) -> str | None:
    """Where the instance's repository is on this machine (None: image only)."""
    iid = inst["instance_id"]
    if inst.get("repo_path"):
        p = inst["repo_path"]
        p = p if os.path.isabs(p) else os.path.join(base, p)
        if not os.path.isdir(p):
            raise _bad(iid, "repo_path", f"{p} is not a directory")
        return p
    if repos_dir:
        p = os.path.join(repos_dir, str(inst["repo"]).replace("/", "__"))
        if os.path.isdir(p):
            return p
    if inst.get("image_name"):
        return None
    raise _bad(
        iid,
        "repo",
        f"{inst['repo']!r}: no local repository (give repo_path, --repos DIR holding "
        f"{str(inst['repo']).replace('/', '__')}/, or an image_name)",
    )


def snapshot(src: str, commit: str, dest: str, iid: str = "") -> None:
    """dest = the tree of `commit` in the git repository `src` (no .git), or a copy of `src` when
    it is a plain directory (then it is the snapshot already)."""
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    if os.path.exists(os.path.join(src, ".git")) or os.path.isfile(os.path.join(src, "HEAD")):
        try:
            sha = _git(["rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"], src).decode().strip()
        except InstanceError:
            raise _bad(iid, "base_commit", f"{commit!r} is not a commit of the repository {src}") from None
        tar = _git(["archive", "--format=tar", sha], src)
        r = subprocess.run(["tar", "-x", "-C", dest], input=tar, capture_output=True, timeout=300)
        if r.returncode != 0:
            why = r.stderr.decode(errors="replace")[-300:]
            raise _bad(iid, "base_commit", f"{commit}: unpacking its tree from {src} failed: {why}")
    else:
        shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)


def _patch_entries(patch: str) -> list[list[str]]:
    """[old path, new path, kind] of each file of a git-format patch."""
    out, cur = [], None
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            m = re.match(r"diff --git a/(.+) b/(.+)$", line)
            if not m:
                raise InstanceError(f"has an unreadable header {line[:120]!r}")
            cur = [m.group(1), m.group(2), "modified"]
            out.append(cur)
        elif cur is not None and line.startswith("new file mode"):
            cur[2] = "new"
        elif cur is not None and line.startswith("deleted file mode"):
            cur[2] = "deleted"
    return out


def patch_files(patch: str) -> list[tuple[str, str]]:
    """(path, kind) of each file a git-format patch touches; kind "new" | "deleted" | "modified"."""
    return [(new, kind) for _, new, kind in _patch_entries(patch)]


def _inside(tree: str, rel: str) -> bool:
    if os.path.isabs(rel) or ".." in rel.split("/"):
        return False
    root = os.path.realpath(tree)
    return os.path.realpath(os.path.join(root, rel)).startswith(root + os.sep)


def apply_on_host(tree: str | None, patch: str, iid: str, field: str = "test_patch") -> dict[str, str]:
    """{path: text after the patch} of the files `patch` (the instance's `field`) creates or
    changes, applied on a scratch copy of just those files from `tree` (git apply refuses paths that
    leave the directory or go through links). A test_patch may not delete files."""
    try:
        entries = _patch_entries(patch)
    except InstanceError as e:
        raise _bad(iid, field, str(e)) from None
    if not entries:
        raise _bad(iid, field, "holds no file diff ('diff --git a/... b/...')")
    deleted = [new for _, new, k in entries if k == "deleted"]
    if deleted and field == "test_patch":
        raise _bad(iid, field, f"deletes {deleted}: hidden tests cannot express a deletion")
    with tempfile.TemporaryDirectory(prefix="swebench-") as tmp:
        for old, new, kind in entries:
            for p in (old, new):
                if not _inside(tmp, p):
                    raise _bad(iid, field, f"touches {p!r}, outside the repository")
            if kind == "new":
                continue
            src = os.path.join(tree, old) if tree else ""
            if not tree or not _inside(tree, old) or not os.path.isfile(src):
                note = "" if tree else " (image-only instances: new test files only)"
                raise _bad(iid, field, f"modifies {old}, which is not in the repository snapshot{note}")
            os.makedirs(os.path.dirname(os.path.join(tmp, old)) or tmp, exist_ok=True)
            shutil.copyfile(src, os.path.join(tmp, old))
        with open(os.path.join(tmp, ".asyncrl.patch"), "w", encoding="utf-8") as f:
            f.write(patch if patch.endswith("\n") else patch + "\n")
        try:
            _git(["apply", "--whitespace=nowarn", ".asyncrl.patch"], tmp)
        except InstanceError as e:
            why = "; ".join(str(e).split(": ", 1)[-1].splitlines())  # git's lines, on one
            raise _bad(iid, field, f"does not apply to the repository at base_commit: {why}") from None
        out = {}
        for _, p, kind in entries:
            if kind != "deleted":
                try:
                    with open(os.path.join(tmp, p), encoding="utf-8") as f:
                        out[p] = f.read()
                except UnicodeDecodeError:
                    raise _bad(iid, field, f"makes {p} a file that is not UTF-8 text") from None
        return out


def _check_test_ids(iid: str, snap: str | None, hidden: dict[str, str], f2p, p2p) -> None:
    """Every FAIL_TO_PASS / PASS_TO_PASS id names a test its file (test_patch over the snapshot)
    defines; a file of an image-only instance, not here to read, is taken on trust."""

    def text_of(path: str):
        if path in hidden:
            return hidden[path]
        if snap is None:
            return ELSEWHERE
        f = os.path.join(snap, path)
        if not _inside(snap, path) or not os.path.isfile(f):
            return None
        with open(f, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    for key, ids in (("FAIL_TO_PASS", f2p), ("PASS_TO_PASS", p2p)):
        bad = unknown_ids(ids, text_of)
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            named = "; ".join(f"{t} ({why})" for t, why in bad[:3])
            raise _bad(iid, key, f"names tests the test files do not contain: {named}{more}")


def instance_to_task(
    inst: dict, out_dir: str, base: str = ".", repos_dir: str | None = None, split: str = "train"
) -> EpisodeTask:
    """The EpisodeTask of one instance; its snapshot is written to out_dir/repos/<instance_id>
    (and removed again when the instance is refused)."""
    iid = check_instance(inst)
    f2p, p2p = test_list(inst, "FAIL_TO_PASS"), test_list(inst, "PASS_TO_PASS")
    src = repo_source(inst, base, repos_dir)
    snap = None if src is None else os.path.join(out_dir, "repos", iid)
    try:
        if snap is not None:
            snapshot(src, inst["base_commit"], snap, iid)
        hidden = apply_on_host(snap, inst["test_patch"], iid) if inst["test_patch"].strip() else {}
        if snap is not None and (inst.get("patch") or "").strip():
            apply_on_host(snap, inst["patch"], iid, field="patch")  # the gold fix applies
        _check_test_ids(iid, snap, hidden, f2p, p2p)
    except BaseException:
        if snap is not None:
            shutil.rmtree(snap, ignore_errors=True)
        raise
    test_paths = sorted({t.split("::", 1)[0] for t in f2p + p2p})
    keep = (
        "instance_id",
        "repo",
        "base_commit",
        "version",
        "environment_setup_commit",
        "patch",
        "test_patch",
        "image_name",
        "created_at",
    )
    meta = {"swebench": {k: inst[k] for k in keep if k in inst}}
    if inst.get("image_name"):
        meta["image"] = inst["image_name"]
    return EpisodeTask(
        task_id=iid,
        family=inst.get("family") or FAMILY,
        split=inst.get("split") or split,
        instruction=inst["problem_statement"],
        files={},
        hidden_tests=hidden,
        runner=inst.get("runner") or "pytest",
        test_paths=test_paths,
        fail_to_pass=f2p,
        pass_to_pass=p2p,
        base_dir=snap,
        meta=meta,
    )


@dataclasses.dataclass
class Imported:
    """What an import made of an instance file: the tasks, and each instance left out with why."""

    tasks: list[EpisodeTask]
    # {"instance": id (else "line N"), "where": "line N", "field": the field at fault or None, "reason"}
    skipped: list[dict]

    @property
    def total(self) -> int:
        return len(self.tasks) + len(self.skipped)


def import_each(
    path: str, out_dir: str, repos_dir: str | None = None, split: str = "train", envs: Builder | None = None
) -> Imported:
    """Every instance of `path` that can be used, as tasks (snapshots under out_dir/repos/); each
    one that cannot is skipped with the reason naming it and its field, and the rest still imported.
    With `envs`, each repository and version gets its environment (envs/repo_env.py, under
    out_dir/envs/), built from the first of its instances' snapshot; an instance whose environment
    cannot be built is skipped (field "environment"). A file that cannot be read at all raises
    (OSError, InstanceError)."""
    base = os.path.dirname(os.path.abspath(path))
    tasks, skipped, seen = [], [], {}

    def skip(where: str, e: Exception) -> None:
        inst = getattr(e, "instance", None) or where
        reason = str(e) if isinstance(e, InstanceError) and e.instance else f"{inst}: {e}"
        field = getattr(e, "field", None)
        skipped.append({"instance": inst, "where": where, "field": field, "reason": reason})

    for where, inst in iter_instances(path):
        if isinstance(inst, InstanceError):
            skip(where, InstanceError(f"{where}: {inst}", where))
            continue
        iid = inst.get("instance_id")
        if isinstance(iid, str) and iid in seen:
            why = f"repeats that of {seen[iid]} (the first of an id is the one read)"
            skip(where, _bad(iid, "instance_id", why))
            continue
        if isinstance(iid, str):
            seen[iid] = where
        try:
            check_instance(inst, where)
            task = instance_to_task(inst, out_dir, base, repos_dir, split)
            if envs is not None and task.base_dir:
                task = with_env(task, inst, envs)
            tasks.append(task)
        except InstanceError as e:
            skip(where, e)
        except (OSError, ValueError, subprocess.SubprocessError) as e:  # a copy or a git run gone wrong
            skip(where, InstanceError(f"{iid}: {e}", iid) if isinstance(iid, str) else e)
    return Imported(tasks, skipped)


def with_env(task: EpisodeTask, inst: dict, envs: Builder) -> EpisodeTask:
    """The task with its repository's environment (built the first time its key is met); when it
    cannot be built, the task's snapshot is removed and InstanceError names the instance and why."""
    version = inst.get("version")
    key = env_key(inst["repo"], None if version is None else str(version))
    try:
        env_dir = envs.for_repo(key, task.base_dir, {"repo": inst["repo"], "version": version})
    except EnvError as e:
        shutil.rmtree(task.base_dir, ignore_errors=True)
        raise InstanceError(f"{task.task_id}: {e}", task.task_id, "environment") from e
    return dataclasses.replace(task, env_dir=env_dir)


def import_instances(
    path: str, out_dir: str, repos_dir: str | None = None, split: str = "train", envs: Builder | None = None
) -> list[EpisodeTask]:
    """Every instance of `path` as tasks (snapshots under out_dir/repos/), all or nothing: the first
    instance that cannot be used raises InstanceError naming it (import_each skips it instead)."""
    got = import_each(path, out_dir, repos_dir, split, envs)
    if got.skipped:
        first = got.skipped[0]
        raise InstanceError(first["reason"], first["instance"], first["field"])
    return got.tasks


# -- export ---------------------------------------------------------------------------------------
def gold_files(task: EpisodeTask) -> dict[str, str]:
    """{path: fixed text} of a task with a recorded mutation (generated repositories, packages)."""
    from .oracle import fix_block

    if "swebench" in task.meta:
        raise InstanceError(f"{task.task_id}: an imported instance: export its original line instead")
    path, search, replace = fix_block(task)
    return {path: task.files[path].replace(search, replace, 1)}


def _write_tree(dest: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w", encoding="utf-8") as f:
            f.write(text)


def task_to_instance(task: EpisodeTask, out_dir: str) -> dict:
    """One task as an instance: out_dir/repos/asyncrl__<task_id> becomes a git repository whose one
    commit is the task's starting workspace (base_dir + files); `patch` undoes the injected bug,
    `test_patch` turns the workspace's test files into the hidden tests."""
    if not _SAFE_ID.match(task.task_id):
        raise InstanceError(f"task id {task.task_id!r} is not usable as an instance id")
    repo = f"asyncrl/{task.task_id}"
    dest = os.path.join(out_dir, "repos", repo.replace("/", "__"))
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    if task.base_dir:
        shutil.copytree(task.base_dir, dest, symlinks=True, dirs_exist_ok=True)
    _write_tree(dest, task.files)
    _git(["init", "-q", "-b", "main"], dest)
    _git(["add", "-A"], dest)
    _git(["commit", "-q", "--no-verify", "-m", f"{task.task_id}: starting workspace"], dest)
    base_commit = _git(["rev-parse", "HEAD"], dest).decode().strip()

    def diff_of(files: dict[str, str]) -> str:
        _write_tree(dest, files)
        _git(["add", "-A"], dest)
        d = _git(["diff", "--cached", "--binary", "HEAD"], dest).decode("utf-8")
        _git(["reset", "-q", "--hard", "HEAD"], dest)
        _git(["clean", "-q", "-fdx"], dest)
        return d

    patch = diff_of(gold_files(task))
    test_patch = diff_of(task.hidden_tests)
    return {
        "instance_id": task.task_id,
        "repo": repo,
        "base_commit": base_commit,
        "problem_statement": task.instruction,
        "patch": patch,
        "test_patch": test_patch,
        "FAIL_TO_PASS": list(task.fail_to_pass),
        "PASS_TO_PASS": list(task.pass_to_pass),
        "version": "0",
        "environment_setup_commit": base_commit,
        "hints_text": "",
        "created_at": "",
        "repo_path": os.path.relpath(dest, out_dir),
        "runner": task.runner,
        "split": task.split,
        "family": task.family,
    }


# what a played workspace holds that is no change of the agent's: caches its commands left behind
_NOT_CHANGES = ("__pycache__/", "*.pyc", ".pytest_cache/")


def workspace_patch(task: EpisodeTask, repo: str) -> str:
    """The agent's change as a SWE-bench `model_patch`: `git diff` of the played workspace `repo`
    against the task's starting workspace (base_dir + files), caches left out; "" when unchanged."""
    with tempfile.TemporaryDirectory(prefix="swebench-patch-") as tmp:
        dest = os.path.join(tmp, "repo")
        os.makedirs(dest)
        if task.base_dir:
            shutil.copytree(task.base_dir, dest, symlinks=True, dirs_exist_ok=True)
        _write_tree(dest, task.files)
        _git(["init", "-q", "-b", "main"], dest)
        _git(["config", "core.fileMode", "false"], dest)  # the sandbox's modes are no change
        with open(os.path.join(dest, ".git", "info", "exclude"), "a") as f:
            f.write("\n".join(_NOT_CHANGES) + "\n")
        _git(["add", "-A"], dest)
        _git(["commit", "-q", "--no-verify", "--allow-empty", "-m", "start"], dest)
        for name in os.listdir(dest):  # the played tree in place of the starting one
            if name != ".git":
                p = os.path.join(dest, name)
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
        for name in os.listdir(repo):
            if name == ".git":
                continue
            src, dst = os.path.join(repo, name), os.path.join(dest, name)
            if os.path.isdir(src) and not os.path.islink(src):
                shutil.copytree(src, dst, symlinks=True)
            else:
                shutil.copy2(src, dst, follow_symlinks=False)
        _git(["add", "-A"], dest)
        return _git(["diff", "--cached", "--binary", "HEAD"], dest).decode("utf-8", "replace")


def export_tasks(tasks: list[EpisodeTask], out_dir: str) -> tuple[str, list[str]]:
    """Write out_dir/instances.jsonl (+ repos/); returns (its path, notes on tasks left out: those
    without a gold patch). A real package's tasks share one repository (envs/package_repos.py);
    every other task is a repository of its own (task_to_instance)."""
    from .package_repos import is_package_task, package_instances

    os.makedirs(out_dir, exist_ok=True)
    lines, notes = [], []
    packages = [t for t in tasks if is_package_task(t)]
    try:  # a package's bugs: commits of one repository per package (envs/package_repos.py)
        insts, notes = package_instances(packages, out_dir)
        lines += [json.dumps(i, sort_keys=True) for i in insts]
    except (RuntimeError, ValueError, OSError) as e:
        notes += [f"{t.task_id}: left out: {e}" for t in packages]
    for t in (t for t in tasks if not is_package_task(t)):
        try:
            lines.append(json.dumps(task_to_instance(t, out_dir), sort_keys=True))
        except (InstanceError, ValueError, KeyError) as e:
            notes.append(f"{t.task_id}: left out: {e}")
    path = os.path.join(out_dir, "instances.jsonl")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + ("\n" if lines else ""))
    os.replace(path + ".tmp", path)
    return path, notes


# -- evaluate -------------------------------------------------------------------------------------
def _apply_command(name: str) -> str:
    # the harness's order: git apply, then the same with --reject... here: git apply, then patch(1)
    # with fuzz (SWE-bench's last resort); the patch file is removed either way
    return (
        f"(git apply --verbose --whitespace=nowarn {name} || patch --batch --fuzz=5 -p1 -i {name}) "
        f"> /dev/null 2>&1; rc=$?; rm -f {name}; echo APPLY_RC=$rc"
    )


def evaluate_patch(
    task: EpisodeTask, model_patch: str, limits: EpisodeLimits | None = None, backend=None
) -> dict:
    """The SWE-bench verdict of one prediction: {"instance_id", "resolved", "patch_applied",
    "empty_patch", "tests_status": {"FAIL_TO_PASS": {"success", "failure"}, "PASS_TO_PASS": ...},
    "reward", "detail"}. The patch is applied inside the task's workspace (the sandbox), the
    episode is submitted and scored with its hidden tests (Episode.score)."""
    out = {
        "instance_id": task.task_id,
        "resolved": False,
        "patch_applied": False,
        "empty_patch": not (model_patch or "").strip(),
        "reward": 0.0,
        "detail": "",
        "tests_status": {
            "FAIL_TO_PASS": {"success": [], "failure": list(task.fail_to_pass)},
            "PASS_TO_PASS": {"success": [], "failure": list(task.pass_to_pass)},
        },
    }
    if out["empty_patch"]:
        out["detail"] = "empty patch"
        return out
    name = f".asyncrl-{secrets.token_hex(6)}.patch"
    text = model_patch if model_patch.endswith("\n") else model_patch + "\n"
    ep = Episode(dataclasses.replace(task, files={**task.files, name: text}), limits, backend)
    try:
        ep.reset()
        if ep.done:  # the workspace could not be made
            out["detail"] = ep.detail
            return out
        res = ep.workspace.run(_apply_command(name), ep.limits.command)
        said = res.stdout.decode("utf-8", "replace")
        out["patch_applied"] = "APPLY_RC=0" in said
        if not out["patch_applied"]:
            out["detail"] = "patch does not apply" + ("" if "APPLY_RC=" in said else f" ({res.reason})")
            return out
        ep.step("```bash\nsubmit\n```")
        r = ep.score()
    finally:
        ep.close()
    for key, ids in (("FAIL_TO_PASS", task.fail_to_pass), ("PASS_TO_PASS", task.pass_to_pass)):
        out["tests_status"][key] = {
            "success": [t for t in ids if r.tests.get(t)],
            "failure": [t for t in ids if not r.tests.get(t)],
        }
    out.update(resolved=r.resolved, reward=r.reward, detail=r.detail)
    return out


def evaluate_predictions(
    tasks: list[EpisodeTask],
    predictions: list[dict],
    limits: EpisodeLimits | None = None,
    backend=None,
    skipped: dict[str, str] | None = None,
) -> dict:
    """A SWE-bench style report over `predictions` ({"instance_id", "model_patch", ...} each);
    a prediction for an unknown instance (`skipped`: {id: why} of instances the import left out),
    or without model_patch, is an error (listed, not scored)."""
    by_id = {t.task_id: t for t in tasks}
    skipped = skipped or {}
    results, errors = {}, {}
    for p in predictions:
        iid = p.get("instance_id")
        if iid in skipped:
            errors[str(iid)] = f"instance not imported: {skipped[iid]}"
        elif iid not in by_id:
            errors[str(iid)] = "unknown instance_id"
        elif not isinstance(p.get("model_patch", ""), (str, type(None))):
            errors[iid] = "model_patch must be a string"
        elif iid in results:
            errors[iid] = "more than one prediction"
        else:
            results[iid] = evaluate_patch(by_id[iid], p.get("model_patch") or "", limits, backend)
    ids = sorted(results)
    unresolved = [i for i in ids if not results[i]["resolved"] and not results[i]["empty_patch"]]
    return {
        "total_instances": len(tasks),
        "submitted_instances": len(predictions),
        "completed_instances": sum(not results[i]["empty_patch"] for i in ids),
        "resolved_instances": sum(results[i]["resolved"] for i in ids),
        "unresolved_instances": len(unresolved),
        "empty_patch_instances": sum(results[i]["empty_patch"] for i in ids),
        "error_instances": len(errors),
        "resolved_ids": [i for i in ids if results[i]["resolved"]],
        "unresolved_ids": unresolved,
        "empty_patch_ids": [i for i in ids if results[i]["empty_patch"]],
        "error_ids": sorted(errors),
        "errors": errors,
        "results": results,
    }
