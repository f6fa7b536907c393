"""Who may call the worker's endpoint ([worker.harness] endpoint_token_file, rollout_worker/openai_api.py),
on a real worker with [worker.harness] kind = "external" and two harness tokens: every route refuses a
missing or wrong bearer token (and the refused call changes nothing); an episode is open only to the
token that claimed it (another token gets the 404 of an id that does not exist); episode ids carry
128 random bits and logs name them by a prefix only; a claimer that hung up leaves its offer to the
next caller; a command no shell can run is a 400 naming the field with the episode as it was; the
end's result names no hidden test."""

from __future__ import annotations

import asyncio
import os
import re

import aiohttp
import openai
import pytest
from structlog.testing import capture_logs

from bus import BusConfig
from bus import topology as topo
from bus.events import Task
from bus.weights.publisher import WeightPublisher
from envs.episode import EpisodeLimits
from rollout_worker.config import WorkerConfig
from rollout_worker.endpoint_token import load_tokens
from rollout_worker.episodes import episode_spec
from rollout_worker.torch_engine import TorchEngine
from rollout_worker.worker import Worker
from tests.helpers.agentic import CFG, TESTS, TOK, bug_task, no_special_state
from tests.helpers.weights import until

TOKEN_A, TOKEN_B = "a" * 20 + "-harness-one", "b" * 20 + "-harness-two"
FIX = "rewrite calc.py <<'EOF'\ndef add(a, b):\n    return a + b\nEOF"


@pytest.fixture
async def served(bus, fresh_server, tmp_path):
    """A worker serving external harnesses, tokens A and B in its token file; -> (worker, base URL)."""
    pub = WeightPublisher(bus, epoch=1, trainer_id="t")
    await pub.publish_keyframe(no_special_state(4), 3, CFG)
    token_file = tmp_path / "endpoint.token"
    token_file.write_text(f"# two harnesses\n{TOKEN_A}\n{TOKEN_B}\n")
    token_file.chmod(0o600)
    wc = WorkerConfig(
        bus=BusConfig(servers=[fresh_server.url], name="w"),
        worker_id="w-auth",
        engine={"max_len": 2048},
        admission={"queue": 0},
        run={"heartbeat_s": 600.0, "grace_s": 2.0},
        harness={"kind": "external", "endpoint_token_file": str(token_file)},
    )
    eng = TorchEngine(CFG, slots=2, max_len=2048, eos_id=TOK.eos_id, seed=9)
    worker, stop = Worker(wc, bus, engine=eng), asyncio.Event()
    run = asyncio.create_task(worker.run(stop, handle_signals=False))
    await until(
        lambda: getattr(worker, "episode_runner", None) is not None and worker.episode_runner.endpoint.url,
        timeout=60,
    )
    try:
        yield worker, worker.episode_runner.endpoint.url.rsplit("/v1", 1)[0]
    finally:
        stop.set()
        await run


async def publish(bus, task_id: str) -> None:
    limits = EpisodeLimits(max_turns=6, max_turn_tokens=80, prompt_style="toy")
    await bus.publish(
        topo.task_subject("swe"),
        Task(
            task_id=task_id,
            env="swe",
            prompt="Fix calc.py.",
            spec=episode_spec(bug_task(), limits),
            sampling={"max_tokens": 12, "n": 1, "temperature": 1.0},
        ),
    )


def session(base: str, token: str | None) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(base, headers={"Authorization": f"Bearer {token}"} if token else {})


async def call(http, method: str, path: str, body=None, status: int = 200):
    kw = {"json": body} if isinstance(body, (dict, list)) else {"data": body} if body is not None else {}
    async with http.request(method, path, **kw) as r:
        got = await r.json() if r.content_type == "application/json" else None
        assert r.status == status, (method, path, body, r.status, got)
        return got


async def test_every_route_refuses_a_missing_or_wrong_token(bus, served):
    worker, base = served
    await publish(bus, "t1")
    ep = worker.episode_runner.endpoint
    await until(lambda: ep.board._ready, timeout=60)  # noqa: SLF001  (offered, nobody's yet)
    eid = next(iter(ep.board.offers))
    chat = {"model": "asyncrl-policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    routes = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
        ("POST", "/v1/episodes", {"wait_s": 0}),
        ("POST", f"/v1/episodes/{eid}/exec", {"command": "ls"}),
        ("POST", f"/v1/episodes/{eid}/end", None),
        ("GET", f"/v1/episodes/{eid}", None),
    ]
    wrong = [None, "", "wrong-token-wrong-token", TOKEN_A[:-1], TOKEN_A + "x", f"Basic {TOKEN_A}"]
    for cred in wrong:
        headers = (
            {} if cred is None else {"Authorization": cred if cred.startswith("Basic") else f"Bearer {cred}"}
        )
        async with aiohttp.ClientSession(base, headers=headers) as http:
            for method, path, body in routes:
                err = await call(http, method, path, body, 401)
                assert err["error"]["code"] == "invalid_api_key" and "bearer token" in err["error"]["message"]
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="not-the-token-at-all", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model="asyncrl-policy", messages=chat["messages"], max_tokens=2)
    await client.close()
    # nothing a refused call sent took effect: no ad-hoc episode, the offer still unclaimed
    assert list(ep.episodes) == [eid] and not ep.board.offers[eid].claimed.is_set()
    assert ep.stats["unauthorized"] == len(wrong) * len(routes) + 1
    async with session(base, TOKEN_B) as http:
        assert (await call(http, "POST", "/v1/episodes", {"wait_s": 30}))["episode_id"] == eid
        assert (await call(http, "GET", "/v1/models"))["data"][0]["id"] == "asyncrl-policy"


