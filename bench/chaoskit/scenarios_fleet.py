"""Scenarios that fault the whole fleet at once: a storm of random SIGKILLs on every kind of
process, and `asyncrl up` supervising its children while they are killed."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

from asyncrl.nats_server import EmbeddedServer

from ..up_driver import SMALL_RUN, child_pid, kill_run, start_up, summary_of, trainer_version, wait_for
from .books import row, up_books
from .fleet import Fleet, is_ready, pipeline
from .observe import holder, version_line, wait_leader
from .params import BATCH_GROUPS, GROUP, LEASE_TTL_S, RATE
from .streams import dlq_task_ids, weights_history


async def random_kill_storm(
    run_dir: Path,
    tasks: int = 0,
    seed: int = 11,
    duration_s: float = 180.0,
    every_s: tuple[float, float] = (5.0, 15.0),
) -> dict:
    """For `duration_s`, every 5-15 s SIGKILL one random process (worker, scorer, leader or
    standby trainer; a trainer only while the other one is up and ready, so never both at once)
    and start a fresh one in its place, while tasks are fed. At the end every fed task is
    trained exactly once or parked in DLQ with a reason, and the versions have no gap or fork.
    recovery_s: the longest lease handover after a leader's death (target TTL + 5 s);
    first_version_after_death_s: each leader death -> the next step logged by any trainer."""
    tasks = tasks or int(duration_s * RATE / 2)
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            await pipeline(fleet, workers=3, scorers=2, trainers=("A", "B"))
            ids, feeding = fleet.feed(tasks, over_s=duration_s)
            rng, n, kills, deaths, failovers = random.Random(seed), 0, Counter(), [], []
            start = {"rollout_worker": fleet.worker, "scorer": fleet.scorer, "trainer": fleet.trainer}
            t0 = time.monotonic()
            while time.monotonic() - t0 < duration_s:
                await asyncio.sleep(rng.uniform(*every_s))
                kinds = ["rollout_worker", "scorer"]
                trainers = fleet.alive("trainer")
                if len(trainers) >= 2 and all(is_ready(fleet, t) for t in trainers):
                    kinds.append("trainer")
                kind = rng.choice(kinds)
                victim = rng.choice(fleet.alive(kind))
                was_leader = kind == "trainer" and await holder(fleet) == victim
                fleet.signal(victim, signal.SIGKILL)
                t_death = time.time()
                n += 1
                kills["leader" if was_leader else kind] += 1
                start[kind](
                    f"{victim.rstrip('0123456789_')}_{n}" if kind == "trainer" else f"{victim[0]}{n + 10}"
                )
                if was_leader:
                    deaths.append(t_death)
                    failovers.append(round((await wait_leader(fleet, victim, LEASE_TTL_S + 60))[1], 2))
            await feeding
            ids += await fleet.publish_tasks(BATCH_GROUPS)  # work after the last death: a step to time
            books = await fleet.wait_trained(ids, 900, with_checkpoint=True)
            parked = await dlq_task_ids(fleet.bus)
            unaccounted = books.lost
            if books.lost:  # a task parked in DLQ with a reason is accounted for, not lost
                per_task = Counter(
                    r.rsplit("-", 1)[0] for r in set(fleet.trained_counts()) | fleet.consumed()
                )
                unaccounted = sum(1 for t in ids if per_task[t] < GROUP and not parked.get(t))
            books.lost = unaccounted
            line = version_line(await weights_history(fleet.bus))
            steps = sorted((d["ts"], d.get("epoch", 0)) for d in fleet.step_lines() if "ts" in d)
            gaps = []
            for t_death in deaths:  # death -> the first step logged after it
                after = [ts for ts, _ in steps if ts > t_death]
                if after:
                    gaps.append(after[0] - t_death)
            return row(
                "random_kill_storm",
                books,
                max(failovers, default=0.0),
                not line["gaps"]
                and not line["forks"]
                and len(gaps) == len(deaths)
                and all(f <= LEASE_TTL_S + 5 for f in failovers),
                lease_failover_s=failovers,
                target_s=LEASE_TTL_S + 5,
                duration_s=duration_s,
                kills=n,
                kills_by_kind=dict(kills),
                parked_in_dlq=len(parked),
                versions=line["top"],
                gaps=len(line["gaps"]),
                forks=len(line["forks"]),
                first_version_after_death_s=[round(g, 2) for g in gaps],
            )
        finally:
            await fleet.close()


async def up_supervisor(
    run_dir: Path, tasks: int = 0, seed: int = 13, kills: int = 5, steps: int = 10
) -> dict:
    """`asyncrl up` supervises its children: SIGKILL a random worker or scorer of a running run
    `kills` times; each is restarted with backoff, the run trains `steps` more versions after the
    last replacement and is then stopped by SIGTERM (not by a step count: on a loaded machine
    replacements are slow, and a fixed count can end the run mid-kill), summary.json counts every
    restart, nothing is trained twice. recovery_s: the longest kill -> replacement running."""
    rng = random.Random(seed)
    config = SMALL_RUN.replace(
        "[up]\n", "[up]\ngrace_s = 3.0\nmax_restarts = 8\nrestart_backoff_s = 0.5\n"
    ).replace("eval_every = 3", "eval_every = 0")
    run_dir.mkdir(parents=True, exist_ok=True)
    proc, up_dir = start_up(run_dir, config, steps=100_000, minutes=12)
    out, done, recs = run_dir / "up.out", Counter(), []
    try:
        await wait_for(lambda: trainer_version(up_dir) >= 1, 240, "version 1", proc, out)
        for _ in range(kills):
            await asyncio.sleep(rng.uniform(0.5, 2.0))
            name = rng.choice(["worker-0", "worker-1", "scorer-0"])
            pid = await wait_for(
                lambda: child_pid(up_dir, name),  # noqa: B023  (called in this iteration only)
                60,
                f"{name} running",
                proc,
                out,
            )
            os.kill(pid, signal.SIGKILL)
            t = time.monotonic()
            done["scorer" if name.startswith("scorer") else "rollout_worker"] += 1
            await wait_for(
                lambda: child_pid(up_dir, name) not in (None, pid),  # noqa: B023  (as above)
                60,
                f"{name} replaced",
                proc,
                out,
            )
            recs.append(time.monotonic() - t)
        last = trainer_version(up_dir)
        await wait_for(
            lambda: trainer_version(up_dir) >= last + steps,
            300,
            f"{steps} versions after the kills",
            proc,
            out,
        )
        proc.send_signal(signal.SIGTERM)  # an orderly stop: drains, summary, exit 0
        code = await asyncio.to_thread(proc.wait, 120)
        s = summary_of(up_dir)
        rows = [json.loads(x) for x in (up_dir / "metrics" / "trainer.jsonl").read_text().splitlines() if x]
        counts = Counter(rid for r in rows if "samples" in r for rid in r["rollout_ids"])
        restarts = {k: v for k, v in s.get("restarts", {}).items() if v}
        books = await up_books(up_dir, counts, group=4)
        ok = code == 0 and s.get("versions", 0) >= last + steps and restarts == dict(done)
        return row(
            "up_supervisor",
            books,
            max(recs, default=0.0),
            ok,
            kills=dict(done),
            restarts=restarts,
            versions=s.get("versions"),
            exit_code=code,
            replacement_s=[round(r, 2) for r in recs],
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_run(up_dir)
