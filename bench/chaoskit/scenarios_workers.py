"""Scenarios that fault the rollout workers and scorers: SIGKILL and SIGSTOP mid-work, a crashing
weights feed, and a 10,000-task backlog met by a restarted worker."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import policy
from asyncrl.nats_server import EmbeddedServer
from bus import topology as topo
from bus.weights.publisher import WeightPublisher

from .books import row
from .fleet import Fleet, kill_and_replace, pipeline, wait_ready
from .observe import rss_mb, worker_beats
from .params import GROUP, MODEL, RATE
from .streams import stored_rollout_ids


async def kill_workers(run_dir: Path, tasks: int = 200, kills: int = 3, seed: int = 1) -> dict:
    """SIGKILL a random worker at random instants (a fresh one replaces it): every task trained
    once; recovery = kill -> every task delivered before the kill finished (ack floor)."""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            await pipeline(fleet, workers=3)
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            rng, recoveries, spawned = random.Random(seed), [], 3
            t0, span = time.monotonic(), tasks / RATE
            redelivered = 0
            for k in range(kills + 3):  # up to 3 extra kills if none hit a busy worker
                if k >= kills and redelivered:
                    break
                when = t0 + span * min(k + rng.random(), kills) / (kills + 1)  # random instants in the run
                await asyncio.sleep(max(0.0, when - time.monotonic()))
                if not await fleet.wait_held(topo.TASKS, topo.ROLLOUT_CONSUMER, at_least=3, until=feeding):
                    break  # the run is over: no later instant to kill at
                rec, n = await kill_and_replace(fleet, "rollout_worker", f"w{spawned}", rng)
                spawned += 1
                recoveries.append(rec)
                redelivered += n
            books = await fleet.wait_trained(ids, 600, feeding=feeding, watch=fleet.alive())
            rec = max(recoveries)
            # a kill that hit an idle worker proves nothing: at least one must have forced redelivery
            return row(
                "worker_sigkill",
                books,
                rec,
                rec <= fleet.ack_wait_s + 10 and redelivered > 0,
                kills=len(recoveries),
                redelivered=redelivered,
                recovery_s_all=[round(r, 2) for r in recoveries],
                target_s=fleet.ack_wait_s + 10,
            )
        finally:
            await fleet.close()


async def kill_scorer(run_dir: Path, tasks: int = 100, seed: int = 2, kills: int = 6) -> dict:
    """SIGKILL a scorer while rollouts are in flight (a fresh one replaces it), until a kill
    has forced a redelivery; the other scorer finishes the victim's rollouts."""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            await pipeline(fleet, workers=2, scorers=2)
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            rng, recoveries, spawned, redelivered = random.Random(seed), [], 2, 0
            for _ in range(kills):
                await asyncio.sleep(rng.uniform(0.2, 2.0))
                if not await fleet.wait_held(topo.ROLLOUTS, topo.SCORER_CONSUMER, until=feeding):
                    break
                rec, n = await kill_and_replace(fleet, "scorer", f"s{spawned}", rng)
                spawned += 1
                recoveries.append(rec)
                redelivered += n
                if redelivered:
                    break
            books = await fleet.wait_trained(ids, 600, feeding=feeding, watch=fleet.alive())
            rec = max(recoveries, default=float("nan"))
            return row(
                "scorer_sigkill",
                books,
                rec,
                rec <= fleet.ack_wait_s + 10 and redelivered > 0,
                kills=len(recoveries),
                redelivered=redelivered,
                target_s=fleet.ack_wait_s + 10,
            )
        finally:
            await fleet.close()


async def pause_worker(run_dir: Path, tasks: int = 100, seed: int = 6, tries: int = 4) -> dict:
    """SIGSTOP a worker while tasks are in flight, beyond ack_wait: its tasks are redelivered to
    the other worker and finished; after SIGCONT its late rollouts are dropped by Nats-Msg-Id
    dedupe (ROLLOUTS stores each rollout id once). Retried on the other worker until a pause
    has caught held tasks."""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            await pipeline(fleet, workers=2)
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            rng, redelivered, rec, paused_s = random.Random(seed), 0, float("nan"), 0.0
            for i in range(tries):
                await asyncio.sleep(rng.uniform(0.2, 2.0))
                if not await fleet.wait_held(topo.TASKS, topo.ROLLOUT_CONSUMER, at_least=3, until=feeding):
                    break
                victim = f"w{i % 2}"
                info = await fleet.consumer(topo.TASKS, topo.ROLLOUT_CONSUMER)
                fleet.signal(victim, signal.SIGSTOP)
                t_stop = time.monotonic()
                rec, redelivered = await fleet.wait_redelivered(
                    topo.TASKS, topo.ROLLOUT_CONSUMER, info, t_stop, fleet.ack_wait_s + 60
                )
                await asyncio.sleep(max(0.0, fleet.ack_wait_s + 1 - (time.monotonic() - t_stop)))
                paused_s = time.monotonic() - t_stop  # beyond ack_wait in any case
                fleet.signal(victim, signal.SIGCONT)
                if redelivered:
                    break
            books = await fleet.wait_trained(ids, 600, feeding=feeding, watch=fleet.alive())
            await asyncio.sleep(fleet.ack_wait_s)  # let the woken worker finish its late publishes
            # every rollout id is stored once in ROLLOUTS: the late copies were dropped by Nats-Msg-Id
            stored = (await fleet.bus.js.stream_info(topo.ROLLOUTS)).state.last_seq
            extra = stored - len(ids) * GROUP
            return row(
                "worker_sigstop",
                books,
                rec,
                rec <= fleet.ack_wait_s + 10 and extra == 0 and redelivered > 0,
                paused_s=round(paused_s, 2),
                pauses=i + 1,
                redelivered=redelivered,
                target_s=fleet.ack_wait_s + 10,
                rollouts_stored_twice=extra,
            )
        finally:
            await fleet.close()