async def test_another_tokens_episode_is_unreadable_and_ids_are_128_bits_and_unlogged(bus, served):
    worker, base = served
    with capture_logs() as logs:
        await publish(bus, "t2")
        async with session(base, TOKEN_A) as a, session(base, TOKEN_B) as b:
            c = await call(a, "POST", "/v1/episodes", {"wait_s": 30})
            eid = c["episode_id"]
            assert re.fullmatch(r"ep-[0-9a-f]{32}", eid)  # 128 random bits
            client_a = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=TOKEN_A, max_retries=0)
            client_b = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=TOKEN_B, max_retries=0)
            r = await client_a.chat.completions.create(
                model=c["model"], messages=c["messages"], max_tokens=12, extra_headers=c["headers"]
            )
            snap = await call(a, "GET", f"/v1/episodes/{eid}")
            # token B: the episode does not exist for it, on every route
            assert "no " in (await call(b, "GET", f"/v1/episodes/{eid}", None, 404))["error"]["message"]
            await call(b, "POST", f"/v1/episodes/{eid}/exec", {"command": "ls"}, 404)
            await call(b, "POST", f"/v1/episodes/{eid}/end", None, 404)
            with pytest.raises(openai.NotFoundError):
                await client_b.chat.completions.create(
                    model=c["model"], messages=c["messages"], max_tokens=4, extra_headers=c["headers"]
                )
            assert await call(a, "GET", f"/v1/episodes/{eid}") == snap  # untouched
            # bad commands from the owner: 400 naming the field, the turn not spent
            for body, why in (
                (b'{"command": "echo a\\u0000b"}', "command: a NUL byte"),
                (b'{"command": "echo \\udcff"}', "command: a lone surrogate"),
                (b'{"command": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests deeper"),
            ):
                err = await call(a, "POST", f"/v1/episodes/{eid}/exec", body, 400)
                assert why in err["error"]["message"], err
            assert await call(a, "GET", f"/v1/episodes/{eid}") == snap
            fixed = await call(a, "POST", f"/v1/episodes/{eid}/exec", {"command": FIX})
            assert fixed["turn"] == 1 and fixed["exit_code"] == 0
            done = await call(a, "POST", f"/v1/episodes/{eid}/end")
            res = done["result"]
            assert res["reward"] == 1.0 and res["tests_passed"] == res["tests_total"] == 1
            assert "tests" not in res and "test_add" not in str(done) and TESTS not in str(done)
            # ended: its owner learns so (409), another token still sees nothing
            assert (
                "already ended"
                in (await call(a, "POST", f"/v1/episodes/{eid}/end", None, 409))["error"]["message"]
            )
            await call(b, "POST", f"/v1/episodes/{eid}/end", None, 404)
            assert r.choices[0].model_extra["token_ids"]
            await client_a.close()
            await client_b.close()
    await until(lambda: worker.tasks_done == 1)
    text = repr(logs)
    assert eid[:11] in text and eid not in text  # logs name the episode by its prefix only
    assert TOKEN_A not in text and TOKEN_B not in text


async def test_a_claimer_that_hung_up_leaves_the_offer_to_the_next_caller(bus, served):
    worker, base = served
    async with session(base, TOKEN_A) as a:  # an honest harness with a short client timeout
        with pytest.raises(asyncio.TimeoutError):
            await a.post("/v1/episodes", json={"wait_s": 30}, timeout=aiohttp.ClientTimeout(total=1))
    await publish(bus, "t3")  # offered after the first caller left, its claim still "waiting"
    async with session(base, TOKEN_B) as b:
        c = await call(b, "POST", "/v1/episodes", {"wait_s": 20})
    assert c["task_id"] == "t3"
    ep = worker.episode_runner.endpoint
    assert ep.board.offers[c["episode_id"]].owner == ep.episodes[c["episode_id"]].owner


def test_the_token_file_must_be_this_uids_and_private(tmp_path):
    f = tmp_path / "t"
    made = load_tokens(str(f))  # absent: made, 0600, a fresh 256-bit token
    assert f.stat().st_mode & 0o777 == 0o600 and len(made[0]) >= 43 and load_tokens(str(f)) == made
    f.chmod(0o644)
    with pytest.raises(ValueError, match="other users"):
        load_tokens(str(f))
    f.chmod(0o600)
    os.chown(f, 4242, 4242)
    with pytest.raises(ValueError, match="owned by uid 4242"):
        load_tokens(str(f))
    g = tmp_path / "short"
    g.write_text("short\n")
    g.chmod(0o600)
    with pytest.raises(ValueError, match="shorter than 16"):
        load_tokens(str(g))
    assert "endpoint_token_file" in WorkerConfig(harness={"kind": "external"}).harness.token_problem()
    assert not WorkerConfig(
        harness={"kind": "external", "endpoint_token_file": str(f)}
    ).harness.token_problem()


def test_a_non_loopback_bind_without_tls_is_a_config_check_warning(tmp_path):
    from asyncrl.config_check import resolve, warnings

    def warned(host: str) -> list[str]:
        conf = {"worker": {"harness": {"kind": "external", "endpoint_host": host}}}
        return [w for w in warnings(resolve(conf)) if "endpoint_host" in w]

    assert warned("127.0.0.1") == [] and warned("::1") == []
    (w,) = warned("0.0.0.0")
    assert "TLS" in w and "in clear" in w and "bind 127.0.0.1" in w
