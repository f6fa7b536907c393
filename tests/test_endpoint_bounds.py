"""What one caller may cost the worker's OpenAI-compatible endpoint (rollout_worker/openai_api.py,
[worker.harness.bounds]), on the real torch engine: ad-hoc recorders dropped and capped, a client that
sends half a header or half a body cut at its timeout, connections capped, max_tokens capped to the
episode's turn budget and `n` bounded, and malformed bodies (a lone surrogate, deep nesting, not
UTF-8, too large, too many messages) answered 4xx naming the field with the episode as it was. In
the built-in loop a command no shell can run (a sampled NUL) is an observation, not an exception."""

from __future__ import annotations

import asyncio
import json
import tracemalloc

import aiohttp
import openai
import pytest

from envs.episode import Episode, EpisodeLimits
from envs.workspace import LocalBackend
from rollout_worker.openai_api import OpenAIEndpoint
from rollout_worker.sections import EndpointBounds
from rollout_worker.torch_engine import TorchEngine
from tests.helpers.agentic import CFG, TOK, bug_task, no_special_state
from tests.helpers.engine import RecordingEngine

SYS = [{"role": "system", "content": "Fix the bug."}, {"role": "user", "content": "calc.py: add is wrong"}]


class SamplingSpy(RecordingEngine):
    """The torch engine, keeping the SamplingParams of every generation it was asked for."""

    def __init__(self, eng):
        super().__init__(eng)
        self.asked = []

    async def generate(self, ctx, sp, *a, **kw):
        self.asked.append(sp)
        return await super().generate(ctx, sp, *a, **kw)

    async def extend(self, handle, obs, sp, *a, **kw):
        self.asked.append(sp)
        return await super().extend(handle, obs, sp, *a, **kw)


@pytest.fixture
async def served(request):
    bounds = EndpointBounds(**getattr(request, "param", {}))
    eng = TorchEngine(CFG, slots=2, max_len=1024, eos_id=TOK.eos_id, seed=5)
    await eng.load_keyframe(no_special_state(3), version=0, epoch=1)
    spy = SamplingSpy(eng)
    ep = OpenAIEndpoint(spy, TOK, model_name="toy", bounds=bounds)
    url = await ep.start()
    base = url.rsplit("/v1", 1)[0]
    http = aiohttp.ClientSession(base, headers={"Authorization": f"Bearer {ep.token}"})
    client = openai.AsyncOpenAI(base_url=url, api_key=ep.token, max_retries=0)
    try:
        yield ep, spy, http, client
    finally:
        await client.close()
        await http.close()
        await ep.close()
        await eng.close()


async def post(http, path: str, data: bytes, status: int) -> dict:
    async with http.post(path, data=data, headers={"Content-Type": "application/json"}) as r:
        got = await r.json()
        assert r.status == status, (data[:80], r.status, got)
        return got


@pytest.mark.parametrize("served", [dict(max_adhoc_episodes=8)], indirect=True)
async def test_a_thousand_adhoc_requests_leave_bounded_recorders_and_memory(served):
    ep, _, http, _ = served
    body = {"model": "toy", "messages": SYS, "max_tokens": 1}
    tracemalloc.start()
    try:
        for i in range(1000):
            async with http.post("/v1/chat/completions", json={**body, "user": f"adhoc-{i}"}) as r:
                assert r.status == 200, await r.text()
            if i == 199:
                at_200 = tracemalloc.get_traced_memory()[0]
        grown = tracemalloc.get_traced_memory()[0] - at_200
    finally:
        tracemalloc.stop()
    assert len(ep.episodes) <= 8 and ep.stats["adhoc_dropped"] >= 992
    # 800 more requests held on to (almost) nothing: each recorder kept was ~kilobytes
    assert grown < 2 << 20, grown


@pytest.mark.parametrize("served", [dict(header_timeout_s=1.0, body_timeout_s=1.0)], indirect=True)
async def test_a_slow_client_is_cut_at_the_header_and_body_timeouts(served):
    ep, *_ = served
    host, port = ep.url.split("//")[1].split("/")[0].rsplit(":", 1)
    # half a header, then nothing: the connection is closed (not held forever)
    r, w = await asyncio.open_connection(host, int(port))
    w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    await w.drain()
    assert await asyncio.wait_for(r.read(), 30) == b""
    w.close()
    # the headers, then half the body: 408 and the connection closed
    r, w = await asyncio.open_connection(host, int(port))
    w.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + ep.token.encode()
        + b'\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"messages": ['
    )
    await w.drain()
    got = await asyncio.wait_for(r.read(), 30)
    assert got.startswith(b"HTTP/1.1 408") and b"body_timeout_s" in got, got[:300]
    w.close()
    assert ep.guard.stats["timed_out"] >= 1


