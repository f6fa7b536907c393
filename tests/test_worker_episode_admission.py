"""A worker admits episodes by its slots: an episode holds no engine slot while its workspace is set
up, so admission by the engine's free slots alone let a worker of 8 slots run 40+ episodes at
once (bench.agentic: each got a fifth of a slot and hit the episode wall clock)."""

from __future__ import annotations

import asyncio

from bus import BusConfig
from bus import topology as topo
from bus.events import Task
from bus.weights.publisher import WeightPublisher
from envs.episode import EpisodeLimits
from envs.sandbox import BashLimits
from rollout_worker.config import WorkerConfig
from rollout_worker.episodes import episode_spec
from rollout_worker.worker import Worker
from tests.helpers.agentic import CFG, bug_task, no_special_state
from tests.helpers.weights import until


def max_overlap(spans: list[tuple[float, float]]) -> int:
    ev = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])  # an end sorts before a start
    n = best = 0
    for _, d in ev:
        n += d
        best = max(best, n)
    return best


async def play_four_tasks(bus, server, n: int, engine: dict, admission=None, episodes=None) -> Worker:
    """A worker (its sections' sizes) plays 4 episode tasks of n samples each (format errors end them
    fast) until done; -> the stopped worker, its episode records on its runner."""
    pub = WeightPublisher(bus, epoch=1, trainer_id="t")
    await pub.publish_keyframe(no_special_state(4), 0, CFG)
    # no heartbeat during the test: the episode records stay on the runner to be read here
    wc = WorkerConfig(
        bus=BusConfig(servers=[server.url], name="w"),
        worker_id="w1",
        engine={"max_len": 2048, **engine},
        admission={"queue": 0, **(admission or {})},
        episodes=episodes or {},
        run={"heartbeat_s": 600.0, "grace_s": 2.0},
    )
    worker, stop = Worker(wc, bus), asyncio.Event()
    run = asyncio.create_task(worker.run(stop, handle_signals=False))
    limits = EpisodeLimits(max_turn_tokens=16, max_format_errors=2, command=BashLimits(wall_s=2.0))
    for i in range(4):
        await bus.publish(
            topo.task_subject("swe"),
            Task(
                task_id=f"ep{i}",
                env="swe",
                prompt="Fix calc.py.",
                spec=episode_spec(bug_task(), limits),
                sampling={"max_tokens": 16, "n": n, "temperature": 1.0},
            ),
        )
    try:
        await until(lambda: worker.tasks_done == 4, timeout=120)
    finally:
        stop.set()
        await run
    return worker


async def test_episodes_in_flight_never_exceed_slots_plus_queue(bus, fresh_server):
    worker = await play_four_tasks(bus, fresh_server, 2, engine={"slots": 2})
    eps = worker.episode_runner.ended
    assert len(eps) == 8 and all(e["termination"] == "format" for e in eps)
    # each episode from its reset to its end: never more at once than the worker's 2 slots
    assert max_overlap([(e["ended_at"] - e["wall_s"], e["ended_at"]) for e in eps]) <= 2
    assert worker.episodes_in_flight == 0


async def test_max_inflight_lets_episodes_wait_on_slow_suites_beyond_the_decode_slots(bus, fresh_server):
    """One decode slot, max_inflight 3, a modelled 2 s suite per scoring run ([worker.episodes]
    sandbox_latency): episodes waiting on their suite hold no decode row, so up to 3 are in flight
    (with max_inflight = slots the worker ran them one by one)."""
    worker = await play_four_tasks(
        bus,
        fresh_server,
        1,
        engine={"slots": 1},
        admission={"max_inflight": 3},
        episodes={"sandbox_latency": {"median_s": 2.0, "p99_s": 2.0}},
    )
    eps = worker.episode_runner.ended
    assert len(eps) == 4 and all(e["termination"] == "format" and e["wall_s"] >= 2.0 for e in eps)
    assert 2 <= max_overlap([(e["ended_at"] - e["wall_s"], e["ended_at"]) for e in eps]) <= 3
    assert worker.engine.kv_slots == 3 and worker.engine.slots == 1
    assert worker.episode_runner.pool._ex._max_workers >= 3  # a thread per episode in flight
