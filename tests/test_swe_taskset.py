"""The `swe` env over an imported SWE-bench-format task set: its own split, every family, the limits,
prompt and reward mode of the run config ([trainer.tasks.swe]), played through the real turn loop
(envs/episode_play.py) and scored by the hidden tests; the config's limits bind; every bad setting
is refused before anything starts, naming the key or the path."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest

from asyncrl import config_check
from bus.events import Task
from envs import get_env
from envs.episode import (
    SYSTEM_PROMPT,
    TOY_SYSTEM_PROMPT,
    EpisodeLimits,
    EpisodeTask,
    initial_messages,
)
from envs.swe_config import SweSection
from envs.swe_env import TOY_LIMITS, SweEnv, configure
from kernel.config import ConfigError
from policy import CharTokenizer
from policy.reward import episode_score
from tests.helpers.swe_sets import fix_commands, imported_set, play
from trainer.config import TrainerConfig

TOK = CharTokenizer.default()
LIMITS = {"max_turns": 6, "turn_tokens": 4096, "command_wall_s": 20.0, "score_wall_s": 60.0}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    path, insts = imported_set(str(tmp_path_factory.mktemp("swe")))
    yield path, insts
    configure(None)  # later modules find `swe` unconfigured


def swe(path: str, **kw) -> SweEnv:
    return configure(SweSection(task_set=path, **{"limits": dict(LIMITS), **kw}))


async def test_every_instance_honest_resolves_empty_and_tampered_score_zero(imported):
    path, insts = imported
    env = swe(path, reward="resolved")
    assert get_env("swe") is env
    train, ev = env.tasks("train"), env.tasks("eval")
    assert len(train) == 2 and len(ev) == 1 and {t.task_id for t in train + ev} == set(insts)
    assert env.sample(random.Random(3), "eval").spec["episode"]["task_id"] == ev[0].task_id
    for ts in env.split_specs("train") + env.split_specs("eval"):
        spec = ts.spec
        lim = spec["limits"]
        assert spec["reward"] == "resolved" and lim["max_turns"] == 6 and lim["max_turn_tokens"] == 4096
        assert lim["command"]["wall_s"] == 20.0 and lim["score_wall_s"] == 60.0
        task = EpisodeTask.from_dict(spec["episode"])
        assert initial_messages(task, EpisodeLimits(**lim))[0]["content"] == SYSTEM_PROMPT
        inst = insts[task.task_id]
        log, honest = await play(spec, fix_commands(task, inst))
        assert honest.termination == "submitted" and honest.resolved, (honest.detail, log[-2:])
        assert episode_score(honest.to_dict(), spec["reward"]) == (1.0, True)
        _, empty = await play(spec, ["submit"])
        assert empty.termination == "submitted" and not empty.resolved
        assert episode_score(empty.to_dict(), spec["reward"]) == (0.0, False)
        # fraction mode: the share of tests passing (the pass-to-pass ones do), never a resolve
        assert 0.0 < episode_score(empty.to_dict(), "fraction")[0] == empty.reward < 1.0
        # the hack: the failing tests rewritten to pass; the hidden ones, from the snapshot, still fail
        f2p = task.fail_to_pass[0].split("::")[0]
        _, hack = await play(spec, [f"printf 'def test_ok():\\n    pass\\n' > {f2p}", "run_tests", "submit"])
        assert episode_score(hack.to_dict(), spec["reward"]) == (0.0, False), hack.detail


async def test_config_limits_bind(imported):
    path, insts = imported
    env = swe(path, limits={**LIMITS, "max_turns": 2})
    spec = env.split_specs("eval")[0].spec
    task = EpisodeTask.from_dict(spec["episode"])
    fix = fix_commands(task, insts[task.task_id])
    log, r = await play(spec, ["ls", "ls", *fix])  # the fix would come at turn 3
    assert r.termination == "max_turns" and r.turns == 2 and len(log) == 2 and r.reward < 1.0
    # the same turns under max_turns = 3: the fix runs at turn 3 and the episode resolves
    env = swe(path, limits={**LIMITS, "max_turns": 3})
    _, r = await play(env.split_specs("eval")[0].spec, ["ls", "ls", *fix])
    assert r.resolved and r.turns == 3 and r.termination == "max_turns"
    # tokens per turn: the fix's turn is longer than 64 tokens -> a format error, nothing runs
    env = swe(path, limits={**LIMITS, "turn_tokens": 64, "format_errors": 1})
    log, r = await play(env.split_specs("eval")[0].spec, fix)
    assert r.termination == "format" and r.tool_calls == 0 and not r.resolved
    assert "longer than 64 tokens" in log[0]["observation"]
    # a command's wall clock
    env = swe(path, limits={**LIMITS, "command_wall_s": 0.5})
    log, r = await play(env.split_specs("eval")[0].spec, ["sleep 30", "submit"])
    assert "command stopped" in log[0]["observation"] and r.tool_wall_s < 20, log[0]
    # the prompt of the config: the toy one
    env = swe(path, prompt="toy", test_output="failures")
    lim = EpisodeLimits(**env.split_specs("eval")[0].spec["limits"])
    assert initial_messages(task, lim)[0]["content"] == TOY_SYSTEM_PROMPT and lim.test_output == "failures"


def test_presets_are_task_sets_of_the_swe_env():
    from envs import base

    for name in ("swe-gen", "swe-demo"):
        e = base.ENVS[name]()  # fresh: get_env's shared ones read tasks/...
        assert isinstance(e, SweEnv) and e.limits == TOY_LIMITS and e.families == ("gen-repo",)
        assert e.reward is None and e.build is not None  # the scorer's episode_reward decides
    assert base.runs_code("swe")  # its episodes run the policy's commands: workers need the sandbox


def test_worker_refuses_a_snapshot_outside_its_task_set(imported, tmp_path):
    from rollout_worker.episodes import EpisodeRunner
    from rollout_worker.torch_engine import TorchEngine
    from tests.helpers.agentic import CFG

    path, _ = imported
    spec = swe(path).split_specs("train")[0].spec
    task = Task(task_id="t", env="swe", prompt="p", spec=spec, sampling={})
    eng = TorchEngine(CFG, slots=1, max_len=2048, eos_id=TOK.eos_id)
    EpisodeRunner(eng, TOK, task_set=path).parse(task)  # its own set: fine
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ValueError, match="outside this worker's task set"):
        EpisodeRunner(eng, TOK, task_set=str(other)).parse(task)


# -- bad inputs: a clear error naming the key or the path, before anything starts ---------------
def run_conf(path: str, swe_table: dict | None = None, worker: dict | None = None) -> dict:
    return {
        "trainer": {"tasks": {"envs": ["swe"], "swe": {"task_set": path, **(swe_table or {})}}},
        "worker": worker or {},
    }


@pytest.mark.parametrize(
    "limits, key",
    [
        ({"max_turns": 0}, "max_turns"),
        ({"max_turns": 5000}, "max_turns"),
        ({"turn_tokens": 0}, "turn_tokens"),
        ({"turn_tokens": 512, "context_tokens": 256}, "context_tokens"),
        ({"command_wall_s": 0.0}, "command_wall_s"),
        ({"command_cpu_s": 0}, "command_cpu_s"),
        ({"command_output_bytes": 10}, "command_output_bytes"),
        ({"score_wall_s": -1.0}, "score_wall_s"),
        ({"episode_wall_s": 0.0}, "episode_wall_s"),
        ({"format_errors": 0}, "format_errors"),
        ({"turns": 3}, "unknown key"),
    ],
)
def test_out_of_range_limits_are_refused_naming_the_field(imported, limits, key):
    path, _ = imported
    with pytest.raises(ConfigError, match=key) as e:
        config_check.resolve(run_conf(path, {"limits": limits}), environ={})
    assert "trainer.tasks.swe" in str(e.value) or "unknown key" in str(e.value)


@pytest.mark.parametrize("table, key", [({"reward": "best"}, "reward"), ({"prompt": "chatty"}, "prompt")])
def test_bad_reward_mode_or_prompt_refused(imported, table, key):
    with pytest.raises(ConfigError, match=rf"\[trainer.tasks.swe\] {key}: Input should be .*\(got '"):
        config_check.resolve(run_conf(imported[0], table), environ={})


def test_missing_empty_or_broken_task_set_refused_naming_the_path(tmp_path):
    with pytest.raises(ConfigError, match=r"task_set = '.*nope': no such directory"):
        config_check.resolve(run_conf(str(tmp_path / "nope")), environ={})
    with pytest.raises(ConfigError, match="task_set is empty"):
        config_check.resolve(run_conf(""), environ={})
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match="plain.*is not a task set"):
        config_check.resolve(run_conf(str(tmp_path / "plain")), environ={})
    # the same table without env "swe" among the envs: not read at all
    TrainerConfig(tasks={"envs": ["arith"], "swe": {"task_set": str(tmp_path / "nope")}})


def test_a_task_set_without_eval_tasks_is_refused(tmp_path):
    path, _ = imported_set(str(tmp_path), splits=("train", "train"))
    with pytest.raises(ConfigError, match=r"the eval split has no tasks \(2 train, 0 eval\)"):
        config_check.resolve(run_conf(path), environ={})
    env = SweEnv("swe", path)  # the env itself refuses it too (a set changed after the check)
    with pytest.raises(ValueError, match="both splits"):
        env.tasks("train")
    with pytest.raises(ValueError, match=r"has no task set: set \[trainer.tasks.swe\] task_set"):
        SweEnv("swe").tasks("train")


def test_trainer_and_worker_must_agree(imported, tmp_path):
    path, _ = imported
    # building the run's tree is the check (asyncrl.runconfig): what agrees builds, what does not is refused
    config_check.resolve(run_conf(path, worker={"episodes": {"task_set": path}}), environ={})
    with pytest.raises(ConfigError, match="task set disagrees"):
        config_check.resolve(run_conf(path, worker={"episodes": {"task_set": str(tmp_path)}}), environ={})
    with pytest.raises(ConfigError, match=r"\[worker.episodes\] task_set = '.*nowhere': no such directory"):
        config_check.resolve(run_conf(path, worker={"episodes": {"task_set": str(tmp_path / "nowhere")}}), {})
    long = run_conf(path, {"limits": {"turn_tokens": 4096}}, worker={"engine": {"max_len": 2048}})
    with pytest.raises(ConfigError, match=r"turn length disagrees.*turn_tokens = 4096.*2048"):
        config_check.resolve(long, environ={})


def test_scorer_reward_mode_comes_from_the_spec():
    r = {"reward": 0.5, "resolved": False}
    assert episode_score(r, "fraction") == (0.5, False) and episode_score(r, "resolved") == (0.0, False)
    assert episode_score({"reward": 1.0, "resolved": True}, "resolved") == (1.0, True)
    with pytest.raises(ValueError, match="reward mode"):
        episode_score(r, "best")


def test_spec_limits_round_trip(imported):
    """The limits a spec carries are what the config said (the worker rebuilds them from it)."""
    env = swe(imported[0], limits={**LIMITS, "command_cpu_s": 7, "command_output_bytes": 4096})
    lim = EpisodeLimits(**env.split_specs("eval")[0].spec["limits"])
    assert (lim.command.cpu_s, lim.command.keep_bytes, lim.command.wall_s) == (7, 4096, 20.0)
    assert dataclasses.replace(lim) == lim and os.path.isdir(imported[0])


def test_up_gives_the_workers_the_trainers_task_set(imported, monkeypatch, tmp_path):
    """`asyncrl up`: the workers' [worker.episodes] task_set is the trainer's (absolute: the
    children's working directory may differ), and the configs it starts agree."""
    from asyncrl.children import worker_episodes
    from kernel.config import merge

    path, _ = imported
    monkeypatch.chdir(os.path.dirname(path))
    conf = run_conf(os.path.basename(path))  # relative to the working directory
    tc = config_check.resolve(conf, environ={})["trainer"]
    episodes = worker_episodes(tc.tasks)
    assert episodes == {"envs": ["swe"], "task_set": os.path.abspath(path)}
    config_check.cross_check(config_check.resolve({**conf, "worker": {"episodes": episodes}}, environ={}))
    assert merge(worker_episodes(TrainerConfig().tasks), {"workspace": "docker"}) == {
        "envs": ["arith"],
        "workspace": "docker",
    }


UP_RUN = """
[up]
workers = 1
scorers = 1

[trainer.tasks]
envs = ["swe"]
backlog = 2
sampling = {temperature = 1.0, max_tokens = 32}

[trainer.tasks.swe]
task_set = "TASK_SET"
reward = "resolved"
prompt = "toy"
test_output = "failures"

[trainer.tasks.swe.limits]
max_turns = 2
turn_tokens = 32
command_wall_s = 10.0

[trainer.policy]
model = {preset = "tiny", max_seq_len = 1024}

[trainer.batch]
groups = 1
group_size = 2

[worker.engine]
slots = 4

[worker.run]
threads = 1
heartbeat_s = 1.0

[scorer.run]
heartbeat_s = 1.0
"""


async def test_asyncrl_up_trains_on_an_imported_task_set(imported, fresh_server, tmp_path):
    """`asyncrl up` with env "swe": the trainer samples the imported set's train split under the
    config's limits, the worker plays them (from the trainer's task set), the scorer scores them in
    the config's reward mode, versions advance, nothing is parked (a snapshot outside the workers'
    task set or an unknown reward mode would be)."""
    import json
    import subprocess
    import sys

    from asyncrl.report import read_jsonl
    from bus import BusConfig, connect
    from bus import topology as topo

    path, _ = imported
    cfg = tmp_path / "up.toml"
    cfg.write_text(UP_RUN.replace("TASK_SET", path))
    run_dir = tmp_path / "run"
    argv = ["up", "--config", str(cfg), "--steps", "2", "--minutes", "4", "--nats", fresh_server.url]
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", *argv, "--run-dir", str(run_dir), "--quiet"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["versions"] >= 2
    import tomllib

    worker = tomllib.loads((run_dir / "config" / "worker-0.toml").read_text())
    assert worker["episodes"]["task_set"] == os.path.abspath(path)  # the trainer's, given by up
    steps = [r for r in read_jsonl(run_dir / "metrics" / "trainer.jsonl") if "samples" in r]
    trained = {rid.rsplit("-", 1)[0] for r in steps for rid in r["rollout_ids"]}
    assert trained, steps
    episodes = [
        e
        for r in read_jsonl(next((run_dir / "metrics").glob("rollout_worker-*.jsonl")))
        for e in r.get("episodes_ended", [])
    ]
    assert episodes and all(e["turns"] <= 2 for e in episodes), episodes[:3]  # the config's max_turns
    assert {e["termination"] for e in episodes} <= {"max_turns", "format", "submitted", "context_limit"}
    bus = await connect(BusConfig(servers=[fresh_server.url], name="check"))
    try:
        assert (await bus.js.stream_info(topo.DLQ)).state.messages == 0
    finally:
        await bus.close()