@pytest.mark.parametrize("served", [dict(max_connections=4, header_timeout_s=60.0)], indirect=True)
async def test_connections_beyond_the_cap_are_closed_on_accept(served):
    ep, _, http, _ = served
    host, port = ep.url.split("//")[1].split("/")[0].rsplit(":", 1)
    held = [await asyncio.open_connection(host, int(port)) for _ in range(4)]
    await asyncio.sleep(0.2)
    r, w = await asyncio.open_connection(host, int(port))
    try:
        assert await asyncio.wait_for(r.read(), 30) == b""
    except ConnectionResetError:
        pass
    assert ep.guard.stats["refused"] >= 1
    for _, hw in held:  # the capped connections go: others get in again
        hw.close()
    await asyncio.sleep(0.5)
    async with http.get("/v1/models") as resp:
        assert resp.status == 200


async def test_max_tokens_is_capped_to_the_turn_budget_and_n_is_bounded(served):
    ep, spy, _, client = served
    ep.open_episode("capped", max_turn_tokens=5)
    r = await client.chat.completions.create(
        model="toy", messages=SYS, max_tokens=1000, extra_headers={"X-Episode-Id": "capped"}
    )
    assert [sp.max_tokens for sp in spy.asked] == [5]  # the engine was asked for the budget, no more
    assert len(r.choices[0].model_extra["token_ids"]) == 5
    with pytest.raises(openai.BadRequestError, match="n must be"):
        await client.chat.completions.create(
            model="toy", messages=SYS, max_tokens=2, n=5, extra_headers={"X-Episode-Id": "capped"}
        )
    assert len(spy.asked) == 1


@pytest.mark.parametrize("served", [dict(max_body_bytes=64 << 10, max_messages=16)], indirect=True)
async def test_malformed_bodies_are_4xx_naming_the_field_and_leave_the_episode(served):
    ep, spy, http, client = served
    rec = ep.open_episode("e1")
    await client.chat.completions.create(
        model="toy", messages=SYS, max_tokens=4, extra_headers={"X-Episode-Id": "e1"}
    )
    snap = (list(rec.traj.ids), list(rec.traj.mask), dict(rec.stats), len(spy.asked))
    deep = {"model": "toy", "messages": SYS, "metadata": {}}
    cur = deep["metadata"]
    for _ in range(40):
        cur["x"] = {}
        cur = cur["x"]
    bad = [
        # a lone surrogate (a \ud800 escape is valid JSON, not valid Unicode)
        (
            b'{"episode_id": "e1", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
            400,
            "messages[0].content: a lone surrogate",
        ),
        ("[" * 30_000 + "]" * 30_000, 400, "nests deeper"),
        (json.dumps({**deep, "episode_id": "e1"}), 400, "metadata.x.x"),
        (b'{"episode_id": "e1", "messages": "\xff\xfe"}', 400, "not UTF-8"),
        (b'{"episode_id": "e1", "messages": [', 400, "not JSON"),
        (json.dumps({"episode_id": "e1", "messages": SYS * 9}), 400, "max_messages 16"),
        (json.dumps({"episode_id": "e1", "messages": SYS, "pad": "x" * (70 << 10)}), 413, "max_body_bytes"),
        (json.dumps({"episode_id": "e1", "messages": SYS, "max_tokens": "many"}), 400, "max_tokens"),
    ]
    for data, status, why in bad:
        got = await post(
            http, "/v1/chat/completions", data if isinstance(data, bytes) else data.encode(), status
        )
        assert why in got["error"]["message"], (why, got)
    assert (list(rec.traj.ids), list(rec.traj.mask), dict(rec.stats), len(spy.asked)) == snap
    # and the episode goes on
    r = await client.chat.completions.create(
        model="toy", messages=SYS, max_tokens=3, extra_headers={"X-Episode-Id": "e1"}
    )
    assert len(r.choices[0].model_extra["token_ids"]) == 3


def test_a_command_no_shell_can_run_is_an_observation_in_the_builtin_loop():
    ep = Episode(bug_task(), EpisodeLimits(max_turns=6, prompt_style="toy"), LocalBackend())
    ep.reset()
    try:
        for bad, why in (("echo a\x00b", "NUL byte"), ("echo \udcff", "lone surrogate")):
            r = ep.step(f"```bash\n{bad}\n```")
            assert why in r.observation and "<returncode>126</returncode>" in r.observation and not r.done
        r = ep.step("```bash\necho fine\n```")
        assert "fine" in r.observation and r.info["exit_code"] == 0 and ep.turns == 3
    finally:
        ep.close()
