"""A task set on disk, as `asyncrl tasks build` writes it and the episode env reads it:

    DIR/manifest.json     {"format": 1, "tasks": N, "report": {...builder counts...}}
    DIR/tasks.jsonl       one EpisodeTask per line (base_dir relative to DIR)
    DIR/repos/NAME/       repository snapshots the package tasks start from

Nothing here touches the network: a built set is read as is.
"""

from __future__ import annotations

import json
import os

from .episode import SPLITS, EpisodeTask

FORMAT = 1


def write_task_set(out_dir: str, tasks: list[EpisodeTask], report: dict) -> str:
    """Write tasks.jsonl and manifest.json (atomically each); `base_dir`s must lie under out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    # the set holds every task's hidden tests and expected values: closed to other uids, so a
    # sandboxed command (a fresh unprivileged uid) cannot read the answers of its own task
    os.chmod(out_dir, 0o700)
    root = os.path.realpath(out_dir)
    lines = []
    for t in tasks:
        d = t.to_dict()
        if t.base_dir:
            real = os.path.realpath(t.base_dir)
            if not real.startswith(root + os.sep):
                raise ValueError(f"task {t.task_id}: base_dir {t.base_dir} is outside the task set {out_dir}")
            d["base_dir"] = os.path.relpath(real, root)
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
                if d.get("base_dir"):
                    d["base_dir"] = os.path.join(os.path.abspath(path), d["base_dir"])
                    if not os.path.isdir(d["base_dir"]):
                        raise ValueError(f"missing repository snapshot {d['base_dir']}")
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
