"""Scenarios that fault the trainers: the leader SIGKILLed or SIGSTOPped (a standby takes the
lease), killed during a step slower than ack_wait, frozen between its lease CAS and its WEIGHTS
write, and a --sync trainer whose batch holds a poison task."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from asyncrl.nats_server import EmbeddedServer
from bus import topology as topo
from bus.events import Task, decode
from trainer import checkpoint

from .books import all_step_lines, queued_ids, rolled_back, row, stepped_versions
from .fleet import ChaosError, Fleet, pipeline, wait_ready
from .observe import (
    deposed_publishes,
    first_trained_on,
    first_version_by,
    refused_stale,
    version_line,
    wait_leader,
    wait_log,
)
from .params import BATCH_GROUPS, GROUP, LEASE_TTL_S, MAX_TOKENS, RATE
from .streams import dlq_entries, weights_history


async def leader_failover(run_dir: Path, tasks: int = 200, seed: int = 3) -> list[dict]:
    """Two trainers share a checkpoint dir. SIGKILL the leader: the standby leads within
    TTL + 5 s. Then SIGSTOP the new leader beyond the TTL, let the restarted standby take
    over, SIGCONT it: the woken leader is made to attempt a publication (`probe_when_deposed`)
    and the server refuses every attempt, so nothing of it reaches the stream or a worker."""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            for t in ("A", "B"):
                fleet.trainer(t, faults={"probe_when_deposed": True})
            await pipeline(fleet, workers=2, trainers=())
            lead, _ = await wait_leader(fleet, None, 300)
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            await fleet.wait_version(3, 300, watch=fleet.alive())
            fleet.signal(lead, signal.SIGKILL)
            t_death = time.time()
            spare, failover = await wait_leader(fleet, lead, LEASE_TTL_S + 60)
            first_v_s, first_v = await first_version_by(fleet, spare, t_death, 300)
            v_kill = await fleet.version()
            await fleet.wait_version(v_kill + 2, 300, watch=[spare])
            # the killed machine comes back as a standby
            fleet.trainer(lead + "2", faults={"probe_when_deposed": True})
            if not await wait_log(fleet.procs[lead + "2"].log_path, "waiting for the leader lease", 120):
                raise ChaosError(f"restarted trainer {lead}2 never went on standby")
            fleet.signal(spare, signal.SIGSTOP)  # e.g. a long GC pause or a partition
            t_pause = time.time()
            third, pause_failover = await wait_leader(fleet, spare, LEASE_TTL_S + 60)
            pause_v_s, pause_v = await first_version_by(fleet, third, t_pause, 300)
            v_new = await fleet.version()
            await fleet.wait_version(v_new + 1, 300, watch=[third])
            fleet.signal(spare, signal.SIGCONT)
            stepped_down = await wait_log(fleet.procs[spare].log_path, "back to standby", 60)
            books = await fleet.wait_trained(ids, 600, feeding=feeding, with_checkpoint=True, watch=[third])
            line = version_line(await weights_history(fleet.bus))
            # workers refuse every delta the woken old leader got out (each worker sees each one)
            refused = sum(
                refused_stale(p.log_path) for p in fleet.procs.values() if p.component == "rollout_worker"
            )
            clean = not line["gaps"] and not line["forks"]
            deposed = deposed_publishes(fleet.procs[spare].log_path)
            target = LEASE_TTL_S + 5
            return [
                row(
                    "trainer_leader_sigkill",
                    books,
                    failover,
                    clean and failover <= target,
                    target_s=target,
                    versions=line["top"],
                    gaps=len(line["gaps"]),
                    forks=len(line["forks"]),
                    first_version_after_death_s=round(first_v_s, 2),
                    first_trained_after_death_s=first_trained_on(fleet, spare, first_v, t_death),
                ),
                row(
                    "trainer_leader_sigstop",
                    books,
                    pause_failover,
                    clean
                    and stepped_down
                    and pause_failover <= target
                    and line["late_old_epoch"] == 0
                    and deposed["attempts"] >= 1
                    and deposed["refused"] == deposed["attempts"],
                    target_s=target,
                    late_old_epoch_deltas=line["late_old_epoch"],
                    refused_by_workers=refused,
                    first_version_after_death_s=round(pause_v_s, 2),
                    first_trained_after_death_s=first_trained_on(fleet, third, pause_v, t_pause),
                    deposed_publish_attempts=deposed["attempts"],
                    deposed_publish_refused=deposed["refused"],
                    old_leader_stepped_down=stepped_down,
                    epochs=len(line["epochs"]),
                ),
            ]
        finally:
            await fleet.close()


async def slow_step_kill(run_dir: Path, tasks: int = 40, seed: int = 9, delay_factor: float = 4.0) -> dict:
    """The leader's step + publication is made slower than ack_wait (debug_step_delay_s); it is
    SIGKILLed 2 x ack_wait after it took a batch (past the point where the server would have
    redelivered that batch, before the step's checkpoint). The standby takes over and trains
    every rollout, each exactly once: nothing of the in-flight batch was acked early."""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            fleet.trainer("A", faults={"step_delay_s": delay_factor * fleet.ack_wait_s})
            await wait_ready(fleet, ["A"])
            await pipeline(fleet, workers=2, trainers=("B",))  # B waits on standby
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            batch = BATCH_GROUPS * GROUP
            await fleet.wait_held(topo.SCORED, topo.TRAINER_CONSUMER, at_least=batch, timeout_s=300)
            await asyncio.sleep(2 * fleet.ack_wait_s)
            info = await fleet.consumer(topo.SCORED, topo.TRAINER_CONSUMER)
            v_before = await fleet.version()
            fleet.signal("A", signal.SIGKILL)
            t_death = time.time()
            _, failover = await wait_leader(fleet, "A", LEASE_TTL_S + 60)
            first_v_s, first_v = await first_version_by(fleet, "B", t_death, 300)
            books = await fleet.wait_trained(ids, 600, with_checkpoint=True, feeding=feeding, watch=["B"])
            line = version_line(await weights_history(fleet.bus))
            a_log = run_dir / "trainer-A" / "metrics" / "trainer.jsonl"
            a_steps = (
                sum(1 for ln in a_log.read_text().splitlines() if '"rollout_ids"' in ln)
                if a_log.exists()
                else 0
            )
            return row(
                "slow_step_kill",
                books,
                first_v_s,
                v_before == 0
                and a_steps == 0
                and info.num_ack_pending >= batch
                and not line["gaps"]
                and not line["forks"],
                step_delay_s=delay_factor * fleet.ack_wait_s,
                held_at_kill=info.num_ack_pending,
                version_at_kill=v_before,
                leader_logged_steps=a_steps,
                lease_failover_s=round(failover, 2),
                first_version_after_death_s=round(first_v_s, 2),
                first_trained_after_death_s=first_trained_on(fleet, "B", first_v, t_death),
            )
        finally:
            await fleet.close()


async def deferred_checkpoint_kill(run_dir: Path, tasks: int = 40, seed: int = 11, every: int = 3) -> dict:
    """checkpoint_every = K: versions between checkpoints go out at once and their batches are acked
    only after the checkpoint recording them. The leader is SIGKILLed right after a version that is
    published but not checkpointed (after a first checkpoint); the standby resumes from that
    checkpoint, trains the redelivered batches again, and the books hold over the line of versions
    that survives: nothing lost, nothing trained twice; what was re-trained is at most K - 1
    versions, and the only forks of the version line are those rolled-back versions."""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            fleet.trainer("A", checkpoint={"every": every})
            await wait_ready(fleet, ["A"])
            fleet.trainer("B", checkpoint={"every": every})  # B waits on standby
            await pipeline(fleet, workers=2, trainers=())
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            deadline = time.monotonic() + 300
            while True:  # a version published, not checkpointed, after a checkpoint
                v_kill = await fleet.version()
                # and its step line written: the books find rolled-back versions by their lines (a kill
                # between the version's KV write and its line left none, and the run looked clean)
                if v_kill > every and v_kill % every and v_kill in stepped_versions(run_dir / "trainer-A"):
                    break
                fleet.check_alive(["A"])
                if time.monotonic() > deadline:
                    raise ChaosError(f"leader A never reached an uncheckpointed version past {every}")
                await asyncio.sleep(0.05)
            fleet.signal("A", signal.SIGKILL)
            t_death = time.time()
            ckpt_v = checkpoint.load_latest(run_dir / "ckpt").version
            _, failover = await wait_leader(fleet, "A", LEASE_TTL_S + 60)
            first_v_s, first_v = await first_version_by(fleet, "B", t_death, 300)
            books = await fleet.wait_trained(ids, 600, with_checkpoint=True, feeding=feeding, watch=["B"])
            line = version_line(await weights_history(fleet.bus))
            gone = rolled_back(all_step_lines(run_dir))
            redone = sorted({d["version"] for d in gone})
            passed = (
                ckpt_v < v_kill
                and 1 <= len(redone) <= every - 1
                and not line["gaps"]
                and set(line["forks"]) <= set(redone)
                and all(v > ckpt_v for v in redone)
            )
            return row(
                "deferred_checkpoint_kill",
                books,
                first_v_s,
                passed,
                checkpoint_every=every,
                version_at_kill=v_kill,
                checkpoint_at_kill=ckpt_v,
                rolled_back_versions=redone,
                rolled_back_ids=sum(len(d["rollout_ids"]) for d in gone),
                forks=line["forks"],
                lease_failover_s=round(failover, 2),
                first_version_after_death_s=round(first_v_s, 2),
                first_trained_after_death_s=first_trained_on(fleet, "B", first_v, t_death),
            )
        finally:
            await fleet.close()


async def background_checkpoint_kill(
    run_dir: Path, tasks: int = 40, seed: int = 12, delay_s: float = 3.0
) -> dict:
    """[trainer.checkpoint] background: versions go out at once and each batch is acked only once a
    checkpoint recording it is durable; the writer is slowed (`checkpoint_delay_s`) so versions run
    ahead of it. The leader is SIGKILLed with versions published past its newest durable checkpoint
    (a write in flight); the standby resumes from that checkpoint and re-trains the redelivered
    batches: nothing lost, nothing trained twice, and the only forks of the version line are the
    rolled-back versions, all past the checkpoint."""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            slow = {"checkpoint": {"background": True}, "faults": {"checkpoint_delay_s": delay_s}}
            fleet.trainer("A", **slow)
            await wait_ready(fleet, ["A"])
            fleet.trainer("B", checkpoint={"background": True})  # B waits on standby
            await pipeline(fleet, workers=2, trainers=())
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            deadline = time.monotonic() + 300
            while True:  # a version published (its step line written) past a first durable checkpoint
                v_kill = await fleet.version()
                st = checkpoint.load_latest(run_dir / "ckpt")
                ckpt_v = st.version if st is not None else 0
                if 1 <= ckpt_v < v_kill and v_kill in stepped_versions(run_dir / "trainer-A"):
                    break
                fleet.check_alive(["A"])
                if time.monotonic() > deadline:
                    raise ChaosError("leader A never got a version ahead of a durable background checkpoint")
                await asyncio.sleep(0.05)
            fleet.signal("A", signal.SIGKILL)
            t_death = time.time()
            ckpt_v = checkpoint.load_latest(run_dir / "ckpt").version
            _, failover = await wait_leader(fleet, "A", LEASE_TTL_S + 60)
            first_v_s, first_v = await first_version_by(fleet, "B", t_death, 300)
            books = await fleet.wait_trained(ids, 600, with_checkpoint=True, feeding=feeding, watch=["B"])
            line = version_line(await weights_history(fleet.bus))
            gone = rolled_back(all_step_lines(run_dir))
            redone = sorted({d["version"] for d in gone})
            passed = (
                ckpt_v < v_kill
                and len(redone) >= 1
                and not line["gaps"]
                and set(line["forks"]) <= set(redone)
                and all(v > ckpt_v for v in redone)
            )
            return row(
                "background_checkpoint_kill",
                books,
                first_v_s,
                passed,
                checkpoint_delay_s=delay_s,
                version_at_kill=v_kill,
                checkpoint_at_kill=ckpt_v,
                rolled_back_versions=redone,
                rolled_back_ids=sum(len(d["rollout_ids"]) for d in gone),
                forks=line["forks"],
                lease_failover_s=round(failover, 2),
                first_version_after_death_s=round(first_v_s, 2),
                first_trained_after_death_s=first_trained_on(fleet, "B", first_v, t_death),
            )
        finally:
            await fleet.close()


async def deposed_leader_publish(
    run_dir: Path, tasks: int = 80, seed: int = 10, stop_at: int = 3, publish: str = "gathered"
) -> dict:
    """The leader freezes itself exactly between its lease CAS and the WEIGHTS write of version
    `stop_at` (`stop_before_publish`); the standby takes over and publishes; the old leader is
    resumed and its write must be refused by the server: nothing of its epoch after the takeover
    is in the stream, so no worker can apply it. `publish = "sharded"`: the same for a manifest."""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            fleet.trainer(
                "A",
                faults={"stop_before_publish": stop_at, "probe_when_deposed": True},
                publish={"layout": publish},
            )
            await wait_ready(fleet, ["A"])
            fleet.trainer("B", publish={"layout": publish})
            await pipeline(fleet, workers=2, trainers=())
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            a = fleet.procs["A"]
            if not await wait_log(a.log_path, "fault injection: stopping before publish", 300):
                raise ChaosError(f"leader A never reached its publication of v{stop_at}")
            t_stop = time.monotonic()
            new, failover = await wait_leader(fleet, "A", LEASE_TTL_S + 60)
            await fleet.wait_version(stop_at + 1, 300, watch=[new])  # the new leader published
            first_version_s = time.monotonic() - t_stop
            fleet.signal("A", signal.SIGCONT)
            stepped_down = await wait_log(a.log_path, "back to standby", 60)
            books = await fleet.wait_trained(ids, 600, feeding=feeding, with_checkpoint=True, watch=[new])
            events = await weights_history(fleet.bus)
            epochs = [e.epoch for e in events]
            e_old = min(epochs)
            takeover = next(i for i, e in enumerate(events) if e.epoch > e_old)
            late = [e.msg_id() for e in events[takeover:] if e.epoch == e_old]
            line = version_line(events)
            deposed = deposed_publishes(a.log_path)
            passed = (
                stepped_down
                and not late
                and not line["gaps"]
                and not line["forks"]
                and deposed["attempts"] >= 1
                and deposed["refused"] == deposed["attempts"]
            )
            return row(
                "deposed_leader_publish",
                books,
                failover,
                passed,
                target_s=LEASE_TTL_S + 5,
                first_version_after_stop_s=round(first_version_s, 2),
                deposed_publish_attempts=deposed["attempts"],
                deposed_publish_refused=deposed["refused"],
                old_epoch_after_takeover=late,
                old_leader_stepped_down=stepped_down,
                manifests=sum(1 for e in events if e.KIND == "Manifest"),
                versions=line["top"],
                gaps=len(line["gaps"]),
                forks=len(line["forks"]),
            )
        finally:
            await fleet.close()  # SIGCONT + SIGTERM to everyone, A included


async def sync_poison_task(run_dir: Path, tasks: int = 4, seed: int = 10, timeout_s: float = 15.0) -> dict:
    """A --sync trainer publishes exactly batch_groups tasks per version. One task of version 0's
    batch is swapped for a poison copy whose spec the verifier refuses (SpecError: each rollout is
    parked in DLQ at once and none reaches SCORED, so its group never forms); the trainer publishes
    a replacement after sync_task_timeout_s and the run goes on to `tasks` versions. Books: every
    task the trainer fed, bar the poison, trained exactly once. (A verifier that merely raises is
    no poison for the barrier any more: its last delivery publishes a scorer_crash verdict, so the
    group forms, and whether a replacement came first was a race against the timeout.)"""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            fed: list[str] = []

            async def record(m):
                try:
                    fed.append(decode(m.data, Task).task_id)
                except Exception:
                    pass

            rec = await fleet.bus.nc.subscribe("rl.tasks.>", cb=record)
            steps = max(tasks, 2)
            fleet.trainer(
                "A",
                run={"mode": "sync", "sync_task_timeout_s": timeout_s, "max_steps": steps},
                tasks={"feed": True, "sampling": {"max_tokens": MAX_TOKENS, "temperature": 1.0}},
            )
            fleet.scorer("s0")
            await wait_ready(fleet, ["A", "s0"])
            t0 = time.monotonic()
            while (await fleet.bus.js.stream_info(topo.TASKS)).state.messages < BATCH_GROUPS:
                fleet.check_alive(["A"])
                if time.monotonic() - t0 > 120:
                    raise ChaosError("the sync trainer published no batch of tasks")
                await asyncio.sleep(0.2)
            info = await fleet.bus.js.stream_info(topo.TASKS)
            raw = await fleet.bus.js.get_msg(topo.TASKS, seq=info.state.first_seq)
            victim = decode(raw.data, Task)
            await fleet.bus.js.delete_msg(topo.TASKS, raw.seq)
            poison = Task(
                task_id=victim.task_id,
                env=victim.env,
                prompt=victim.prompt,
                spec={"answer": "poison"},
                sampling=victim.sampling,
                min_version=victim.min_version,
            )
            await fleet.bus.publish(raw.subject, poison, msg_id=f"poison-{victim.task_id}")
            t_poison = time.monotonic()
            for i in range(2):
                fleet.worker(f"w{i}")
            await wait_ready(fleet, ["w0", "w1"])
            await fleet.wait_version(steps, 600, watch=["s0", "w0", "w1"])
            rec_s = time.monotonic() - t_poison
            fleet.procs["A"].popen.wait(120)  # max_steps: it finishes by itself
            await rec.unsubscribe()
            good = sorted(set(fed) - {victim.task_id})
            # under load a slow task gets a replacement too (sync_task_timeout_s); its late rollouts
            # join the next batch, and those of the last version stay durable in SCORED: not lost
            books = fleet.books(good, with_checkpoint=True, queued=await queued_ids(fleet.bus, GROUP))
            t1 = time.monotonic()
            while (
                parked := sum(1 for _, r in await dlq_entries(fleet.bus) if "bad task spec" in r)
            ) < GROUP and time.monotonic() - t1 < 60:
                await asyncio.sleep(0.5)
            replaced = max((d.get("sync_replaced", 0) for d in fleet.step_lines()), default=0)
            return row(
                "sync_poison_task",
                books,
                rec_s,
                fleet.procs["A"].popen.returncode == 0 and replaced >= 1 and parked == GROUP,
                versions=await fleet.version(),
                sync_replaced=replaced,
                poison_parked=parked,
                sync_task_timeout_s=timeout_s,
                trainer_rc=fleet.procs["A"].popen.returncode,
            )
        finally:
            await fleet.close()
