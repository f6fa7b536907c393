"""mini-swe-agent (the PyPI package, unmodified, configured through its own config) as the harness:
its environment adapter runs commands in this project's sandboxed episode, and a full episode
against the worker's endpoint on a generated-repository task with the toy policy gives a rollout
whose model ids are exactly what the engine generated, observations masked, versions recorded."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from bus.events import SamplingParams, Task
from envs import gen_repos, mini_swe_agent
from envs.conversation import episode_spec
from envs.episode import Episode, EpisodeLimits
from rollout_worker.harness import HarnessRunner
from rollout_worker.torch_engine import TorchEngine
from tests.helpers.agentic import CFG, TOK, bug_task, no_special_state
from tests.helpers.engine import RecordingEngine


def test_adapter_runs_commands_in_the_episode_and_submits():
    from minisweagent.environments import get_environment
    from minisweagent.exceptions import Submitted

    ep = Episode(bug_task(), EpisodeLimits(max_turns=5))
    ep.reset()
    try:
        mini_swe_agent.register("adapter-1", ep)
        with pytest.raises(ValueError, match="already registered"):
            mini_swe_agent.register("adapter-1", ep)
        env = get_environment(
            {"environment_class": "envs.mini_swe_agent.SandboxEnvironment", "episode_id": "adapter-1"}
        )
        out = env.execute({"command": "cat calc.py && whoami"})
        assert "return a - b" in out["output"] and out["returncode"] == 0 and ep.tool_calls == 1
        assert ep.turns == 1 and not ep.done
        with pytest.raises(Submitted):
            env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})
        assert ep.termination == "submitted" and ep.score().reward == 0.0  # the bug is still there
    finally:
        mini_swe_agent.unregister("adapter-1")
        ep.close()
    with pytest.raises(ValueError, match="no live episode"):
        get_environment(
            {"environment_class": "envs.mini_swe_agent.SandboxEnvironment", "episode_id": "adapter-1"}
        )


def test_adapter_plays_a_swe_env_task_of_an_imported_set(tmp_path):
    """The `swe` env's task (an imported SWE-bench set, the config's limits and reward mode) through
    mini-swe-agent's environment: the honest commands resolve it (reward 1), none score 0."""
    from minisweagent.environments import get_environment
    from minisweagent.exceptions import Submitted

    from envs.episode import EpisodeTask
    from envs.swe_config import SweSection
    from envs.swe_env import configure
    from policy.reward import episode_score
    from tests.helpers.swe_sets import fix_commands, imported_set

    path, insts = imported_set(str(tmp_path))
    try:
        env = configure(SweSection(task_set=path, reward="resolved", limits={"max_turns": 5}))
        spec = env.split_specs("train")[0].spec
    finally:
        configure(None)
    task = EpisodeTask.from_dict(spec["episode"])
    for name, commands in (("honest", fix_commands(task, insts[task.task_id])[:-1]), ("empty", [])):
        ep = Episode(task, EpisodeLimits(**spec["limits"]))
        ep.reset()
        try:
            mini_swe_agent.register(f"swe-{name}", ep)
            agent_env = get_environment(
                {"environment_class": "envs.mini_swe_agent.SandboxEnvironment", "episode_id": f"swe-{name}"}
            )
            for command in commands:
                assert agent_env.execute({"command": command})["returncode"] == 0
            with pytest.raises(Submitted):
                agent_env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})
            got = episode_score(ep.score().to_dict(), spec["reward"])
            assert got == ((1.0, True) if name == "honest" else (0.0, False)), (name, got)
        finally:
            mini_swe_agent.unregister(f"swe-{name}")
            ep.close()


@pytest.fixture(scope="module")
def gen_task():
    return gen_repos.build(1, seed=2, n_modules=1)[0]


async def harness_worker(tmp_path, bus, fresh_server, worker_id: str):
    """(engine, recording engine, Worker) with [worker.harness] kind = "mini-swe-agent" and the
    harness's own config: every reply is the command (the random toy policy writes no ```bash
    block), three model calls an episode."""
    from bus import BusConfig
    from rollout_worker.config import WorkerConfig
    from rollout_worker.worker import Worker

    eng = TorchEngine(CFG, slots=2, max_len=2048, eos_id=TOK.eos_id, seed=9)
    await eng.load_keyframe(no_special_state(4), version=3, epoch=1)
    rec_eng = RecordingEngine(eng)
    conf = tmp_path / "mini.yaml"
    conf.write_text("agent:\n  step_limit: 3\nmodel:\n  action_regex: '\\A(.*)\\Z'\n")
    harness = {"kind": "mini-swe-agent", "config": str(conf)}
    cfg = WorkerConfig(bus=BusConfig(servers=[fresh_server.url]), worker_id=worker_id, harness=harness)
    return eng, rec_eng, Worker(cfg, bus, engine=rec_eng)


def episode_task(gen_task, task_id: str) -> Task:
    limits = EpisodeLimits(max_turns=6, max_turn_tokens=40, prompt_style="toy")
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=40, n=1)
    spec = episode_spec(gen_task, limits)
    return Task(task_id=task_id, env="swe-gen", prompt="", spec=spec, sampling=msgspec.structs.asdict(sp))


