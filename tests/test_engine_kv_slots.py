"""Episodes waiting on slow commands (bench.agentic's long-tail workload): the torch engine's KV rows
(kv_slots) apart from its decode rows (slots), its decode loop asleep while every KV row is held
by an episode waiting on a command, and the episode runner freeing its KV row before scoring."""

from __future__ import annotations

import asyncio
import time

import pytest

from bus.events import SamplingParams, Task
from envs.episode import EpisodeLimits
from envs.sandbox import BashLimits
from envs.sandbox_latency import LatencyBackend, SandboxLatency
from envs.workspace import LocalBackend
from rollout_worker.episodes import EpisodeRunner, episode_spec
from rollout_worker.torch_engine import TorchEngine
from tests.helpers.agentic import CFG, TOK, bug_task, no_special_state

SP = SamplingParams(max_tokens=4, temperature=1.0)


class CountingEngine(TorchEngine):
    """The real engine, counting its decode-loop turns."""

    turns = 0

    def _turn(self, pending, admits):
        self.turns += 1
        return super()._turn(pending, admits)


async def engine(**kw) -> TorchEngine:
    eng = CountingEngine(CFG, **{"max_len": 256, "seed": 1, "eos_id": TOK.eos_id, **kw})
    await eng.load_keyframe(no_special_state(2), 1, 0)
    return eng


async def test_kept_sequences_hold_kv_rows_not_decode_rows():
    eng = await engine(slots=1, kv_slots=3)
    try:
        a = await eng.generate([1, 5, 6], SP, seed=1, keep=True)  # parked: waits on its "command"
        b = await eng.generate([1, 7, 8], SP, seed=2, keep=True)
        assert eng.free_slots == 1 and eng.stats()["kv_slots"] == 3
        # a third sequence and both continuations at once: one decode row, so one at a time
        gens = await asyncio.wait_for(
            asyncio.gather(
                eng.generate([1, 9, 9], SP, seed=3),
                eng.extend(a.handle, [10], SP),
                eng.extend(b.handle, [11], SP),
            ),
            60,
        )
        assert all(len(g.completion_ids) == 4 for g in gens)
        assert max(eng.metrics.occupancy) <= 1.0  # never more than `slots` decoding
        eng.release(a.handle)
        eng.release(b.handle)
        assert eng.free_slots == 3
    finally:
        await eng.close()
    with pytest.raises(ValueError, match="kv_slots"):
        TorchEngine(CFG, slots=4, kv_slots=2)


async def test_decode_loop_sleeps_while_every_kv_row_waits_on_a_command():
    eng = await engine(slots=1)
    try:
        a = await eng.generate([1, 5, 6], SP, seed=1, keep=True)  # its episode now runs a command
        waiting = asyncio.create_task(eng.generate([1, 7, 8], SP, seed=2))  # no KV row for it yet
        await asyncio.sleep(0.1)
        before = eng.turns
        await asyncio.sleep(0.5)
        assert eng.turns - before <= 2, f"{eng.turns - before} idle turns in 0.5 s: the decode loop spins"
        assert not waiting.done()
        eng.release(a.handle)  # the command ended: the row frees
        assert len((await asyncio.wait_for(waiting, 30)).completion_ids) == 4
    finally:
        await eng.close()


async def test_the_runner_frees_its_kv_row_before_the_scoring_run():
    eng = await engine(slots=1, max_len=2048)
    # the scoring run takes 1.5 s (a slow suite); the random model's episode ends by format
    runner = EpisodeRunner(
        eng, TOK, backend=LatencyBackend(LocalBackend(), SandboxLatency(median_s=1.5, p99_s=1.5))
    )
    limits = EpisodeLimits(max_turn_tokens=16, max_format_errors=2, command=BashLimits(wall_s=2.0))
    task = Task(
        task_id="ep",
        env="swe-gen",
        prompt="Fix calc.py.",
        spec=episode_spec(bug_task(), limits),
        sampling={"max_tokens": 16, "n": 1},
    )
    try:
        run = asyncio.create_task(runner.run(task, SamplingParams(max_tokens=16, n=1), 0))
        seen, t0 = [], time.monotonic()
        while not run.done() and time.monotonic() - t0 < 60:
            seen.append(eng.free_slots)
            await asyncio.sleep(0.02)
        r = await run
        assert r.termination == "format" and r.wall_s >= 1.5
        rec = runner.drain()[-1]  # the worker's episode record carries the modelled wait
        assert rec["suite_runs"] == 1 and rec["suite_wait_s"] == pytest.approx(1.5)
        assert 0 in seen  # the slot was held while the model decoded
        i = seen.index(0)
        assert 1 in seen[i:], "the KV row stayed held through the scoring run"
        # free for most of the 1.5 s scoring wait: another episode could decode meanwhile
        assert seen[i:].count(1) * 0.02 >= 0.5
    finally:
        await eng.close()
