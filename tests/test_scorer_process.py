"""Scorer against a real nats-server: rewards, λ live from KV, bad input to DLQ, the real process."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys

import pytest

from bus import BusConfig, connect
from bus import topology as topo
from bus.control import format_lambda
from bus.events import Rollout, Scored, decode
from envs import get_env
from scorer.config import ScorerConfig
from scorer.service import Scorer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rollout(
    rid: str, text: str, env: str = "arith", spec: dict | None = None, max_tokens: int = 48
) -> Rollout:
    spec = {"a": 12, "b": 30, "answer": "42"} if spec is None else spec
    n = len(text) + 1
    return Rollout(
        rollout_id=rid,
        task_id=rid.split("-")[0],
        env=env,
        sample_index=0,
        group_size=1,
        prompt="12+30=",
        spec=spec,
        prompt_ids=[1, 2, 3],
        completion_ids=[5] * n,
        completion_text=text,
        logprobs=[-0.1] * n,
        token_versions=[0] * n,
        sampling={"max_tokens": max_tokens},
        sampling_mask={},
        quant={},
        finish_reason="stop",
        cost_tokens=n,
        wall_s=0.01,
        worker_id="w",
    )


async def drain(bus, stream: str, durable: str, want: int, timeout: float = 20.0) -> list:
    sub, got = await bus.pull(stream, durable), []
    deadline = asyncio.get_running_loop().time() + timeout
    while len(got) < want and asyncio.get_running_loop().time() < deadline:
        for m in await sub.fetch(want - len(got), timeout=0.5):
            got.append(m)
            await m.ack()
    return got


async def scored_events(bus, want: int) -> dict[str, Scored]:
    msgs = await drain(bus, topo.SCORED, topo.TRAINER_CONSUMER, want)
    return {(s := decode(m.data, Scored)).rollout["rollout_id"]: s for m in msgs}


async def score(bus, items: list[Rollout], **sections) -> tuple[dict[str, Scored], Scorer]:
    """Publish the rollouts, run a real Scorer (sections: its config's, {key: value}) until each is
    scored; -> the scored events by rollout id, the stopped scorer."""
    for r in items:
        await bus.publish(topo.rollout_subject(r.env), r)
    stop = asyncio.Event()
    cfg = ScorerConfig(bus=BusConfig(servers=bus.cfg.servers), run={"heartbeat_s": 0.2}, **sections)
    scorer = Scorer(cfg, bus=bus)
    run = asyncio.create_task(scorer.run(stop, handle_signals=False))
    try:
        return await scored_events(bus, len(items)), scorer
    finally:
        stop.set()
        await run


async def dlq_reasons(bus, want: int) -> list[str]:
    sub = await bus.js.pull_subscribe(topo.dlq_subject(topo.ROLLOUTS), durable=None, stream=topo.DLQ)
    out = []
    for _ in range(40):
        if len(out) >= want:
            break
        try:
            out += [m.headers["Rl-Reason"] for m in await sub.fetch(want - len(out), timeout=0.5)]
        except Exception:
            pass
    return out


async def test_scores_rewards_and_parks_bad_input(bus):
    await bus.kv_put(topo.KEY_LAMBDA, format_lambda(0.01))
    good = get_env("arith").demonstration({"a": 12, "b": 30, "answer": "42"}, "steps")
    items = [
        rollout("t1-0", good),
        rollout("t2-0", "#41"),
        rollout("t3-0", "garbage\x00no marker"),
        rollout("t4-0", "#1", env="no-such-env"),
        rollout("t5-0", "#1", spec={"answer": "x"}),
        rollout("t6-0", "def f(:", env="python-tests", spec={"entry": "f", "tests": [[[1], 1]]}),
    ]
    for r in items:
        await bus.publish(topo.rollout_subject(r.env), r)
    stop = asyncio.Event()
    scorer = Scorer(ScorerConfig(bus=BusConfig(servers=bus.cfg.servers), run={"heartbeat_s": 0.2}), bus=bus)
    run = asyncio.create_task(scorer.run(stop, handle_signals=False))
    try:
        s = await scored_events(bus, 4)
        reasons = await dlq_reasons(bus, 2)
    finally:
        stop.set()
        await run
    assert set(s) == {"t1-0", "t2-0", "t3-0", "t6-0"}
    ok = s["t1-0"]
    assert ok.success == 1.0 and ok.lambda_ == 0.01 and ok.cost == len(good) + 1
    assert ok.penalty == pytest.approx(0.01 * ok.cost) and ok.reward == pytest.approx(1 - 0.01 * ok.cost)
    assert s["t2-0"].success == 0.0 and "wrong answer 41 != 42" in s["t2-0"].reason
    assert s["t3-0"].success == 0.0 and "no final answer" in s["t3-0"].reason
    assert s["t6-0"].success == 0.0 and "SyntaxError" in s["t6-0"].reason and s["t6-0"].tool_calls == 1
    assert ok.get_rollout().rollout_id == "t1-0"
    assert any("unknown environment 'no-such-env'" in r for r in reasons)
    assert any("bad task spec" in r for r in reasons)
    info = await bus.js.consumer_info(topo.ROLLOUTS, topo.SCORER_CONSUMER)
    assert info.num_pending == 0 and info.num_ack_pending == 0  # nothing blocks the stream


async def test_lambda_change_is_live(bus):
    await bus.kv_put(topo.KEY_LAMBDA, format_lambda(0.001))
    stop = asyncio.Event()
    scorer = Scorer(
        ScorerConfig(bus=BusConfig(servers=bus.cfg.servers), reward={"overlong_buffer": 8}), bus=bus
    )
    run = asyncio.create_task(scorer.run(stop, handle_signals=False))
    try:
        await bus.publish(topo.rollout_subject("arith"), rollout("a1-0", "#42"))
        first = await scored_events(bus, 1)
        await bus.kv_put(topo.KEY_LAMBDA, format_lambda(0.05))
        await bus.kv_put(topo.KEY_LAMBDA, b"not a number")  # ignored, the last good λ stays
        for _ in range(100):
            if scorer.lam == 0.05:
                break
            await asyncio.sleep(0.05)
        await bus.publish(topo.rollout_subject("arith"), rollout("a2-0", "#42"))
        # 44 tokens with max 48 and buffer 8: overlong shaping 0.5 on top of λ·cost
        await bus.publish(topo.rollout_subject("arith"), rollout("a3-0", "x" * 40 + " #42"))
        second = await scored_events(bus, 2)
    finally:
        stop.set()
        await run
    assert first["a1-0"].lambda_ == 0.001 and first["a1-0"].reward == pytest.approx(1 - 0.001 * 4)
    assert second["a2-0"].lambda_ == 0.05 and second["a2-0"].reward == pytest.approx(1 - 0.05 * 4)
    long = second["a3-0"]
    assert long.cost == 45 and long.penalty == pytest.approx(0.05 * 45 + 0.625)
    assert (long.score, long.shaping) == (1.0, 0.625) and long.reward == 1.0 - (0.05 * 45 + 0.625)


def test_scorer_process_scores_and_drains_on_sigterm(fresh_server):
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "ASYNCRL_BUS__SERVERS": fresh_server.url,
        "ASYNCRL_RUN__HEARTBEAT_S": "0.5",
    }
    p = subprocess.Popen(
        [sys.executable, "-m", "scorer"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )

    async def check() -> dict:
        bus = await connect(BusConfig(servers=[fresh_server.url], name="t"))
        try:
            await bus.provision()
            await bus.publish(topo.rollout_subject("arith"), rollout("p1-0", "#42"))
            return await scored_events(bus, 1)
        finally:
            await bus.close()

    try:
        got = _run(check())
        assert got["p1-0"].success == 1.0 and got["p1-0"].scorer_id.startswith("scorer-")
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
    assert rc == 0, p.stderr.read().decode()[-2000:]


def _run(coro):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def test_two_scorers_share_the_work_and_crashes_park_in_dlq(bus):
    from envs.base import ENVS

    class Crashy:
        name = "crashy"

        def verify(self, text, spec):
            raise RuntimeError("verifier bug")

    ENVS["crashy"] = Crashy
    try:
        await bus.kv_put(topo.KEY_LAMBDA, format_lambda(0.0))
        rs = [rollout(f"m{i}-0", f"#{42 + i % 2}") for i in range(30)] + [rollout("c1-0", "#1", env="crashy")]
        await bus.publish_many([(topo.rollout_subject(r.env), r) for r in rs])
        stop = asyncio.Event()
        buses = [await connect(BusConfig(servers=bus.cfg.servers, name=f"s{i}")) for i in range(2)]
        scorers = [
            Scorer(
                ScorerConfig(
                    bus=BusConfig(servers=bus.cfg.servers),
                    scorer_id=f"s{i}",
                    run={"concurrency": 4, "heartbeat_s": 0.2},
                ),
                bus=b,
            )
            for i, b in enumerate(buses)
        ]
        runs = [asyncio.create_task(s.run(stop, handle_signals=False)) for s in scorers]
        try:
            msgs = await drain(bus, topo.SCORED, topo.TRAINER_CONSUMER, 31)
            reasons = await dlq_reasons(bus, 1)
        finally:
            stop.set()
            await asyncio.gather(*runs)
            for b in buses:
                await b.close()
        events = {(e := decode(m.data, Scored)).rollout["rollout_id"]: e for m in msgs}
        assert len(msgs) == 31 and sorted(events) == sorted(r.rollout_id for r in rs)  # each exactly once
        # the crash is published on its last delivery as an infrastructure failure (weight 0 in the
        # trainer, never a reward-0 sample), then parked for the operators
        assert events["c1-0"].infra == "scorer_crash" and "verifier bug" in events["c1-0"].reason
        assert all(e.infra == "" for k, e in events.items() if k != "c1-0")
        assert sum(s.counts["scored"] for s in scorers) == 30
        assert sum(s.infra.get("scorer_crash", 0) for s in scorers) == 1
        assert len(reasons) == 1 and "RuntimeError: verifier bug" in reasons[0]
        info = await bus.js.stream_info(topo.TELEMETRY, subjects_filter="rl.heartbeat.scorer.>")
        assert set(info.state.subjects or {}) >= {"rl.heartbeat.scorer.s0", "rl.heartbeat.scorer.s1"}
    finally:
        del ENVS["crashy"]


async def test_episode_infra_failures_and_tampered_verdicts_are_marked(bus):
    """An episode the sandbox failed is published with its reason (not as a policy failure); a
    tampered one scores 0 and is counted."""
    import msgspec

    base = rollout("e1-0", "x")
    eps = {
        "e1-0": {
            "reward": 0.0,
            "resolved": False,
            "detail": "sandbox error: setup",
            "infra_error": "sandbox",
        },
        "e2-0": {"reward": 0.0, "resolved": False, "detail": "tampered: x", "tampered": "report lines"},
        "e3-0": {"reward": 1.0, "resolved": True, "detail": ""},
    }
    items = [
        msgspec.structs.replace(
            base, rollout_id=k, task_id=k.split("-")[0], episode=v, termination="submitted"
        )
        for k, v in eps.items()
    ]
    got, scorer = await score(bus, items)
    assert got["e1-0"].infra == "sandbox" and not got["e1-0"].tampered
    assert got["e2-0"].tampered and got["e2-0"].infra == "" and got["e2-0"].success == 0.0
    assert got["e3-0"].infra == "" and not got["e3-0"].tampered and got["e3-0"].success == 1.0
    assert scorer.infra == {"sandbox": 1} and scorer.counts["tampered"] == 1 and scorer.counts["scored"] == 2


def test_bad_config_is_refused_clearly():
    from kernel import load_config

    for env in [
        {"ASYNCRL_REWARD__COST_UNIT": "dollars"},
        {"ASYNCRL_RUN__CONCURRENCY": "0"},
        {"ASYNCRL_REWARD__DEFAULT_LAMBDA": "-1"},
        {"ASYNCRL_REWARD__EPISODE_REWARD": "tests"},
    ]:
        with pytest.raises(ValueError, match="cost_unit|concurrency|default_lambda|episode_reward"):
            load_config(ScorerConfig, environ=env)
    cfg = load_config(
        ScorerConfig, environ={"ASYNCRL_REWARD__COST_UNIT": "wall_s", "ASYNCRL_SCORER_ID": "s9"}
    )
    assert cfg.reward.cost_unit == "wall_s" and cfg.bus.name == "s9"


async def test_episode_success_means_all_tests_pass_and_reward_is_the_fraction(bus):
    """An episode's Scored.success is 1 only when all its tests pass (as eval_success counts it);
    its reward is the fraction of tests passing minus λ·cost, so the trainer's success_mean and
    reward_mean are two different figures."""
    import msgspec

    await bus.kv_put(topo.KEY_LAMBDA, format_lambda(0.001))

    def episode(rid: str, result: dict) -> Rollout:
        return msgspec.structs.replace(
            rollout(rid, "x"),
            env="swe",
            turns=3,
            tool_calls=2,
            termination="submitted",
            episode={"detail": "", **result},
        )

    items = [
        episode("e1-0", {"reward": 0.5, "resolved": False}),
        episode("e2-0", {"reward": 1.0, "resolved": True}),
        episode("e3-0", {"reward": 0.75}),
    ]  # a result without `resolved`: all pass iff reward 1
    s, scorer = await score(bus, items)
    cost = items[0].cost_tokens
    assert [s[r].success for r in ("e1-0", "e2-0", "e3-0")] == [0.0, 1.0, 0.0]
    for rid, frac in (("e1-0", 0.5), ("e2-0", 1.0), ("e3-0", 0.75)):
        assert s[rid].reward == pytest.approx(frac - 0.001 * cost) and s[rid].cost == cost
        # the parts travel: the trainer's penalty modes start from the fraction, not from the price
        assert s[rid].score == frac and s[rid].shaping == 0.0 and s[rid].unpriced() == (frac, 0.0)
    assert scorer.counts["success_sum"] == 1.0


async def test_episode_reward_resolved_trains_on_success_alone(bus):
    """episode_reward = "resolved": an episode's reward is 1 (all tests pass) or 0, minus λ·cost; an
    untouched repository's fraction of passing tests no longer reaches the trainer."""
    import msgspec

    await bus.kv_put(topo.KEY_LAMBDA, format_lambda(0.001))
    items = [
        msgspec.structs.replace(
            rollout(rid, "x"),
            env="swe",
            turns=3,
            tool_calls=2,
            termination="submitted",
            episode={"detail": "", **res},
        )
        for rid, res in (
            ("r1-0", {"reward": 0.8, "resolved": False}),
            ("r2-0", {"reward": 1.0, "resolved": True}),
            ("r3-0", {"reward": 1.0}),
            ("r4-0", {"reward": 0.9}),
        )
    ]
    s, _ = await score(bus, items, reward={"episode_reward": "resolved"})
    cost = items[0].cost_tokens
    for rid, won in (("r1-0", 0.0), ("r2-0", 1.0), ("r3-0", 1.0), ("r4-0", 0.0)):
        assert s[rid].success == won and s[rid].reward == pytest.approx(won - 0.001 * cost)


async def test_the_task_spec_reward_mode_wins_and_an_unknown_one_is_parked(bus):
    """The `swe` env's tasks carry [trainer.tasks.swe] reward in their spec: the scorer scores each
    episode in that mode whatever its own episode_reward; a spec naming an unknown mode is parked."""
    import msgspec

    await bus.kv_put(topo.KEY_LAMBDA, format_lambda(0.0))

    def episode(rid: str, mode, result: dict) -> Rollout:
        spec = {"episode": {}, "limits": {}} | ({} if mode is None else {"reward": mode})
        return msgspec.structs.replace(
            rollout(rid, "x", env="swe", spec=spec), turns=2, termination="submitted", episode=result
        )

    items = [
        episode("m1-0", "resolved", {"reward": 0.8, "resolved": False}),
        episode("m2-0", "resolved", {"reward": 1.0, "resolved": True}),
        episode("m3-0", "fraction", {"reward": 0.8, "resolved": False}),
        episode("m4-0", None, {"reward": 0.8, "resolved": False}),  # none: the scorer's own mode
        episode("m5-0", "best", {"reward": 1.0, "resolved": True}),
    ]
    for r in items:
        await bus.publish(topo.rollout_subject(r.env), r)
    stop = asyncio.Event()
    cfg = ScorerConfig(
        bus=BusConfig(servers=bus.cfg.servers),
        run={"heartbeat_s": 0.2},
        reward={"episode_reward": "resolved"},
    )
    scorer = Scorer(cfg, bus=bus)
    run = asyncio.create_task(scorer.run(stop, handle_signals=False))
    try:
        s = await scored_events(bus, 4)
        reasons = await dlq_reasons(bus, 1)
    finally:
        stop.set()
        await run
    assert set(s) == {"m1-0", "m2-0", "m3-0", "m4-0"}
    got = {rid: s[rid].reward for rid in s}
    assert got == {"m1-0": 0.0, "m2-0": 1.0, "m3-0": pytest.approx(0.8), "m4-0": 0.0}, got
    assert len(reasons) == 1 and "reward mode 'best'" in reasons[0], reasons


async def test_run_ends_even_when_its_heartbeat_loses_a_cancel(bus):
    """Scorer.run ends its side tasks before returning. On Python 3.11 a cancel can be lost:
    nats-py's request (asyncio.wait_for) returns the pub-ack instead of raising when the cancel
    lands after the ack arrived but before the task resumed; a heartbeat that lost its cancel
    publishes on forever, and run() used to wait for it forever (a 300 s hang in make test).
    heartbeat_s=0 keeps a heartbeat publish in flight at every moment, and a cancel of run()
    at a random moment lands in that window in a good part of the stops (the stop event takes
    the same path, less often: there the last wake-up is the fetch's, phase-locked to the acks)."""
    rng = random.Random(7)
    leftovers: list[asyncio.Task] = []
    try:
        for i in range(25):
            scorer = Scorer(
                ScorerConfig(
                    bus=BusConfig(servers=bus.cfg.servers), run={"heartbeat_s": 0.0, "provision": False}
                ),
                bus=bus,
            )
            run = asyncio.create_task(scorer.run(asyncio.Event(), handle_signals=False))
            await asyncio.sleep(rng.uniform(0.05, 0.1))  # past startup: the heartbeat is publishing
            run.cancel()
            done, _ = await asyncio.wait({run}, timeout=5)
            leftovers = [t for t in asyncio.all_tasks() if "Scorer.heartbeat" in repr(t.get_coro())]
            assert done and not leftovers, (
                f"stop {i}: run() {'returned' if done else 'still waiting'}, "
                f"heartbeat tasks still running: {[t.cancelling() for t in leftovers]}"
            )
    finally:
        while leftovers:  # the old code's stuck heartbeats: don't let them outlive the test
            for t in leftovers:
                t.cancel()
            _, leftovers = await asyncio.wait(leftovers, timeout=0.2)