async def test_full_episode_through_mini_swe_agent(gen_task, tmp_path, bus, fresh_server):
    """[worker.harness] kind = "mini-swe-agent" in the worker's config: the real handler plays the task
    through the harness and publishes the rollout; the scorer and the trainer's batcher take it like
    any other."""
    from bus import BusConfig
    from scorer.config import ScorerConfig
    from scorer.service import Scorer
    from tests.helpers.trainer import trainer_config
    from trainer.batcher import Batcher, ConsumedIds
    from trainer.learner import pack

    eng, rec_eng, w = await harness_worker(tmp_path, bus, fresh_server, "w-msa")
    task = episode_task(gen_task, gen_task.task_id)
    try:
        await w.handle(task, ctx=None)
    finally:
        await w.episode_runner.close()
        await eng.close()
    assert w.rollouts == 1 and w.tasks_done == 1 and isinstance(w.episode_runner, HarnessRunner)
    stop = asyncio.Event()
    scorer = Scorer(
        ScorerConfig(bus=BusConfig(servers=[fresh_server.url]), reward={"cost_unit": "tokens"}), bus
    )
    st = asyncio.create_task(scorer.run(stop, handle_signals=False))
    b = Batcher(
        bus,
        trainer_config(fresh_server.url, tmp_path, batch={"groups": 1, "group_size": 1}),
        ConsumedIds(),
        TOK.vocab_size,
    )
    await b.start()
    batch = await b.next_batch(0, max_wait_s=30)
    stop.set()
    await st
    assert batch is not None and batch.rollout_ids == [f"{gen_task.task_id}-0"]
    r = batch.samples[0].rollout
    assert r.episode["harness_exit"]["exit_status"] == "LimitsExceeded", r.episode["harness_exit"]
    model = [t for t, m in zip(r.completion_ids, r.loss_mask) if m]
    assert len(rec_eng.gens) == 3 and model == [t for g in rec_eng.gens for t in g.completion_ids]
    assert [v for v, m in zip(r.token_versions, r.loss_mask) if m] == [3] * len(model)
    obs = [i for i, m in enumerate(r.loss_mask) if not m]
    assert obs and all(r.token_versions[i] == -1 and r.logprobs[i] == 0.0 for i in obs)
    assert r.loss_mask[-1] == 1 and r.turns == 3 and r.tool_calls == 3  # every command ran in the sandbox
    assert r.prompt_ids[:1] == [TOK.bos_id] and "USER:\n" in TOK.decode(r.prompt_ids)
    assert set(r.episode["tests"]) == set(gen_task.fail_to_pass + gen_task.pass_to_pass)  # hidden tests
    assert r.episode["trajectory"]["divergent_turns"] == 0 and r.episode["trajectory"]["restarts"] == 0
    assert eng.kept == {} and w.episode_runner.stats["episodes"] == 1
    assert w.snapshot()["episodes"]["divergent_turns"] == 0 and "restarts" in w.snapshot()["episodes"]
    assert batch.samples[0].scored.cost == float(len(model))
    assert sum(pack(batch)[0].loss_mask) == len(model)


def test_worker_config_refuses_bad_harness_settings(tmp_path):
    from rollout_worker.config import WorkerConfig
    from rollout_worker.harness import load_harness_config

    cases = (
        (dict(kind="openhands"), r"\[worker.harness\] kind: Input should be .*\(got 'openhands'\)"),
        (dict(endpoint_port=70000), "endpoint_port"),
        (dict(kind="mini-swe-agent", config=str(tmp_path / "none.yaml")), "not a file"),
    )
    for kw, why in cases:
        with pytest.raises(ValueError, match=why):
            WorkerConfig(worker_id="w", harness=kw)
    bad = tmp_path / "bad.yaml"
    bad.write_text("agentt:\n  step_limit: 3\n")
    with pytest.raises(ValueError, match="agent/model/environment"):
        load_harness_config(str(bad))
    assert WorkerConfig(worker_id="w", harness={"kind": "mini-swe-agent"}).harness.kind == "mini-swe-agent"


async def test_harness_episodes_do_not_starve_the_endpoint(gen_task, tmp_path, bus, fresh_server):
    """Harness runs block a thread each while they wait on the endpoint; with more of them in flight
    than the loop's default executor has threads, the endpoint must still answer them (its own
    tokenising threads, the harness's own pool): two episodes at once on a 1-thread default
    executor both finish, each with its three model calls."""
    from concurrent.futures import ThreadPoolExecutor

    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
    eng, rec_eng, w = await harness_worker(tmp_path, bus, fresh_server, "w-msa2")
    tasks = [episode_task(gen_task, f"{gen_task.task_id}-{k}") for k in "ab"]
    try:
        await asyncio.wait_for(asyncio.gather(*(w.handle(t, ctx=None) for t in tasks)), 90)
    finally:
        await w.episode_runner.close()
        await eng.close()
    assert w.rollouts == 2 and w.tasks_done == 2 and len(rec_eng.gens) == 6
