"""The worker's OpenAI-compatible endpoint (rollout_worker/openai_api.py) driven by the official
`openai` client on the torch engine: logprobs equal the trainer's replay on the same ids, the
trajectory is token-exact across turns (observations masked, harness edits counted, never
re-tokenised), a delta landing mid-turn shows two versions, streaming, /v1/completions, and bad
requests refused with a clear error and the episode untouched."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

import delta_codec
import policy
from rollout_worker.openai_api import OpenAIEndpoint
from rollout_worker.torch_engine import TorchEngine
from tests.helpers.agentic import CFG, TOK, no_special_state
from tests.helpers.engine import perturb

SYS = [{"role": "system", "content": "Fix the bug."}, {"role": "user", "content": "calc.py: add is wrong"}]


@pytest.fixture
async def served():
    state = no_special_state(3)
    eng = TorchEngine(CFG, slots=2, max_len=1024, eos_id=TOK.eos_id, seed=5)
    await eng.load_keyframe(state, version=0, epoch=1)
    ep = OpenAIEndpoint(eng, TOK, model_name="toy")
    url = await ep.start()
    client = openai.AsyncOpenAI(base_url=url, api_key=ep.token, max_retries=0)
    try:
        yield ep, eng, client, state
    finally:
        await client.close()
        await ep.close()
        await eng.close()


def replay_k3(state: dict, traj) -> float:
    """The trainer's replay (policy.sequence_logprobs with the shipped masks) over model tokens."""
    model = policy.Transformer(CFG).eval()
    model.load_inference_state(state)
    mask = policy.SamplingMask.from_rows(traj.rows)
    with torch.no_grad():
        r = policy.sequence_logprobs(
            model, [traj.prompt_ids], [traj.ids], policy.SamplingConfig(1.0, 1.0, 0), [mask]
        )
    behaviour = torch.tensor([traj.logprobs], dtype=torch.float64)
    valid = r.valid & torch.tensor([traj.mask], dtype=torch.bool)
    return policy.mismatch_metrics(behaviour, r.logprobs, valid)["k3_mean"], int(valid.sum())


async def test_chat_logprobs_equal_replay_and_turns_are_token_exact(served):
    ep, eng, client, state = served
    h = {"X-Episode-Id": "e1"}
    ep.open_episode("e1")  # as the worker does: the episode keeps its KV row between turns
    assert [m.id for m in (await client.models.list()).data] == ["toy"]
    r1 = await client.chat.completions.create(
        model="toy", messages=SYS, max_tokens=16, logprobs=True, extra_headers=h
    )
    c1 = r1.choices[0]
    assert len(c1.logprobs.content) == 16 and c1.finish_reason == "length"
    rec = ep.episodes["e1"]
    assert rec.traj.ids == c1.model_extra["token_ids"] and TOK.decode(rec.traj.ids) == c1.message.content
    assert [e.logprob for e in c1.logprobs.content] == rec.traj.logprobs
    # turn 2: the harness appends a tool output; it becomes observation ids after turn 1's ids
    conv = SYS + [
        {"role": "assistant", "content": c1.message.content},
        {"role": "user", "content": "ok\tdone"},
    ]
    r2 = await client.chat.completions.create(
        model="toy", messages=conv, max_tokens=12, logprobs=True, extra_headers=h
    )
    obs = TOK.encode("\n\nUSER:\nok?done\n\nASSISTANT:\n")  # (a tab is no char-model id: '?')
    t = rec.traj
    assert t.ids == c1.model_extra["token_ids"] + obs + r2.choices[0].model_extra["token_ids"]
    assert t.mask == [1] * 16 + [0] * len(obs) + [1] * 12
    assert t.versions == [0] * 16 + [-1] * len(obs) + [0] * 12
    assert rec.stats["replaced_chars"] == 1 and rec.stats["divergent_turns"] == 0
    k3, n = replay_k3(state, t)
    assert n == 28 and k3 <= 1e-6, k3
    # the same request again (a client retry): turn 2 is dropped and generated anew, the KV row too
    r2 = await client.chat.completions.create(
        model="toy", messages=conv, max_tokens=12, logprobs=True, extra_headers=h
    )
    assert rec.stats["retried_turns"] == 1 and rec.stats["restarts"] == 0
    assert t.ids == c1.model_extra["token_ids"] + obs + r2.choices[0].model_extra["token_ids"]
    assert t.mask == [1] * 16 + [0] * len(obs) + [1] * 12 and replay_k3(state, t)[0] <= 1e-6
    # turn 3: the harness strips turn 1's text: the generated ids stay, the drift is counted
    conv2 = conv + [
        {"role": "assistant", "content": r2.choices[0].message.content},
        {"role": "user", "content": "again"},
    ]
    conv2[2] = {"role": "assistant", "content": c1.message.content.strip() + "!"}
    before = list(t.ids)
    r3 = await client.chat.completions.create(model="toy", messages=conv2, max_tokens=4, extra_headers=h)
    assert t.ids[: len(before)] == before and rec.stats["divergent_turns"] == 1 and rec.stats["restarts"] == 0
    assert t.ids[-4:] == r3.choices[0].model_extra["token_ids"]
    # a history the sampler never continued (turn 2 dropped): a new trajectory, nothing trained twice
    r4 = await client.chat.completions.create(
        model="toy", messages=SYS[:1] + [{"role": "user", "content": "x"}], max_tokens=4, extra_headers=h
    )
    assert rec.stats["restarts"] == 1 and rec.stats["dropped_model_tokens"] == 12 + 32
    assert t is not rec.traj and rec.traj.ids == r4.choices[0].model_extra["token_ids"]


