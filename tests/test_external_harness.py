"""Bring your own harness ([worker.harness] kind = "external", rollout_worker/external.py): a scripted
client claims episodes of the worker's task stream on its endpoint, plays model turns through the
official `openai` client and commands through /exec, and ends them. The Rollout published is the
token-exact trajectory (the engine's ids, observations masked, per-token versions across a weight
update); the reward is the hidden tests' verdict (an honest fix 1, a test-file tamper 0, a reported
reward refused); bad calls get a clear HTTP error and lose nothing; an episode abandoned past its
deadline is handed back and its task redelivered, trained once."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

import delta_codec
from bus import BusConfig
from bus import topology as topo
from bus.events import Rollout, Task, decode
from bus.weights.publisher import WeightPublisher
from envs.episode import EpisodeLimits, EpisodeTask
from rollout_worker.config import WorkerConfig
from rollout_worker.episodes import episode_spec
from rollout_worker.torch_engine import TorchEngine
from rollout_worker.worker import Worker
from tests.helpers.agentic import CFG, TESTS, TOK, bug_task, no_special_state
from tests.helpers.engine import RecordingEngine, perturb
from tests.helpers.weights import until
from tests.helpers.worker import read_stream

FIX = "rewrite calc.py <<'EOF'\ndef add(a, b):\n    return a + b\nEOF"
TAMPER = "cat > test_calc.py <<'EOF'\ndef test_add():\n    pass\nEOF"


@pytest.fixture
async def external(bus, fresh_server, request, tmp_path):
    """A worker with [worker.harness] kind = "external" (external_deadline_s: the indirect parameter,
    default 60) on version 3 of the toy policy; -> (worker, recording engine, publisher, state,
    aiohttp, openai)."""
    pub = WeightPublisher(bus, epoch=1, trainer_id="t")
    state = no_special_state(4)
    await pub.publish_keyframe(state, 3, CFG)
    eng = RecordingEngine(TorchEngine(CFG, slots=2, max_len=2048, eos_id=TOK.eos_id, seed=9))
    wc = WorkerConfig(
        bus=BusConfig(servers=[fresh_server.url], name="w"),
        worker_id="w-ext",
        engine={"max_len": 2048},
        admission={"queue": 0},
        run={"heartbeat_s": 600.0, "grace_s": 2.0},
        harness={
            "kind": "external",
            "external_deadline_s": getattr(request, "param", 60.0),
            "endpoint_token_file": str(tmp_path / "endpoint.token"),  # made with a fresh token
        },
    )
    worker, stop = Worker(wc, bus, engine=eng), asyncio.Event()
    run = asyncio.create_task(worker.run(stop, handle_signals=False))
    await until(
        lambda: getattr(worker, "episode_runner", None) is not None and worker.episode_runner.endpoint.url,
        timeout=60,
    )
    url = worker.episode_runner.endpoint.url
    token = (tmp_path / "endpoint.token").read_text().strip()  # as a user's harness finds it
    http = aiohttp.ClientSession(url.rsplit("/v1", 1)[0], headers={"Authorization": f"Bearer {token}"})
    client = openai.AsyncOpenAI(base_url=url, api_key=token, max_retries=0)
    try:
        yield worker, eng, pub, state, http, client, (stop, run)
    finally:
        await client.close()
        await http.close()
        stop.set()
        await run


async def publish(bus, task_id: str, n: int = 1) -> None:
    limits = EpisodeLimits(max_turns=6, max_turn_tokens=80, prompt_style="toy")
    await bus.publish(
        topo.task_subject("swe"),
        Task(
            task_id=task_id,
            env="swe",
            prompt="Fix calc.py.",
            spec=episode_spec(bug_task(), limits),
            sampling={"max_tokens": 12, "n": n, "temperature": 1.0},
        ),
    )


async def call(http, path: str, body=None, status: int = 200):
    kw = {"json": body} if isinstance(body, (dict, list)) else {"data": body} if body is not None else {}
    async with http.post(path, **kw) as r:
        got = await r.json() if r.content_type == "application/json" else None
        assert r.status == status, (path, body, r.status, got)
        return got


async def chat(client, claim: dict, messages: list[dict]):
    r = await client.chat.completions.create(
        model=claim["model"], messages=messages, max_tokens=12, logprobs=True, extra_headers=claim["headers"]
    )
    return r.choices[0]


async def test_claim_play_end_publishes_the_token_exact_trajectory_scored_by_hidden_tests(bus, external):
    worker, eng, pub, state, http, client, _ = external
    for path in ("/v1/episodes/nope/end", "/v1/episodes/nope/exec"):
        err = await call(http, path, {"command": "ls"} if "exec" in path else None, 404)
        assert "no " in err["error"]["message"]
    assert await call(http, "/v1/episodes", {"wait_s": 0.2}, 204) is None  # nothing leased yet
    await publish(bus, "honest")
    c = await call(http, "/v1/episodes", {"wait_s": 30})
    eid = c["episode_id"]
    assert c["task_id"] == "honest" and c["headers"] == {"X-Episode-Id": eid} and c["deadline_s"] == 60.0
    assert [m["role"] for m in c["messages"]] == ["system", "user"] and "spec" not in c
    assert "hidden" not in str(c) and TESTS not in str(c)  # the hidden tests never leave the worker
    n0 = len(eng.gens)
    c1 = await chat(client, c, c["messages"])
    fixed = await call(http, f"/v1/episodes/{eid}/exec", {"command": FIX})
    assert fixed["exit_code"] == 0 and not fixed["done"] and fixed["turn"] == 1, fixed
    # a weight update between the turns: the second turn's tokens carry version 4
    await pub.publish_delta(
        delta_codec.encode_delta(state, perturb(state, 0.3, 0.05, seed=1), from_version=3, to_version=4)
    )
    await until(lambda: eng.version == 4)
    conv = c["messages"] + [
        {"role": "assistant", "content": c1.message.content},
        {"role": "user", "content": fixed["observation"]},
    ]
    c2 = await chat(client, c, conv)
    # bad calls: a clear error, the episode as it was
    snap = await (await http.get(f"/v1/episodes/{eid}")).json()
    bad = [
        (f"/v1/episodes/{eid}/end", {"reward": 1.0}, 400, "hidden tests"),
        (f"/v1/episodes/{eid}/end", b"{not json", 400, "not JSON"),
        (f"/v1/episodes/{eid}/end", {"reason": 7}, 400, "reason must be"),
        (f"/v1/episodes/{eid}/exec", {"cmd": "ls"}, 400, "unknown field"),
        (f"/v1/episodes/{eid}/exec", {"command": " "}, 400, "non-empty"),
        ("/v1/episodes", {"wait_s": -1}, 400, "wait_s"),
        ("/v1/episodes", [1], 400, "JSON object"),
    ]
    for path, body, status, why in bad:
        err = await call(http, path, body, status)
        assert why in err["error"]["message"], (path, body, err)
    assert (await (await http.get(f"/v1/episodes/{eid}")).json()) == snap and not snap["ended"]
    done = await call(http, f"/v1/episodes/{eid}/end", {"reason": "my harness is done"})
    assert done["result"]["reward"] == 1.0 and done["result"]["resolved"] and done["ended"]
    again = await call(http, f"/v1/episodes/{eid}/end", None, 409)  # ending twice
    assert "already ended" in again["error"]["message"] and again["error"]["result"]["reward"] == 1.0
    err = await call(http, f"/v1/episodes/{eid}/exec", {"command": "ls"}, 409)
    assert "ended" in err["error"]["message"]
    with pytest.raises(openai.ConflictError):
        await chat(client, c, conv)
    gens = eng.gens[n0:]
    # the cheat: the harness rewrites the visible tests; the hidden ones, from a pristine tree, fail
    await publish(bus, "cheat")
    k = await call(http, "/v1/episodes", {"wait_s": 30})
    await chat(client, k, k["messages"])
    assert (await call(http, f"/v1/episodes/{k['episode_id']}/exec", {"command": TAMPER}))["exit_code"] == 0
    assert (
        "1 passed"
        in (await call(http, f"/v1/episodes/{k['episode_id']}/exec", {"command": "run_tests"}))["observation"]
    )
    # submit: the workspace ends the episode, scored as by /end
    sub = await call(http, f"/v1/episodes/{k['episode_id']}/exec", {"command": "submit"})
    assert sub["done"] and sub["termination"] == "submitted" and sub["result"]["reward"] == 0.0
    err = await call(http, f"/v1/episodes/{k['episode_id']}/end", None, 409)
    assert "already ended" in err["error"]["message"]
    await until(lambda: worker.tasks_done == 2)
    rollouts = {r.task_id: r for r in await read_stream(bus, topo.ROLLOUTS, Rollout)}
    assert sorted(rollouts) == ["cheat", "honest"]
    assert rollouts["cheat"].episode["reward"] == 0.0 and not rollouts["cheat"].episode["resolved"]
    r = rollouts["honest"]
    assert r.episode["reward"] == 1.0 and r.episode["harness"] == "external" and r.tool_calls == 1
    assert [g.completion_ids for g in gens] == [c1.model_extra["token_ids"], c2.model_extra["token_ids"]]
    n1, n2 = (len(g.completion_ids) for g in gens)
    obs = TOK.encode("\n\nUSER:\n" + fixed["observation"].replace("\t", "?") + "\n\nASSISTANT:\n")
    prompt = "".join(f"{m['role'].upper()}:\n{m['content']}\n\n" for m in c["messages"]) + "ASSISTANT:\n"
    assert r.prompt_ids == TOK.encode(prompt, bos=True)
    assert r.completion_ids == gens[0].completion_ids + obs + gens[1].completion_ids  # token-exact
    assert r.loss_mask == [1] * n1 + [0] * len(obs) + [1] * n2  # observations masked
    assert r.token_versions == [3] * n1 + [-1] * len(obs) + [4] * n2  # versions recorded
    assert r.logprobs == gens[0].logprobs + [0.0] * len(obs) + gens[1].logprobs
    info = await bus.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)
    assert info.num_ack_pending == 0 and info.num_pending == 0 and info.delivered.consumer_seq == 2
    assert worker.engine.kept == {} and worker.episode_runner.endpoint.episodes == {}


@pytest.mark.parametrize("external", [2.0], indirect=True)
async def test_an_abandoned_episode_expires_and_its_task_is_redelivered_and_trained_once(bus, external):
    worker, eng, _, _, http, client, (stop, run) = external
    await publish(bus, "abandoned", n=2)  # a group of 2: one claimed and abandoned, one never claimed
    c = await call(http, "/v1/episodes", {"wait_s": 30})
    eid = c["episode_id"]
    await chat(client, c, c["messages"])  # a turn played, then the harness goes away
    await until(lambda: worker.episode_runner.stats["expired"] == 1, timeout=10)
    for path, body in ((f"/v1/episodes/{eid}/end", None), (f"/v1/episodes/{eid}/exec", {"command": "ls"})):
        assert "expired" in (await call(http, path, body, 410))["error"]["message"]
    with pytest.raises(openai.APIStatusError) as e:  # never a fresh ad-hoc episode of the same id
        await chat(client, c, c["messages"])
    assert e.value.status_code == 410 and eid not in worker.episode_runner.endpoint.episodes
    # the stream redelivers the task whole (the unclaimed sibling went back with it): two fresh
    # episodes, played to their end
    ids, again = {}, []
    for _ in range(2):
        a = await call(http, "/v1/episodes", {"wait_s": 30})
        again.append(a)
        n0 = len(eng.gens)
        ids[a["sample_index"]] = (await chat(client, a, a["messages"])).model_extra["token_ids"]
        assert ids[a["sample_index"]] == eng.gens[n0].completion_ids
        assert (await call(http, f"/v1/episodes/{a['episode_id']}/end"))["result"]["reward"] == 0.0
    assert await call(http, "/v1/episodes", {"wait_s": 0.5}, 204) is None
    assert {a["task_id"] for a in again} == {"abandoned"} and {a["sample_index"] for a in again} == {0, 1}
    assert eid not in {a["episode_id"] for a in again}
    await until(lambda: worker.tasks_done == 1)
    rollouts = await read_stream(bus, topo.ROLLOUTS, Rollout)
    assert sorted(r.rollout_id for r in rollouts) == ["abandoned-0", "abandoned-1"]  # not lost, once each
    assert all(r.completion_ids == ids[r.sample_index] for r in rollouts)
    info = await bus.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)
    assert info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered == 0
    assert info.delivered.consumer_seq == 2  # delivered twice, acked once
    assert worker.engine.kept == {}
    # a worker that stops with an episode claimed hands its task back to the stream
    await publish(bus, "drained")
    d = await call(http, "/v1/episodes", {"wait_s": 30})
    await chat(client, d, d["messages"])
    stop.set()
    await run
    assert worker.episode_runner.stats["handed_back"] == 1
    msgs = await (await bus.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)).fetch(1, timeout=10)
    assert [decode(m.data, Task).task_id for m in msgs] == ["drained"]
    assert len(await read_stream(bus, topo.ROLLOUTS, Rollout)) == 2


async def test_a_swe_env_task_of_an_imported_set_played_by_the_harness(bus, external, tmp_path):
    """The `swe` env's tasks (an imported SWE-bench set, the run config's limits and reward mode):
    the harness's honest episode resolves (reward 1), its empty one scores 0."""
    from envs.swe_config import SweSection
    from envs.swe_env import configure
    from policy.reward import episode_score
    from tests.helpers.swe_sets import fix_commands, imported_set

    worker, *_, http, client, _ = external
    path, insts = imported_set(str(tmp_path / "swe"))
    limits = {"max_turns": 5, "turn_tokens": 1024, "context_tokens": 1900, "command_wall_s": 20.0}
    env = configure(SweSection(task_set=path, reward="resolved", prompt="toy", limits=limits))
    spec = env.split_specs("eval")[0].spec
    task = EpisodeTask.from_dict(spec["episode"])
    for name in ("honest", "empty"):
        await bus.publish(
            topo.task_subject("swe"),
            Task(task_id=name, env="swe", prompt="", spec=spec, sampling={"max_tokens": 12, "n": 1}),
        )
        c = await call(http, "/v1/episodes", {"wait_s": 30})
        assert (
            c["task_id"] == name and c["limits"]["max_turns"] == 5 and c["limits"]["max_turn_tokens"] == 1024
        )
        eid = c["episode_id"]
        await chat(client, c, c["messages"])  # the model's turn; the harness then runs its commands
        for command in fix_commands(task, insts[task.task_id])[:-1] if name == "honest" else []:
            assert (await call(http, f"/v1/episodes/{eid}/exec", {"command": command}))["exit_code"] == 0
        end = await call(http, f"/v1/episodes/{eid}/exec", {"command": "submit"})
        assert end["done"] and end["termination"] == "submitted", end
        assert episode_score(end["result"], spec["reward"]) == (
            (1.0, True) if name == "honest" else (0.0, False)
        )
    await until(lambda: worker.tasks_done == 2)
    configure(None)
    rollouts = {r.task_id: r for r in await read_stream(bus, topo.ROLLOUTS, Rollout)}
    assert rollouts["honest"].episode["resolved"] and not rollouts["empty"].episode["resolved"]
    assert rollouts["honest"].spec["reward"] == "resolved"  # the scorer scores it in the config's mode
