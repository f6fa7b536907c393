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
workspace backend runs it; then the test_patch may only create files). Further extensions this
project writes and reads (other tools ignore them): `runner` ("pytest" | "mini"), `split`,
`family`.

    task   = instance_to_task(inst, out_dir, repos_dir)   # EpisodeTask; snapshot in out_dir/repos/
    inst   = task_to_instance(task, out_dir)              # git repository out_dir/repos/<owner__name>
    result = evaluate_patch(task, model_patch)            # the SWE-bench verdict for one prediction

An imported task is an ordinary EpisodeTask: the workspace starts from the snapshot, the hidden
tests are the test_patch's files, and F2P + P2P are its tests. `evaluate_patch` scores a patch
the way the SWE-bench harness does (pristine snapshot + model patch, test patch over it, every
F2P and P2P test must pass: resolved) through envs.episode.Episode, i.e. the same scoring path
as every episode (the hidden tests run on a scoring copy, so the patch cannot touch them).
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

from .episode import SPLITS, Episode, EpisodeLimits, EpisodeTask

REQUIRED = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
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


class InstanceError(ValueError):
    """An instance (or prediction) that cannot be used, with the reason."""


# -- reading --------------------------------------------------------------------------------------
def read_jsonl(path: str) -> list[dict]:
    """Objects of a .jsonl file, or of a .json file holding a list (or a map id -> object, the
    form SWE-bench also accepts for predictions); a clear error naming the line otherwise."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        data = json.loads(text)
        if isinstance(data, dict):
            data = [{"instance_id": k, **v} for k, v in data.items()]
        if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
            raise InstanceError(f"{path}: expected a list of objects")
        return data
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise InstanceError(f"{path}:{n}: not JSON: {e}") from None
        if not isinstance(d, dict):
            raise InstanceError(f"{path}:{n}: expected an object, got {type(d).__name__}")
        out.append(d)
    return out


def test_list(inst: dict, key: str) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS as a list (the published datasets store a JSON string)."""
    v = inst.get(key, [])
    if isinstance(v, str):
        try:
            v = json.loads(v) if v.strip() else []
        except json.JSONDecodeError:
            raise InstanceError(
                f"{inst.get('instance_id')}: {key} is neither a list nor a JSON list"
            ) from None
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        raise InstanceError(f"{inst.get('instance_id')}: {key} must be a list of test ids")
    return v


def check_instance(inst: dict) -> None:
    missing = [k for k in REQUIRED if k not in inst]
    iid = inst.get("instance_id")
    if missing:
        raise InstanceError(f"instance {iid!r}: missing {missing}")
    if not isinstance(iid, str) or not _SAFE_ID.match(iid):
        raise InstanceError(f"instance_id {iid!r}: letters, digits, '_', '-', '.' only")
    tests = test_list(inst, "FAIL_TO_PASS") + test_list(inst, "PASS_TO_PASS")
    if not tests:
        raise InstanceError(f"{iid}: no FAIL_TO_PASS or PASS_TO_PASS tests")
    bad = [t for t in tests if "::" not in t]
    if bad:
        raise InstanceError(
            f"{iid}: test ids must be pytest node ids 'path::name' (the runners here report "
            f"those), got {bad[:3]}"
        )
    if inst.get("runner", "pytest") not in ("pytest", "mini"):
        raise InstanceError(f"{iid}: runner must be 'pytest' or 'mini', got {inst.get('runner')!r}")
    if inst.get("split", "train") not in SPLITS:
        raise InstanceError(f"{iid}: split must be one of {SPLITS}, got {inst.get('split')!r}")


# -- import ---------------------------------------------------------------------------------------
def _git(args: list[str], cwd: str, inp: bytes | None = None) -> bytes:
    r = subprocess.run(
        ["git", *args], cwd=cwd, input=inp, capture_output=True, timeout=300, env={**os.environ, **_GIT_ENV}
    )
    if r.returncode != 0:
        why = r.stderr.decode(errors="replace").strip()[-400:]
        raise InstanceError(f"git {args[0]} failed in {cwd}: {why}")
    return r.stdout


def repo_source(inst: dict, base: str, repos_dir: str | None) -> str | None:
    """Where the instance's repository is on this machine (None: image only)."""
    if inst.get("repo_path"):
        p = inst["repo_path"]
        p = p if os.path.isabs(p) else os.path.join(base, p)
        if not os.path.isdir(p):
            raise InstanceError(f"{inst['instance_id']}: repo_path {p} is not a directory")
        return p
    if repos_dir:
        p = os.path.join(repos_dir, str(inst["repo"]).replace("/", "__"))
        if os.path.isdir(p):
            return p
    if inst.get("image_name"):
        return None
    raise InstanceError(
        f"{inst['instance_id']}: no local repository for {inst['repo']!r} (give repo_path, "
        f"--repos DIR holding {str(inst['repo']).replace('/', '__')}/, or an image_name)"
    )


