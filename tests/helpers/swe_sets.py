"""A small SWE-bench-format instance file and the task set `asyncrl tasks import` makes of it, for
the `swe` env's tests: generated repositories (one validated bug each) exported as instances (the
gold patch in `patch`), then imported like any SWE-bench JSONL."""

from __future__ import annotations

import dataclasses
import os

from asyncrl.tasks import main as tasks_main
from envs import gen_repos, swebench
from envs.conversation import PlainFormat
from envs.episode import Episode, EpisodeLimits, EpisodeTask
from envs.episode_play import Turn, play_episode
from envs.episode_pool import InlinePool
from envs.task_set import write_task_set
from policy import CharTokenizer

TOK = CharTokenizer.default()

SPLITS = ("train", "train", "eval")


def exported_instances(root: str, splits: tuple[str, ...] = SPLITS) -> tuple[str, list[dict]]:
    """(instance file, its instances) of len(splits) generated-repository tasks, one per split
    given, exported as SWE-bench instances (each repository a git clone under root/exp/repos/)."""
    tasks = gen_repos.build(len(splits), seed=11, n_modules=1)
    assert len(tasks) == len(splits)
    tasks = [dataclasses.replace(t, split=s) for t, s in zip(tasks, splits)]
    write_task_set(os.path.join(root, "built"), tasks, {})
    assert tasks_main(["export", os.path.join(root, "built"), "--out", os.path.join(root, "exp")]) == 0
    jsonl = os.path.join(root, "exp", "instances.jsonl")
    return jsonl, swebench.read_jsonl(jsonl)


def imported_set(root: str, splits: tuple[str, ...] = SPLITS) -> tuple[str, dict[str, dict]]:
    """(task-set directory, {instance_id: instance}) of len(splits) instances, one per split given."""
    jsonl, insts = exported_instances(root, splits)
    assert tasks_main(["import", jsonl, "--out", os.path.join(root, "set")]) == 0
    return os.path.join(root, "set"), {i["instance_id"]: i for i in insts}


def fix_commands(task, instance: dict) -> list[str]:
    """The honest turns: write each file the gold patch changes (its patched text), then submit."""
    fixed = swebench.apply_on_host(task.base_dir, instance["patch"], task.task_id)
    assert fixed, instance["patch"]
    turns = [f"cat > {path} <<'GOLD_EOF'\n{text}GOLD_EOF" for path, text in sorted(fixed.items())]
    return turns + ["run_tests", "submit"]


def as_turn(command: str) -> str:
    return f"I apply the change.\n```bash\n{command}\n```"


class ScriptedPlayer:
    """A player whose turns are given: the turn loop, the episode and its scoring are the real ones."""

    def __init__(self, turns: list[str]):
        self.turns, self.n = list(turns), 0

    def start(self, ids):
        self.n = len(ids)

    async def turn(self) -> Turn:
        action = self.turns.pop(0) if self.turns else as_turn("submit")
        k = len(TOK.encode(action))
        self.n += k
        return Turn(action, k, "stop", False)

    def observe(self, ids):
        self.n += len(ids)

    def length(self) -> int:
        return self.n


async def play(spec: dict, commands: list[str], keep=None):
    """Play `commands` (one a turn) in the episode of a task spec through the turn loop; -> (turn
    log, EpisodeResult). `keep(episode)`: called once scored, before the workspace goes."""
    ep = Episode(EpisodeTask.from_dict(spec["episode"]), EpisodeLimits(**spec["limits"]))
    try:
        log = await play_episode(
            ep, InlinePool(), ScriptedPlayer([as_turn(c) for c in commands]), PlainFormat(), TOK, 1 << 16
        )
        result = ep.score()
        if keep is not None:
            keep(ep)
        return log, result
    finally:
        ep.close()
