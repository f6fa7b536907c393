"""A small SWE-bench-format instance file and the task set `asyncrl tasks import` makes of it, for
the `swe` env's tests: generated repositories (one validated bug each) exported as instances (the
gold patch in `patch`), then imported like any SWE-bench JSONL."""

from __future__ import annotations

import dataclasses
import os

from asyncrl.tasks import main as tasks_main
from envs import gen_repos, swebench
from envs.task_set import write_task_set

SPLITS = ("train", "train", "eval")


def imported_set(root: str, splits: tuple[str, ...] = SPLITS) -> tuple[str, dict[str, dict]]:
    """(task-set directory, {instance_id: instance}) of len(splits) instances, one per split given."""
    tasks = gen_repos.build(len(splits), seed=11, n_modules=1)
    assert len(tasks) == len(splits)
    tasks = [dataclasses.replace(t, split=s) for t, s in zip(tasks, splits)]
    write_task_set(os.path.join(root, "built"), tasks, {})
    assert tasks_main(["export", os.path.join(root, "built"), "--out", os.path.join(root, "exp")]) == 0
    jsonl = os.path.join(root, "exp", "instances.jsonl")
    assert tasks_main(["import", jsonl, "--out", os.path.join(root, "set")]) == 0
    return os.path.join(root, "set"), {i["instance_id"]: i for i in swebench.read_jsonl(jsonl)}


def fix_commands(task, instance: dict) -> list[str]:
    """The honest turns: write each file the gold patch changes (its patched text), then submit."""
    fixed = swebench.apply_on_host(task.base_dir, instance["patch"], task.task_id)
    assert fixed, instance["patch"]
    turns = [f"cat > {path} <<'GOLD_EOF'\n{text}GOLD_EOF" for path, text in sorted(fixed.items())]
    return turns + ["run_tests", "submit"]


def as_turn(command: str) -> str:
    return f"I apply the change.\n```bash\n{command}\n```"