async def worker_feed_crash(run_dir: Path, tasks: int = 60, seed: int = 12, fault_after: int = 3) -> dict:
    """A worker's weights feed raises at its `fault_after`-th update (the worker's one test hook);
    the worker restarts the feed with backoff, resyncs from the latest keyframe and is back on the
    latest version; every task trained exactly once. recovery_s: the feed's failure (its log
    line) -> the worker's heartbeat shows the latest version."""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            fleet.trainer("A")
            fleet.scorer("s0")
            fleet.worker("w0", faults={"weights_after": fault_after}, run={"restart_backoff_s": 0.5})
            fleet.worker("w1")
            await wait_ready(fleet, ["A", "s0", "w0", "w1"])
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            seen: dict = {}

            async def watch() -> None:  # failure (w0's log) -> first heartbeat on the latest version
                while "ok" not in seen:
                    log = fleet.procs["w0"].log_path.read_text(errors="replace")
                    if "fail" not in seen and "background task failed; restarting" in log:
                        seen["fail"] = time.time()
                    if "fail" in seen:
                        w = (await worker_beats(fleet)).get("w0", {})
                        if w.get("restarts", 0) >= 1 and w.get("version") == await fleet.version():
                            seen["ok"] = time.time()
                    await asyncio.sleep(0.25)

            watcher = asyncio.create_task(watch())
            books = await fleet.wait_trained(ids, 600, feeding=feeding, watch=fleet.alive())
            try:
                await asyncio.wait_for(watcher, 60)
            except TimeoutError:
                pass
            top = await fleet.version()
            w0 = (await worker_beats(fleet)).get("w0", {})
            failed = "fail" in seen
            rec = round(seen["ok"] - seen["fail"], 2) if "ok" in seen else None
            ok = (
                failed
                and rec is not None
                and w0.get("version") == top
                and w0.get("restarts", 0) >= 1
                and fleet.procs["w0"].popen.poll() is None
            )
            return row(
                "worker_feed_crash",
                books,
                rec if rec is not None else -1.0,
                ok,
                latest_version=top,
                worker_version=w0.get("version"),
                feed_restarts=w0.get("restarts"),
                fault_after=fault_after,
            )
        finally:
            await fleet.close()


async def backlog(run_dir: Path, tasks: int = 10_000, seed: int = 8, watch_s: float = 20.0) -> dict:
    """A worker runs, is stopped; 10,000 tasks queue up with no consumer; a worker restarted on
    that backlog holds only what its slots take, and its memory stays flat while it works."""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            cfg = policy.ModelConfig.preset(
                MODEL["preset"],
                vocab_size=policy.CharTokenizer.default().vocab_size,
                **{k: v for k, v in MODEL.items() if k != "preset"},
            )
            state = policy.inference_state(policy.Transformer(cfg))
            await WeightPublisher(fleet.bus, epoch=1, trainer_id="harness").publish_keyframe(state, 0, cfg)
            fleet.worker("w-old")  # a worker that was running, then stopped (drained)
            await wait_ready(fleet, ["w-old"])
            fleet.signal("w-old", signal.SIGTERM)
            fleet.procs["w-old"].popen.wait(60)
            ids: list[str] = []
            for _ in range(0, tasks, 1000):
                ids += await fleet.publish_tasks(min(1000, tasks - len(ids)))
            queued = (await fleet.bus.js.stream_info(topo.TASKS)).state.messages
            t_start = time.monotonic()
            fleet.worker("w0")
            await wait_ready(fleet, ["w0"])
            pid, t0 = fleet.procs["w0"].popen.pid, time.monotonic()
            ready_s = t0 - t_start  # restart -> serving, with 10,000 queued
            rss, held = [], []
            while time.monotonic() - t0 < watch_s:
                fleet.check_alive(["w0"])
                rss.append(rss_mb(pid))
                held.append((await fleet.consumer(topo.TASKS, topo.ROLLOUT_CONSUMER)).num_ack_pending)
                await asyncio.sleep(0.25)
            fleet.signal("w0", signal.SIGTERM)  # drain: held tasks finished or released
            fleet.procs["w0"].popen.wait(60)
            left = (await fleet.bus.js.stream_info(topo.TASKS)).state.messages
            rids = await stored_rollout_ids(fleet.bus)
            done = {r.rsplit("-", 1)[0] for r in rids}
            lost = tasks - left - len(done)
            cap = 8 + 4  # the worker's slots + queue (Fleet.worker)
            half = len(rss) // 2
            growth = max(rss[half:]) - max(rss[:half])  # second half vs first half of the watch
            ok = queued == tasks and max(held) <= cap and growth < 50 and lost == 0
            # no trainer runs here: this scenario measures the worker's memory and prefetch bound.
            # Its books come from the streams (tasks neither still queued nor finished), and
            # nothing is claimed about training (trained / duplicates_trained: None)
            return {
                "name": "backlog_10k",
                "tasks": tasks,
                "lost": lost,
                "duplicates_trained": None,
                "trained": None,
                "measures": "worker memory and prefetch bound under a 10k-task backlog "
                "(no trainer; lost = tasks neither queued nor finished)",
                "recovery_s": round(ready_s, 2),
                "passed": bool(ok),
                "queued": queued,
                "held_max": max(held),
                "held_cap": cap,
                "rss_mb_max": round(max(rss), 1),
                "rss_growth_mb": round(growth, 1),
                "finished": len(done),
                "left_queued": left,
                "rollouts_stored_twice": len(rids) - len(set(rids)),
            }
        finally:
            await fleet.close()