async def test_delta_mid_turn_shows_two_versions(served):
    ep, eng, client, state = served
    s1 = perturb(state, 0.3, 0.05, seed=1)
    ep.open_episode("hot")
    req = asyncio.create_task(
        client.chat.completions.create(
            model="toy", messages=SYS, max_tokens=120, logprobs=True, extra_headers={"X-Episode-Id": "hot"}
        )
    )
    while not any(len(s.tokens) >= 8 for s in eng.active.values()):
        await asyncio.sleep(0.002)
    await eng.apply_delta(delta_codec.encode_delta(state, s1, from_version=0, to_version=1), epoch=1)
    r = await req
    t = ep.episodes["hot"].traj
    k = t.versions.index(1)
    assert 8 <= k < 120 and t.versions == [0] * k + [1] * (120 - k)
    assert r.choices[0].model_extra["token_versions"] == t.versions
    conv = SYS + [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "go"},
    ]
    await client.chat.completions.create(
        model="toy", messages=conv, max_tokens=5, extra_headers={"X-Episode-Id": "hot"}
    )
    assert t.versions[-5:] == [1] * 5 and -1 in t.versions and 0 in t.versions
    assert list(eng.kept) == [ep.episodes["hot"].handle]  # turn 2 continued the kept sequence
    summary = await ep.end_episode("hot")
    assert summary.ended and eng.kept == {}  # the kept KV row is released at the end


async def test_streaming_completions_assignment_and_bad_requests(served):
    ep, eng, client, state = served
    stream = await client.chat.completions.create(
        model="toy", messages=SYS, max_tokens=10, stream=True, user="s1"
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == TOK.decode(ep.episodes["s1"].traj.ids) and len(ep.episodes["s1"].traj.ids) == 10
    # /v1/completions, text prompt then its continuation: the recorded text is matched, not re-tokenised
    c = await client.completions.create(model="toy", prompt="def add(a, b):", max_tokens=6, logprobs=1)
    raw = await client.completions.with_raw_response.create(model="toy", prompt="x", max_tokens=2)
    assert raw.headers["X-Episode-Id"].startswith("ep-")  # no id given: one is assigned
    want = TOK.encode("def add(a, b):", bos=True)
    eid = next(e for e, r in ep.episodes.items() if r.traj.prompt_ids == want)
    assert len(c.choices[0].logprobs.token_logprobs) == 6
    c2 = await client.completions.create(
        model="toy",
        prompt="def add(a, b):" + c.choices[0].text + "\n#",
        max_tokens=3,
        extra_headers={"X-Episode-Id": eid},
    )
    t = ep.episodes[eid].traj
    assert t.mask == [1] * 6 + [0, 0] + [1] * 3 and t.ids[-3:] == c2.choices[0].model_extra["token_ids"]
    # bad requests: a clear 400, the episode's trajectory unchanged
    before = (list(t.ids), ep.episodes[eid].stats["requests"])
    bad = [
        dict(messages=SYS, tools=[{"type": "function", "function": {"name": "bash"}}]),
        dict(messages=SYS, n=0),
        dict(messages=[]),
        dict(messages=SYS, temperature=-1),
        dict(messages=SYS, stop=[""]),
        dict(messages=SYS + [{"role": "wizard", "content": "x"}]),
        dict(messages=SYS, max_tokens=4000),
    ]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(
                model="toy", max_tokens=kw.pop("max_tokens", 3), **kw, extra_headers={"X-Episode-Id": eid}
            )
        assert e.value.status_code == 400 and len(str(e.value)) > 20, kw
    assert (list(t.ids), ep.episodes[eid].stats["requests"]) == before
    # the harness's explicit end: on_end runs once (the worker scores and publishes there)
    import httpx

    ended = []
    ep.episodes[eid].on_end = lambda rec: asyncio.sleep(0, ended.append(rec.episode_id))
    base = ep.url.rsplit("/v1", 1)[0]
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {ep.token}"}) as http:
        got = (await http.get(f"/v1/episodes/{eid}")).json()
        assert got["ids"] == t.ids and got["mask"] == t.mask and not got["ended"]
        for _ in range(2):
            res = await http.post(f"/v1/episodes/{eid}/end")
            assert res.status_code == 200 and res.json()["ended"] and res.json()["turns"] == 2
        assert (await http.post("/v1/episodes/nope/end")).status_code == 404
    assert ended == [eid]
    with pytest.raises(openai.BadRequestError, match="has ended"):
        await client.completions.create(
            model="toy", prompt="x", max_tokens=2, extra_headers={"X-Episode-Id": eid}
        )