def snapshot(src: str, commit: str, dest: str) -> None:
    """dest = the tree of `commit` in the git repository `src` (no .git), or a copy of `src` when
    it is a plain directory (then it is the snapshot already)."""
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    if os.path.exists(os.path.join(src, ".git")) or os.path.isfile(os.path.join(src, "HEAD")):
        tar = _git(["archive", "--format=tar", commit], src)
        r = subprocess.run(["tar", "-x", "-C", dest], input=tar, capture_output=True, timeout=300)
        if r.returncode != 0:
            why = r.stderr.decode(errors="replace")[-300:]
            raise InstanceError(f"unpacking {commit} of {src} failed: {why}")
    else:
        shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)


def patch_files(patch: str) -> list[tuple[str, str]]:
    """(path, kind) of each file a git-format patch touches; kind "new" | "deleted" | "modified"."""
    out, cur = [], None
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            m = re.match(r"diff --git a/(.+) b/(.+)$", line)
            if not m:
                raise InstanceError(f"unreadable patch header {line!r}")
            cur = [m.group(2), "modified"]
            out.append(cur)
        elif cur is not None and line.startswith("new file mode"):
            cur[1] = "new"
        elif cur is not None and line.startswith("deleted file mode"):
            cur[1] = "deleted"
    return [(p, k) for p, k in out]


def apply_on_host(tree: str | None, patch: str, iid: str) -> dict[str, str]:
    """{path: text after the patch} of the files `patch` touches, applied on a scratch copy of just
    those files from `tree` (git apply refuses paths that leave the directory or go through links)."""
    files = patch_files(patch)
    if any(k == "deleted" for _, k in files):
        raise InstanceError(
            f"{iid}: the test_patch deletes {[p for p, k in files if k == 'deleted']}: "
            f"hidden tests cannot express a deletion"
        )
    with tempfile.TemporaryDirectory(prefix="swebench-") as tmp:
        for p, kind in files:
            src = os.path.join(tree, p) if tree else ""
            if kind == "modified":
                if not tree or not os.path.isfile(src):
                    note = "" if tree else " (image-only instances: new test files only)"
                    raise InstanceError(
                        f"{iid}: the test_patch modifies {p}, which is not in the repository snapshot{note}"
                    )
                os.makedirs(os.path.dirname(os.path.join(tmp, p)) or tmp, exist_ok=True)
                shutil.copyfile(src, os.path.join(tmp, p))
        with open(os.path.join(tmp, ".asyncrl.patch"), "w", encoding="utf-8") as f:
            f.write(patch if patch.endswith("\n") else patch + "\n")
        try:
            _git(["apply", "--whitespace=nowarn", ".asyncrl.patch"], tmp)
        except InstanceError as e:
            raise InstanceError(f"{iid}: the test_patch does not apply: {e}") from None
        out = {}
        for p, _ in files:
            with open(os.path.join(tmp, p), encoding="utf-8") as f:
                out[p] = f.read()
        return out


def instance_to_task(
    inst: dict, out_dir: str, base: str = ".", repos_dir: str | None = None, split: str = "train"
) -> EpisodeTask:
    """The EpisodeTask of one instance; its snapshot is written to out_dir/repos/<instance_id>."""
    check_instance(inst)
    iid = inst["instance_id"]
    f2p, p2p = test_list(inst, "FAIL_TO_PASS"), test_list(inst, "PASS_TO_PASS")
    src = repo_source(inst, base, repos_dir)
    snap = None
    if src is not None:
        snap = os.path.join(out_dir, "repos", iid)
        snapshot(src, str(inst["base_commit"]), snap)
    hidden = apply_on_host(snap, inst["test_patch"], iid) if inst["test_patch"].strip() else {}
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
        family=inst.get("family", FAMILY),
        split=inst.get("split", split),
        instruction=inst["problem_statement"],
        files={},
        hidden_tests=hidden,
        runner=inst.get("runner", "pytest"),
        test_paths=test_paths,
        fail_to_pass=f2p,
        pass_to_pass=p2p,
        base_dir=snap,
        meta=meta,
    )


def import_instances(
    path: str, out_dir: str, repos_dir: str | None = None, split: str = "train"
) -> list[EpisodeTask]:
    """Every instance of `path` as tasks (snapshots under out_dir/repos/); all or nothing: the
    first bad instance raises InstanceError naming it."""
    insts = read_jsonl(path)
    ids = [i.get("instance_id") for i in insts]
    dup = sorted({i for i in ids if ids.count(i) > 1}, key=str)
    if dup:
        raise InstanceError(f"{path}: duplicate instance ids {dup[:5]}")
    base = os.path.dirname(os.path.abspath(path))
    return [instance_to_task(i, out_dir, base, repos_dir, split) for i in insts]


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
    without a gold patch)."""
    os.makedirs(out_dir, exist_ok=True)
    lines, notes = [], []
    for t in tasks:
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
    tasks: list[EpisodeTask], predictions: list[dict], limits: EpisodeLimits | None = None, backend=None
) -> dict:
    """A SWE-bench style report over `predictions` ({"instance_id", "model_patch", ...} each);
    a prediction for an unknown instance, or without model_patch, is an error (listed, not scored)."""
    by_id = {t.task_id: t for t in tasks}
    results, errors = {}, {}
    for p in predictions:
        iid = p.get("instance_id")
        if iid not in by_id:
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
