"""A task set on disk, as `asyncrl tasks build` writes it and the episode env reads it:

    DIR/manifest.json     {"format": 1, "tasks": N, "report": {...builder counts...}}
    DIR/tasks.jsonl       one EpisodeTask per line (base_dir relative to DIR)
    DIR/repos/NAME/       repository snapshots the package tasks start from
    DIR/envs/KEY/         repository environments (envs/repo_env.py: site/ + manifest.json), one
                          per repository and version, shared by its tasks (env_dir relative to DIR)

Nothing here touches the network: a built set is read as is. `staged(DIR)` writes a set whole or
not at all (`asyncrl tasks import`: a failed or killed import leaves no half-written set).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

from .episode import SPLITS, EpisodeTask

FORMAT = 1


def write_task_set(out_dir: str, tasks: list[EpisodeTask], report: dict) -> str:
    """Write tasks.jsonl and manifest.json (atomically each); `base_dir`s and `env_dir`s must lie
    under out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    # the set holds every task's hidden tests and expected values: closed to other uids, so a
    # sandboxed command (a fresh unprivileged uid) cannot read the answers of its own task
    os.chmod(out_dir, 0o700)
    root = os.path.realpath(out_dir)
    lines = []
    for t in tasks:
        d = t.to_dict()
        for key in ("base_dir", "env_dir"):
            if d[key]:
                real = os.path.realpath(d[key])
                if not real.startswith(root + os.sep):
                    raise ValueError(f"task {t.task_id}: {key} {d[key]} is outside the task set {out_dir}")
                d[key] = os.path.relpath(real, root)
        lines.append(json.dumps(d, sort_keys=True))
    _atomic_write(os.path.join(out_dir, "tasks.jsonl"), "\n".join(lines) + ("\n" if lines else ""))
    _atomic_write(
        os.path.join(out_dir, "manifest.json"),
        json.dumps({"format": FORMAT, "tasks": len(tasks), "report": report}, indent=2, sort_keys=True),
    )
    return out_dir


def load_task_set(path: str, split: str | None = None, family: str | None = None) -> list[EpisodeTask]:
    """The tasks of a built set (optionally one split / family); a clear error for a broken set."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    man_path, tasks_path = os.path.join(path, "manifest.json"), os.path.join(path, "tasks.jsonl")
    if not os.path.exists(man_path) or not os.path.exists(tasks_path):
        raise FileNotFoundError(
            f"{path} is not a task set (no manifest.json / tasks.jsonl); "
            f"build one with `asyncrl tasks build --out {path}`"
        )
    with open(man_path) as f:
        man = json.load(f)
    if man.get("format") != FORMAT:
        raise ValueError(f"{path}: task set format {man.get('format')!r}, this code reads {FORMAT}")
    out = []
    with open(tasks_path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                for key, what in (("base_dir", "repository snapshot"), ("env_dir", "repository environment")):
                    if d.get(key):
                        d[key] = os.path.join(os.path.abspath(path), d[key])
                        if not os.path.isdir(d[key]):
                            raise ValueError(f"missing {what} {d[key]}")
                t = EpisodeTask.from_dict(d)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{tasks_path}:{n}: {e}") from e
            if (split is None or t.split == split) and (family is None or t.family == family):
                out.append(t)
    if len(out) != len({t.task_id for t in out}):
        raise ValueError(f"{tasks_path}: duplicate task ids")
    return out


def _atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


STAGE = ".{name}.writing-{pid}-"  # a set being written, beside the one it becomes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def staged(out_dir: str) -> Iterator[str]:
    """A task set written whole or not at all: yields an empty directory beside `out_dir` to write
    it in; when the block ends normally it takes `out_dir`'s place (an earlier set there goes),
    else it is removed and `out_dir` is as it was. A process killed mid-way leaves its stage, which
    the next write to the same `out_dir` removes. An `out_dir` that holds files but no task set is
    refused (ValueError): replacing it would lose them."""
    out_dir = os.path.abspath(out_dir)
    parent, name = os.path.dirname(out_dir), os.path.basename(out_dir)
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not _is_task_set(out_dir):
        raise ValueError(f"{out_dir} holds files but no task set (no manifest.json): not replacing it")
    os.makedirs(parent, exist_ok=True)
    prefix = STAGE.format(name=name, pid="")[:-1]  # up to the pid
    for old in os.listdir(parent):  # stages of killed writers
        pid = old[len(prefix) :].split("-", 1)[0]
        if old.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
            held = os.path.join(parent, old, name)  # killed between the two renames below
            if os.path.isdir(held) and not os.path.lexists(out_dir):
                os.rename(held, out_dir)
            shutil.rmtree(os.path.join(parent, old), ignore_errors=True)
    stage = tempfile.mkdtemp(prefix=STAGE.format(name=name, pid=os.getpid()), dir=parent)
    try:
        yield stage
        if not os.path.lexists(out_dir):
            os.rename(stage, out_dir)
            return
        # a directory cannot be renamed over a full one: the old set steps aside first
        gone = tempfile.mkdtemp(prefix=STAGE.format(name=name, pid=os.getpid()), dir=parent)
        os.rename(out_dir, os.path.join(gone, name))
        try:
            os.rename(stage, out_dir)
        except BaseException:
            os.rename(os.path.join(gone, name), out_dir)
            raise
        shutil.rmtree(gone, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _is_task_set(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "manifest.json"))
