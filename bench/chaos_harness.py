"""Fault-injection harness: real trainer / scorer / worker processes on a real nats-server,
faults injected with signals, and the books kept from what the processes themselves wrote.

    fleet = Fleet(run_dir, servers=[srv.url])
    await fleet.open()                       # harness bus connection, provisioned topology
    fleet.trainer("A"); fleet.scorer("s0"); fleet.worker("w0")
    tasks = await fleet.publish_tasks(200)
    ... SIGKILL / SIGSTOP / server restart ...
    books = await fleet.wait_trained(tasks, timeout_s=300)   # Books(lost, duplicates_trained)

Counting (independent of the components' own dedupe):
    consumed = rollout ids in every <run_dir>/trainer-*/metrics/trainer.jsonl line, plus the
               newest checkpoint's consumed ids (a leader killed between checkpoint and JSONL
               line has used the batch without logging it)
    trained  = the consumed ids that entered a gradient step with weight > 0 (the line's
               trained_ids); dropped = consumed and not trained (stale, a group of one)
    lost     = tasks with fewer than group_size rollout ids consumed
    duplicates_trained = rollout ids that appear in more than one logged step
Every scenario function returns one report row {name, tasks, lost, duplicates_trained,
recovery_s, passed, ...} and is bounded in time (`deadline`). bench.chaos runs them all;
tests/test_chaos_*.py run them one by one.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.up import Proc, spawn
from bus import BusConfig, EmbeddedServer, TopologyConfig, connect
from bus import topology as topo
from bus.events import SamplingParams
from bus.weights import parse_version

# tiny and fast: a 1-layer model and 48-token answers keep a 200-task run within minutes on 2 cores
MODEL = {"preset": "tiny", "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64,
         "max_seq_len": 96}
GROUP = 2              # completions per task
BATCH_GROUPS = 4       # tasks per trainer step
MAX_TOKENS = 48
RATE = 5.0            # tasks published per second: a 200-task run lasts ~40 s
ACK_WAIT_S = 6.0       # short, so a dead worker's tasks come back quickly; handlers heartbeat every 2 s
LEASE_TTL_S = 4.0


class ChaosError(AssertionError):
    pass


@dataclass
class Books:
    tasks: int
    lost: int
    duplicates_trained: int
    trained: int                 # distinct rollout ids trained with weight > 0
    consumed: int = 0            # distinct rollout ids used up (trained or dropped)
    dropped: int = 0             # consumed, weight 0 (never moved the weights)

    def ok(self) -> bool:
        return self.lost == 0 and self.duplicates_trained == 0


@dataclass
class Fleet:
    run_dir: Path
    servers: list[str]
    ack_wait_s: float = ACK_WAIT_S
    replicas: int = 1
    roles: dict | None = None          # role -> (user, password) on a server with per-role users
    procs: dict = field(default_factory=dict)   # name -> Proc
    bus: object = None
    seed: int = 0

    def __post_init__(self):
        self.run_dir = Path(self.run_dir)
        for sub in ("config", "logs"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(self.seed)

    # -- configuration -----------------------------------------------------------------------
    def topology(self) -> dict:
        return {"ack_wait_s": self.ack_wait_s, "replicas": self.replicas}

    def bus_conf(self, role: str, name: str) -> dict:
        conf = {"servers": list(self.servers), "name": name, "topology": self.topology(),
                "reconnect_wait_s": 0.25}
        if self.roles:
            user, password = self.roles[role]
            conf |= {"user": user, "password": password}
        return conf

    async def open(self) -> "Fleet":
        kw = {}
        if self.roles:
            user, password = self.roles["admin"]
            kw = {"user": user, "password": password}
        self.bus = await connect(BusConfig(servers=list(self.servers), name="chaos-harness",
                                           topology=TopologyConfig(**self.topology()), **kw))
        await self.bus.provision()
        return self

    async def close(self) -> None:
        self.stop_all()
        if self.bus is not None:
            await self.bus.close()
            self.bus = None

    # -- processes -----------------------------------------------------------------------------
    def _spawn(self, name: str, component: str, module: str, conf: dict) -> Proc:
        p = spawn(self.run_dir, name, component, module, conf)
        self.procs[name] = p
        return p

    def trainer(self, name: str, **over) -> Proc:
        conf = {"trainer_id": name, "model": dict(MODEL), "batch_groups": BATCH_GROUPS, "group_size": GROUP,
                "max_lag": 1000, "feed": False, "lr": 1e-3, "fetch_timeout_s": 0.3,
                "keyframe_interval": 1000, "lease_ttl_s": LEASE_TTL_S, "lease_renew_s": 1.0,
                "checkpoint_dir": str(self.run_dir / "ckpt"), "run_dir": str(self.run_dir / f"trainer-{name}"),
                "keep_checkpoints": 3, "bus": self.bus_conf("trainer", name), **over}
        return self._spawn(name, "trainer", "trainer", conf)

    def worker(self, name: str, **over) -> Proc:
        conf = {"worker_id": name, "slots": 8, "queue": 4, "max_len": 96, "threads": 1,
                "heartbeat_s": 2.0, "grace_s": 2.0, "seed": self.rng.randrange(1 << 30),
                "bus": self.bus_conf("worker", name), **over}
        return self._spawn(name, "rollout_worker", "rollout_worker", conf)

    def scorer(self, name: str, **over) -> Proc:
        conf = {"scorer_id": name, "concurrency": 8, "heartbeat_s": 2.0,
                "bus": self.bus_conf("scorer", name), **over}
        if self.roles:
            conf["provision"] = False
        return self._spawn(name, "scorer", "scorer", conf)

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].popen.send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[name].popen.wait()

    def alive(self, component: str | None = None) -> list[str]:
        return [n for n, p in self.procs.items() if p.popen.poll() is None
                and (component is None or p.component == component)]

    def check_alive(self, names) -> None:
        """A process that died by itself (not by our hand) is a finding: show its log."""
        for n in names:
            p = self.procs[n]
            if p.popen.poll() is not None:
                raise ChaosError(f"{n} exited with {p.popen.returncode}:\n{p.log_path.read_text()[-3000:]}")

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.popen.poll() is None:
                try:
                    p.popen.send_signal(signal.SIGCONT)     # a stopped process cannot handle SIGTERM
                    p.popen.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.popen.wait(timeout=20)
            except Exception:
                p.popen.kill()
                p.popen.wait()

    # -- work and books --------------------------------------------------------------------------
    async def publish_tasks(self, n: int, env: str = "arith") -> list[str]:
        from envs.feeder import publish_tasks
        sp = SamplingParams(n=GROUP, max_tokens=MAX_TOKENS, temperature=1.0)
        return await publish_tasks(self.bus, env, n, sp, self.rng)

    async def trickle(self, n: int, over_s: float, ids: list[str]) -> None:
        """Publish `n` tasks spread over `over_s` seconds (a run that lasts, so faults land
        mid-run), appending their ids to `ids`. A broker that is down mid-fault: retry."""
        chunk = max(1, round(n / max(1.0, over_s / 2)))      # a burst every ~2 s: every worker gets some
        while len(ids) < n:
            try:
                ids += await self.publish_tasks(min(chunk, n - len(ids)))
            except Exception:
                await asyncio.sleep(0.5)
                continue
            await asyncio.sleep(over_s / max(1, n / chunk))

    def feed(self, n: int, over_s: float) -> tuple[list[str], asyncio.Task]:
        ids: list[str] = []
        return ids, asyncio.create_task(self.trickle(n, over_s, ids))

    def step_lines(self) -> list[dict]:
        out = []
        for p in self.run_dir.glob("trainer-*/metrics/trainer.jsonl"):
            out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        return [d for d in out if "rollout_ids" in d]          # eval lines carry no batch

    def trained_counts(self) -> Counter:
        """Rollout id -> steps that consumed it."""
        counts: Counter = Counter()
        for d in self.step_lines():
            counts.update(d["rollout_ids"])
        return counts

    def weighted_ids(self) -> set[str]:
        """Ids trained with weight > 0 (lines written before trained_ids existed: all of them)."""
        return {rid for d in self.step_lines() for rid in d.get("trained_ids", d["rollout_ids"])}

    def consumed(self) -> set[str]:
        from trainer import checkpoint
        st = checkpoint.load_latest(self.run_dir / "ckpt")
        return set(st.consumed) if st is not None else set()

    def books(self, task_ids: list[str], with_checkpoint: bool = False) -> Books:
        counts = self.trained_counts()
        consumed = set(counts) | (self.consumed() if with_checkpoint else set())
        per_task = Counter(rid.rsplit("-", 1)[0] for rid in consumed)
        lost = sum(1 for t in task_ids if per_task[t] < GROUP)
        mine = {f"{t}-{i}" for t in task_ids for i in range(GROUP)}     # padding tasks are not in the books
        trained = self.weighted_ids() & mine
        return Books(tasks=len(task_ids), lost=lost, duplicates_trained=sum(c - 1 for c in counts.values() if c > 1),
                     trained=len(trained), consumed=len(consumed & mine), dropped=len((consumed & mine) - trained))

    async def wait_trained(self, task_ids: list[str], timeout_s: float, with_checkpoint: bool = False,
                           watch: tuple = (), feeding: asyncio.Task | None = None) -> Books:
        """Until every task is trained on or the time is up (then the books say what is lost)."""
        deadline = time.monotonic() + timeout_s
        if feeding is not None:
            await asyncio.wait_for(feeding, timeout_s)
        last, since = -1, time.monotonic()
        while True:
            b = self.books(task_ids, with_checkpoint)
            if b.lost == 0 or time.monotonic() > deadline:
                return b
            self.check_alive(watch)
            if b.lost != last:
                last, since = b.lost, time.monotonic()
            elif time.monotonic() - since > 10:
                # the trainer steps on whole batches (batch_groups): pad the tail with tasks
                # outside the books so the last real groups are not left waiting for company
                await self.publish_tasks(BATCH_GROUPS)
                since = time.monotonic()
            await asyncio.sleep(1.0)

    async def version(self) -> int:
        try:
            return parse_version(await self.bus.kv_get(topo.KEY_VERSION))
        except Exception:              # the broker is down mid-fault: unknown, not an error
            return -1

    async def wait_version(self, at_least: int, timeout_s: float, watch: tuple = ()) -> float:
        t0 = time.monotonic()
        while await self.version() < at_least:
            if time.monotonic() - t0 > timeout_s:
                raise ChaosError(f"version stuck at {await self.version()} < {at_least} after {timeout_s}s")
            self.check_alive(watch)
            await asyncio.sleep(0.25)
        return time.monotonic() - t0

    async def consumer(self, stream: str, durable: str):
        return await self.bus.js.consumer_info(stream, durable)

    async def wait_held(self, stream: str, durable: str, at_least: int = 1, timeout_s: float = 120.0,
                        until: asyncio.Task | None = None) -> bool:
        """Until `at_least` messages of `stream` are being worked on (so a fault lands mid-work);
        False if the feeding task `until` ends first and all is done."""
        t0 = time.monotonic()
        while (info := await self.consumer(stream, durable)).num_ack_pending < at_least:
            if until is not None and until.done() and info.num_pending + info.num_ack_pending == 0:
                return False
            if time.monotonic() - t0 > timeout_s:
                raise ChaosError(f"nothing in flight on {stream}/{durable} after {timeout_s}s")
            await asyncio.sleep(0.01)
        return True

    async def wait_redelivered(self, stream: str, durable: str, before, t0: float,
                               timeout_s: float) -> tuple[float, int]:
        """Recovery: every message delivered before the fault (`before`: consumer info taken
        just before it; stream seq <= its last delivered, the victim's included) has been acked,
        i.e. redelivered to a live process and finished. Also returns how many redeliveries
        happened meanwhile: deliveries (consumer seq) minus distinct messages (stream seq)."""
        while (info := await self.consumer(stream, durable)).ack_floor.stream_seq < before.delivered.stream_seq:
            if time.monotonic() - t0 > timeout_s:
                raise ChaosError(f"{stream}/{durable}: ack floor still below {before.delivered.stream_seq} "
                                 f"after {timeout_s}s")
            await asyncio.sleep(0.05)
        redeliveries = lambda i: i.delivered.consumer_seq - i.delivered.stream_seq   # noqa: E731
        return time.monotonic() - t0, redeliveries(info) - redeliveries(before)


def row(name: str, books: Books, recovery_s: float, passed: bool, **extra) -> dict:
    return {"name": name, "tasks": books.tasks, "lost": books.lost, "duplicates_trained": books.duplicates_trained,
            "trained": books.trained, "consumed": books.consumed, "dropped": books.dropped,
            "recovery_s": round(recovery_s, 2), "passed": bool(passed and books.ok()), **extra}


# ------------------------------------------------------------------------------- scenarios
READY = {"trainer": ("leading", "waiting for the leader lease"), "scorer": ("scorer started",),
         "rollout_worker": ("weights loaded",)}


async def pipeline(fleet: Fleet, workers: int = 2, scorers: int = 1, trainers=("A",)) -> None:
    """Start the processes and wait until each is ready (so the work fed next meets a fleet)."""
    for t in trainers:
        fleet.trainer(t)
    for i in range(scorers):
        fleet.scorer(f"s{i}")
    for i in range(workers):
        fleet.worker(f"w{i}")
    await wait_ready(fleet, list(fleet.procs))


async def wait_ready(fleet: Fleet, names: list[str], timeout_s: float = 300.0) -> None:
    t0 = time.monotonic()
    for n in names:
        p = fleet.procs[n]
        while not any(w in p.log_path.read_text(errors="replace") for w in READY[p.component]):
            fleet.check_alive([n])
            if time.monotonic() - t0 > timeout_s:
                raise ChaosError(f"{n} not ready after {timeout_s}s:\n{p.log_path.read_text()[-2000:]}")
            await asyncio.sleep(0.2)


async def kill_and_replace(fleet: "Fleet", component: str, new_name: str, rng: random.Random) -> tuple[float, int]:
    """SIGKILL a random live worker or scorer, start `new_name` in its place, and wait until the
    messages it held are handed out again: (recovery seconds, messages redelivered)."""
    stream, durable, start = {"rollout_worker": (topo.TASKS, topo.ROLLOUT_CONSUMER, fleet.worker),
                              "scorer": (topo.ROLLOUTS, topo.SCORER_CONSUMER, fleet.scorer)}[component]
    victim = rng.choice(fleet.alive(component))
    info = await fleet.consumer(stream, durable)
    fleet.signal(victim, signal.SIGKILL)
    t_kill = time.monotonic()
    start(new_name)
    return await fleet.wait_redelivered(stream, durable, info, t_kill, fleet.ack_wait_s + 60)


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
            for k in range(kills + 3):             # up to 3 extra kills if none hit a busy worker
                if k >= kills and redelivered:
                    break
                when = t0 + span * min(k + rng.random(), kills) / (kills + 1)   # random instants in the run
                await asyncio.sleep(max(0.0, when - time.monotonic()))
                if not await fleet.wait_held(topo.TASKS, topo.ROLLOUT_CONSUMER, at_least=3, until=feeding):
                    break                         # the run is over: no later instant to kill at
                rec, n = await kill_and_replace(fleet, "rollout_worker", f"w{spawned}", rng)
                spawned += 1
                recoveries.append(rec)
                redelivered += n
            books = await fleet.wait_trained(ids, 600, feeding=feeding, watch=fleet.alive())
            rec = max(recoveries)
            # a kill that hit an idle worker proves nothing: at least one must have forced redelivery
            return row("worker_sigkill", books, rec, rec <= fleet.ack_wait_s + 10 and redelivered > 0,
                       kills=len(recoveries),
                       redelivered=redelivered, recovery_s_all=[round(r, 2) for r in recoveries],
                       target_s=fleet.ack_wait_s + 10)
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
            return row("scorer_sigkill", books, rec, rec <= fleet.ack_wait_s + 10 and redelivered > 0,
                       kills=len(recoveries), redelivered=redelivered, target_s=fleet.ack_wait_s + 10)
        finally:
            await fleet.close()


async def stream_messages(bus, stream: str, subjects: str) -> list:
    """Every message stored in `stream` (on `subjects`), in sequence order, read by sequence."""
    from nats.js.errors import NotFoundError
    out, seq = [], 0
    while True:
        try:
            raw = await bus.js.get_msg(stream, seq=seq + 1, subject=subjects, next=True)
        except NotFoundError:
            return out
        seq = raw.seq
        out.append(raw)


async def weights_history(bus) -> list:
    """Every Delta/Keyframe event in WEIGHTS, in stream order."""
    from bus.events import decode
    return [decode(raw.data) for raw in await stream_messages(bus, topo.WEIGHTS, "rl.weights.>")]


def version_line(events) -> dict:
    """No gap, no fork: every version 1..max reached by some delta, and each version has one
    digest across all epochs' deltas and keyframes. Deltas from an epoch older than a keyframe
    already in the stream are 'late' (a deposed leader woke up): workers refuse them."""
    from bus.events import DeltaEvent, KeyframeEvent
    digests: dict[int, set] = {}
    newest_epoch, late = 0, 0
    for e in events:
        if isinstance(e, KeyframeEvent):
            digests.setdefault(e.version, set()).add(e.digest)
            newest_epoch = max(newest_epoch, e.epoch)
        elif isinstance(e, DeltaEvent):
            digests.setdefault(e.to_version, set()).add(e.new_digest)
            late += e.epoch < newest_epoch
    top = max(digests, default=0)
    # a version is out once a delta or a keyframe carries it (a new leader's first keyframe can be
    # the only announcement of a version its deposed predecessor checkpointed but never published)
    reached = {e.to_version for e in events if isinstance(e, DeltaEvent)} | \
        {e.version for e in events if isinstance(e, KeyframeEvent)}
    first = min((e.from_version for e in events if isinstance(e, DeltaEvent)), default=0)   # WEIGHTS keeps the last N
    return {"top": top, "gaps": sorted(set(range(first + 1, top + 1)) - reached),
            "forks": sorted(v for v, d in digests.items() if len(d) > 1), "late_old_epoch": late,
            "epochs": sorted({e.epoch for e in events})}


async def holder(fleet: Fleet) -> str | None:
    from trainer.lease import parse_lease
    value, _ = await fleet.bus.kv_entry(topo.KEY_LEADER)
    return (parse_lease(value) or {}).get("holder")


async def wait_leader(fleet: Fleet, not_: str | None, timeout_s: float) -> tuple[str, float]:
    t0 = time.monotonic()
    while True:
        h = await holder(fleet)
        if h is not None and h != not_ and h in fleet.alive("trainer"):
            return h, time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise ChaosError(f"no new leader after {timeout_s}s (holder {h})")
        await asyncio.sleep(0.1)


async def first_version_by(fleet: Fleet, trainer_id: str, t_death: float, timeout_s: float) -> tuple[float, int]:
    """(seconds from t_death (wall clock) until `trainer_id` has published a delta, its version):
    the failover as workers see it, lease handover + resume + keyframe + a first step. Timed by
    the server's store time of that delta (same host clock), not by when we polled."""
    from nats.js.errors import NotFoundError
    from bus.events import DeltaEvent, decode
    padded, seq = time.time(), 0
    while True:
        try:
            raw = await fleet.bus.js.get_msg(topo.WEIGHTS, seq=seq + 1, subject=topo.DELTA_SUBJECT, next=True)
        except NotFoundError:
            raw = None
        if raw is not None:
            seq = raw.seq
            e = decode(raw.data)
            if isinstance(e, DeltaEvent) and e.trainer_id == trainer_id and raw.time.timestamp() >= t_death:
                return raw.time.timestamp() - t_death, e.to_version
            continue
        if time.time() - t_death > timeout_s:
            raise ChaosError(f"{trainer_id} published no version {timeout_s}s after the leader's death")
        if time.time() - padded > 15:      # a short run may have no work left: give it some (not in the books)
            await fleet.publish_tasks(BATCH_GROUPS)
            padded = time.time()
        await asyncio.sleep(0.1)


def first_trained_on(fleet: Fleet, trainer_id: str, version: int, t_death: float) -> float | None:
    """Seconds from t_death until `trainer_id` logged a step with a rollout generated on `version`
    or later (None: none by the end of the run)."""
    p = fleet.run_dir / f"trainer-{trainer_id}" / "metrics" / "trainer.jsonl"
    if not p.exists():
        return None
    ts = [d["ts"] for d in map(json.loads, filter(str.strip, p.read_text().splitlines()))
          if d.get("newest_token_version", -1) >= version and "ts" in d]
    return round(min(ts) - t_death, 2) if ts else None


async def leader_failover(run_dir: Path, tasks: int = 200, seed: int = 3) -> list[dict]:
    """Two trainers share a checkpoint dir. SIGKILL the leader: the standby leads within
    TTL + 5 s. Then SIGSTOP the new leader beyond the TTL, let the restarted standby take
    over, SIGCONT it: the woken leader is made to attempt a publication (`probe_when_deposed`)
    and the server refuses every attempt, so nothing of it reaches the stream or a worker."""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            for t in ("A", "B"):
                fleet.trainer(t, probe_when_deposed=True)
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
            fleet.trainer(lead + "2", probe_when_deposed=True)   # the killed machine comes back as a standby
            if not await _wait_log(fleet.procs[lead + "2"].log_path, "waiting for the leader lease", 120):
                raise ChaosError(f"restarted trainer {lead}2 never went on standby")
            fleet.signal(spare, signal.SIGSTOP)       # e.g. a long GC pause or a partition
            t_pause = time.time()
            third, pause_failover = await wait_leader(fleet, spare, LEASE_TTL_S + 60)
            pause_v_s, pause_v = await first_version_by(fleet, third, t_pause, 300)
            v_new = await fleet.version()
            await fleet.wait_version(v_new + 1, 300, watch=[third])
            fleet.signal(spare, signal.SIGCONT)
            stepped_down = await _wait_log(fleet.procs[spare].log_path, "back to standby", 60)
            books = await fleet.wait_trained(ids, 600, feeding=feeding, with_checkpoint=True, watch=[third])
            line = version_line(await weights_history(fleet.bus))
            # workers refuse every delta the woken old leader got out (each worker sees each one)
            refused = sum(_refused_stale(p.log_path) for p in fleet.procs.values() if p.component == "rollout_worker")
            clean = not line["gaps"] and not line["forks"]
            deposed = deposed_publishes(fleet.procs[spare].log_path)
            target = LEASE_TTL_S + 5
            return [row("trainer_leader_sigkill", books, failover, clean and failover <= target, target_s=target,
                        versions=line["top"], gaps=len(line["gaps"]), forks=len(line["forks"]),
                        first_version_after_death_s=round(first_v_s, 2),
                        first_trained_after_death_s=first_trained_on(fleet, spare, first_v, t_death)),
                    row("trainer_leader_sigstop", books, pause_failover,
                        clean and stepped_down and pause_failover <= target and line["late_old_epoch"] == 0
                        and deposed["attempts"] >= 1 and deposed["refused"] == deposed["attempts"],
                        target_s=target, late_old_epoch_deltas=line["late_old_epoch"], refused_by_workers=refused,
                        first_version_after_death_s=round(pause_v_s, 2),
                        first_trained_after_death_s=first_trained_on(fleet, third, pause_v, t_pause),
                        deposed_publish_attempts=deposed["attempts"], deposed_publish_refused=deposed["refused"],
                        old_leader_stepped_down=stepped_down, epochs=len(line["epochs"]))]
        finally:
            await fleet.close()


async def _wait_log(log_path: Path, text: str, timeout_s: float) -> bool:
    t0 = time.monotonic()
    while text not in log_path.read_text(errors="replace"):
        if time.monotonic() - t0 > timeout_s:
            return False
        await asyncio.sleep(0.2)
    return True


def _refused_stale(log_path: Path) -> int:
    return sum(1 for line in log_path.read_text(errors="replace").splitlines()
               if "weight update refused" in line and "stale_epoch" in line)


async def restart_nats(run_dir: Path, tasks: int = 100, seed: int = 4, down_s: float = 2.0) -> dict:
    """Kill the nats-server mid-run and start it again on the same store dir and port."""
    srv = EmbeddedServer(store_dir=run_dir / "nats")
    await srv.start()
    fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
    try:
        await pipeline(fleet, workers=2)
        ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
        await fleet.wait_version(2, 300, watch=fleet.alive())
        await asyncio.sleep(random.Random(seed).uniform(0.5, 3.0))
        before = await fleet.version()
        t_kill = time.monotonic()
        await srv.restart(kill=True, down_s=down_s)      # SIGKILL: no clean shutdown of the store
        t_up = time.monotonic()
        await fleet.wait_version(before + 1, 120, watch=fleet.alive())
        rec = time.monotonic() - t_kill                   # includes the down_s outage
        books = await fleet.wait_trained(ids, 600, feeding=feeding, watch=fleet.alive())
        return row("nats_restart", books, rec, True, down_s=down_s, after_up_s=round(rec - (t_up - t_kill), 2))
    finally:
        await fleet.close()
        await srv.stop()


async def cluster_node_loss(run_dir: Path, tasks: int = 100, seed: int = 5) -> dict:
    """3-node JetStream cluster (deploy/nats configs, per-role users), R3 streams; SIGKILL a
    random node mid-run (clients list all three); training continues, nothing lost."""
    from tests.test_deploy_nats import (ConfServer, cluster_replacements, get_json, render_nats_configs,
                                        role_env_vars, role_passwords, wait_until)
    passwords = role_passwords()
    conf = render_nats_configs(run_dir / "conf", cluster_replacements(run_dir))
    nodes = [ConfServer(conf / f"cluster-{n}.conf", role_env_vars(passwords), run_dir / f"nats-{n}.log")
             for n in "abc"]
    fleet = None
    try:
        await asyncio.gather(*(asyncio.to_thread(n.start) for n in nodes))

        def meta_leader():
            leaders = {(get_json(f"{n.monitor_url}/jsz").get("meta_cluster") or {}).get("leader") for n in nodes}
            return len(leaders) == 1 and None not in leaders
        await asyncio.to_thread(wait_until, meta_leader, 60, "JetStream meta leader")
        roles = {r: (r, passwords[r]) for r in ("admin", "trainer", "worker", "scorer")}
        fleet = await Fleet(run_dir, [n.url for n in nodes], replicas=3, roles=roles, seed=seed).open()
        await pipeline(fleet, workers=2)
        ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
        await fleet.wait_version(2, 300, watch=fleet.alive())
        await asyncio.sleep(random.Random(seed).uniform(0.5, 3.0))
        victim = random.Random(seed).choice(nodes)
        before = await fleet.version()
        victim.stop(kill=True)
        t_kill = time.monotonic()
        await fleet.wait_version(before + 1, 120, watch=fleet.alive())
        rec = time.monotonic() - t_kill
        books = await fleet.wait_trained(ids, 600, feeding=feeding, watch=fleet.alive())
        return row("cluster_node_sigkill", books, rec, True, node=victim.conf.stem, replicas=3)
    finally:
        if fleet is not None:
            await fleet.close()
        await asyncio.gather(*(asyncio.to_thread(n.stop) for n in nodes))


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
                rec, redelivered = await fleet.wait_redelivered(topo.TASKS, topo.ROLLOUT_CONSUMER, info,
                                                                t_stop, fleet.ack_wait_s + 60)
                await asyncio.sleep(max(0.0, fleet.ack_wait_s + 1 - (time.monotonic() - t_stop)))
                paused_s = time.monotonic() - t_stop       # beyond ack_wait in any case
                fleet.signal(victim, signal.SIGCONT)
                if redelivered:
                    break
            books = await fleet.wait_trained(ids, 600, feeding=feeding, watch=fleet.alive())
            await asyncio.sleep(fleet.ack_wait_s)      # let the woken worker finish its late publishes
            # every rollout id is stored once in ROLLOUTS: the late copies were dropped by Nats-Msg-Id
            stored = (await fleet.bus.js.stream_info(topo.ROLLOUTS)).state.last_seq
            extra = stored - len(ids) * GROUP
            return row("worker_sigstop", books, rec, rec <= fleet.ack_wait_s + 10 and extra == 0 and redelivered > 0,
                       paused_s=round(paused_s, 2), pauses=i + 1, redelivered=redelivered,
                       target_s=fleet.ack_wait_s + 10, rollouts_stored_twice=extra)
        finally:
            await fleet.close()


async def dlq_entries(bus) -> list[tuple[str, str]]:
    """(subject, Rl-Reason) of every message parked in DLQ."""
    return [(raw.subject, (raw.headers or {}).get("Rl-Reason", ""))
            for raw in await stream_messages(bus, topo.DLQ, "rl.dlq.>")]


def bad_bodies(good) -> dict[str, bytes]:
    """Malformed msgpack, wrong schema, a missing required field, an absurd size claim: bodies
    that decode (or the consumer's own checks) must refuse, for the kind of event `good` is."""
    import dataclasses
    import msgpack
    d = good.to_dict()
    required = next(f.name for f in dataclasses.fields(good)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    huge = list(range(100)) * 2000                       # 200,000 prompt tokens > events.MAX_TOKENS
    if "rollout" in d:                                   # Scored: the rollout inside claims it
        absurd = {**d, "rollout": {**d["rollout"], "prompt_ids": huge}}
    elif "prompt_ids" in d:
        absurd = {**d, "prompt_ids": huge}
    else:                                                # Task: a 10^9-token, 10^9-sample request
        absurd = {**d, "task_id": "absurd", "sampling": {"max_tokens": 10**9, "n": 10**9}}
    return {"malformed": b"\xc1\x00not msgpack", "wrong_schema": msgpack.packb({**d, "schema": 99}),
            "missing_field": msgpack.packb({k: v for k, v in d.items() if k != required}),
            "absurd_size": msgpack.packb(absurd)}


async def bad_input(run_dir: Path, tasks: int = 40, seed: int = 7) -> dict:
    """Bad events on every work stream and a poison task (its verifier raises on every delivery)
    while real processes train: each bad body lands in DLQ with a reason, the poison task after
    max_deliver deliveries; every good task is still trained once."""
    from bus.events import Rollout, Scored, Task
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            await pipeline(fleet, workers=1)
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            ro = Rollout(rollout_id="bad-0", task_id="bad", env="arith", sample_index=0, group_size=GROUP,
                         prompt="1+1=", spec={"answer": "2"}, prompt_ids=[1, 2], completion_ids=[3], completion_text="#2",
                         logprobs=[-0.1], token_versions=[0], sampling={}, sampling_mask={}, quant={},
                         finish_reason="stop", cost_tokens=1, wall_s=0.0, worker_id="x")
            t = Task(task_id="bad-task", env="arith", prompt="1+1=", spec={"answer": "2"})
            sc = Scored(rollout=ro.to_dict(), success=1.0, cost=1.0, lambda_=0.0, penalty=0.0, reward=1.0,
                        reason="ok", cost_wall_s=0.0, tool_calls=0, scorer_id="x")
            sent = 0
            for subject, good in ((topo.task_subject("arith"), t), (topo.rollout_subject("arith"), ro),
                                  (topo.scored_subject("arith"), sc)):
                for kind, body in bad_bodies(good).items():
                    await fleet.bus.publish(subject, body, msg_id=f"bad-{subject}-{kind}")
                    sent += 1
            # poison: int() of a 5000-digit answer raises ValueError inside the verifier, every time
            poison = Task(task_id="poison", env="arith", prompt="1+1=", spec={"answer": "9" * 5000},
                          sampling={"n": GROUP, "max_tokens": MAX_TOKENS})
            await fleet.bus.publish(topo.task_subject("arith"), poison)
            t0 = time.monotonic()
            books = await fleet.wait_trained(ids, 600, feeding=feeding, watch=fleet.alive())
            want = sent + GROUP                  # the poison task's rollouts are parked one by one
            while len(entries := await dlq_entries(fleet.bus)) < want and time.monotonic() - t0 < 120:
                await asyncio.sleep(0.5)
            reasons = [r for _, r in entries]
            poison_parked = sum(1 for r in reasons if "handler failed" in r and "ValueError" in r)
            return row("bad_input_dlq", books, time.monotonic() - t0,
                       len(entries) == want and all(reasons) and poison_parked == GROUP,
                       bad_events=sent, dlq=len(entries), poison_parked=poison_parked,
                       reasons=sorted({r[:90] for r in reasons}))
        finally:
            await fleet.close()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def backlog(run_dir: Path, tasks: int = 10_000, seed: int = 8, watch_s: float = 20.0) -> dict:
    """A worker runs, is stopped; 10,000 tasks queue up with no consumer; a worker restarted on
    that backlog holds only what its slots take, and its memory stays flat while it works."""
    import policy
    from bus.weights import WeightPublisher
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            cfg = policy.ModelConfig.preset(MODEL["preset"], vocab_size=policy.CharTokenizer.default().vocab_size,
                                            **{k: v for k, v in MODEL.items() if k != "preset"})
            state = policy.inference_state(policy.Transformer(cfg))
            await WeightPublisher(fleet.bus, epoch=1, trainer_id="harness").publish_keyframe(state, 0, cfg)
            fleet.worker("w-old")                     # a worker that was running, then stopped (drained)
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
            ready_s = t0 - t_start                           # restart -> serving, with 10,000 queued
            rss, held = [], []
            while time.monotonic() - t0 < watch_s:
                fleet.check_alive(["w0"])
                rss.append(rss_mb(pid))
                held.append((await fleet.consumer(topo.TASKS, topo.ROLLOUT_CONSUMER)).num_ack_pending)
                await asyncio.sleep(0.25)
            fleet.signal("w0", signal.SIGTERM)            # drain: held tasks finished or released
            fleet.procs["w0"].popen.wait(60)
            left = (await fleet.bus.js.stream_info(topo.TASKS)).state.messages
            rids = await _rollout_ids(fleet.bus)
            done = {r.rsplit("-", 1)[0] for r in rids}
            lost = tasks - left - len(done)
            cap = 8 + 4                                   # the worker's slots + queue (Fleet.worker)
            half = len(rss) // 2
            growth = max(rss[half:]) - max(rss[:half])      # second half vs first half of the watch
            ok = queued == tasks and max(held) <= cap and growth < 50 and lost == 0
            # no trainer runs here: this scenario measures the worker's memory and prefetch bound.
            # Its books come from the streams (tasks neither still queued nor finished), and
            # nothing is claimed about training (trained / duplicates_trained: None)
            return {"name": "backlog_10k", "tasks": tasks, "lost": lost, "duplicates_trained": None,
                    "trained": None, "measures": "worker memory and prefetch bound under a 10k-task backlog "
                                                 "(no trainer; lost = tasks neither queued nor finished)",
                    "recovery_s": round(ready_s, 2), "passed": bool(ok), "queued": queued,
                    "held_max": max(held), "held_cap": cap, "rss_mb_max": round(max(rss), 1),
                    "rss_growth_mb": round(growth, 1), "finished": len(done), "left_queued": left,
                    "rollouts_stored_twice": len(rids) - len(set(rids))}
        finally:
            await fleet.close()


async def _rollout_ids(bus) -> list[str]:
    from bus.events import Rollout, decode
    from nats.js.errors import NotFoundError
    info = await bus.js.stream_info(topo.ROLLOUTS)
    out = []
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
        try:
            out.append(decode((await bus.js.get_msg(topo.ROLLOUTS, seq)).data, Rollout).rollout_id)
        except NotFoundError:
            continue
    return out



# ------------------------------------------------- issue 14: slow steps, sync poison, kill storm
async def slow_step_kill(run_dir: Path, tasks: int = 40, seed: int = 9, delay_factor: float = 4.0) -> dict:
    """The leader's step + publication is made slower than ack_wait (debug_step_delay_s); it is
    SIGKILLed 2 x ack_wait after it took a batch (past the point where the server would have
    redelivered that batch, before the step's checkpoint). The standby takes over and trains
    every rollout, each exactly once: nothing of the in-flight batch was acked early."""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            fleet.trainer("A", debug_step_delay_s=delay_factor * fleet.ack_wait_s)
            await wait_ready(fleet, ["A"])
            await pipeline(fleet, workers=2, trainers=("B",))       # B waits on standby
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
            a_steps = sum(1 for ln in a_log.read_text().splitlines() if '"rollout_ids"' in ln) if a_log.exists() else 0
            return row("slow_step_kill", books, first_v_s,
                       v_before == 0 and a_steps == 0 and info.num_ack_pending >= batch
                       and not line["gaps"] and not line["forks"],
                       step_delay_s=delay_factor * fleet.ack_wait_s, held_at_kill=info.num_ack_pending,
                       version_at_kill=v_before, leader_logged_steps=a_steps, lease_failover_s=round(failover, 2),
                       first_version_after_death_s=round(first_v_s, 2),
                       first_trained_after_death_s=first_trained_on(fleet, "B", first_v, t_death))
        finally:
            await fleet.close()


async def sync_poison_task(run_dir: Path, tasks: int = 4, seed: int = 10, timeout_s: float = 15.0) -> dict:
    """A --sync trainer publishes exactly batch_groups tasks per version. One task of version 0's
    batch is swapped for a poison copy (its verifier raises on every delivery: each rollout lands
    in DLQ); the trainer publishes a replacement after sync_task_timeout_s and the run goes on to
    `tasks` versions. Books: every task the trainer fed, bar the poison, trained exactly once."""
    from bus.events import Task, decode
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
            fleet.trainer("A", mode="sync", feed=True, sync_task_timeout_s=timeout_s, max_steps=steps,
                          task_sampling={"max_tokens": MAX_TOKENS, "temperature": 1.0})
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
            poison = Task(task_id=victim.task_id, env=victim.env, prompt=victim.prompt, spec={"answer": "9" * 5000},
                          sampling=victim.sampling, min_version=victim.min_version)
            await fleet.bus.publish(raw.subject, poison, msg_id=f"poison-{victim.task_id}")
            t_poison = time.monotonic()
            for i in range(2):
                fleet.worker(f"w{i}")
            await wait_ready(fleet, ["w0", "w1"])
            await fleet.wait_version(steps, 600, watch=["s0", "w0", "w1"])
            rec_s = time.monotonic() - t_poison
            fleet.procs["A"].popen.wait(120)                      # max_steps: it finishes by itself
            await rec.unsubscribe()
            good = sorted(set(fed) - {victim.task_id})
            books = fleet.books(good, with_checkpoint=True)
            t1 = time.monotonic()
            while (parked := sum(1 for _, r in await dlq_entries(fleet.bus) if "handler failed" in r)) < GROUP \
                    and time.monotonic() - t1 < 60:
                await asyncio.sleep(0.5)
            replaced = max((d.get("sync_replaced", 0) for d in fleet.step_lines()), default=0)
            return row("sync_poison_task", books, rec_s,
                       fleet.procs["A"].popen.returncode == 0 and replaced >= 1 and parked == GROUP,
                       versions=await fleet.version(), sync_replaced=replaced, poison_parked=parked,
                       sync_task_timeout_s=timeout_s)
        finally:
            await fleet.close()


async def dlq_task_ids(bus) -> dict[str, str]:
    """task id -> Rl-Reason of every task, rollout or scored rollout parked in DLQ."""
    from bus.events import EventError, Rollout, Scored, Task, decode
    out = {}
    for raw in await stream_messages(bus, topo.DLQ, "rl.dlq.>"):
        try:
            ev = decode(raw.data)
        except EventError:
            continue                                   # a malformed body has no task to account for
        tid = (ev.task_id if isinstance(ev, (Task, Rollout)) else
               ev.rollout.get("task_id") if isinstance(ev, Scored) else None)
        if tid:
            out[tid] = (raw.headers or {}).get("Rl-Reason", "")
    return out


def _ready(fleet: Fleet, name: str) -> bool:
    p = fleet.procs[name]
    return p.popen.poll() is None and any(w in p.log_path.read_text(errors="replace") for w in READY[p.component])


async def random_kill_storm(run_dir: Path, tasks: int = 0, seed: int = 11, duration_s: float = 180.0,
                            every_s: tuple[float, float] = (5.0, 15.0)) -> dict:
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
                if len(trainers) >= 2 and all(_ready(fleet, t) for t in trainers):
                    kinds.append("trainer")
                kind = rng.choice(kinds)
                victim = rng.choice(fleet.alive(kind))
                was_leader = kind == "trainer" and await holder(fleet) == victim
                fleet.signal(victim, signal.SIGKILL)
                t_death = time.time()
                n += 1
                kills["leader" if was_leader else kind] += 1
                start[kind](f"{victim.rstrip('0123456789_')}_{n}" if kind == "trainer" else f"{victim[0]}{n + 10}")
                if was_leader:
                    deaths.append(t_death)
                    failovers.append(round((await wait_leader(fleet, victim, LEASE_TTL_S + 60))[1], 2))
            await feeding
            ids += await fleet.publish_tasks(BATCH_GROUPS)     # work after the last death: a step to time
            books = await fleet.wait_trained(ids, 900, with_checkpoint=True)
            parked = await dlq_task_ids(fleet.bus)
            unaccounted = books.lost
            if books.lost:           # a task parked in DLQ with a reason is accounted for, not lost
                per_task = Counter(r.rsplit("-", 1)[0] for r in set(fleet.trained_counts()) | fleet.consumed())
                unaccounted = sum(1 for t in ids if per_task[t] < GROUP and not parked.get(t))
            books.lost = unaccounted
            line = version_line(await weights_history(fleet.bus))
            steps = sorted((d["ts"], d.get("epoch", 0)) for d in fleet.step_lines() if "ts" in d)
            gaps = []
            for t_death in deaths:                     # death -> the first step logged after it
                after = [ts for ts, _ in steps if ts > t_death]
                if after:
                    gaps.append(after[0] - t_death)
            return row("random_kill_storm", books, max(failovers, default=0.0),
                       not line["gaps"] and not line["forks"] and len(gaps) == len(deaths)
                       and all(f <= LEASE_TTL_S + 5 for f in failovers),
                       lease_failover_s=failovers, target_s=LEASE_TTL_S + 5,
                       duration_s=duration_s, kills=n, kills_by_kind=dict(kills), parked_in_dlq=len(parked),
                       versions=line["top"], gaps=len(line["gaps"]), forks=len(line["forks"]),
                       first_version_after_death_s=[round(g, 2) for g in gaps])
        finally:
            await fleet.close()


# ------------------------------------------------------------- weights: forgery and fencing
HUGE_EPOCH = 10 ** 9


def deposed_publishes(log_path: Path) -> dict:
    """A deposed leader's publication attempts, from its log: each must be refused by the server."""
    text = log_path.read_text(errors="replace")
    refused = text.count("weights write refused by the server")      # every refused write (probe included)
    other = text.count("deposed leader publish ACCEPTED") + text.count("deposed leader publish failed")
    return {"attempts": refused + other, "refused": refused}


async def worker_beats(fleet: Fleet) -> dict[str, dict]:
    """The latest heartbeat metrics of every live worker (version, epoch, ...)."""
    from bus.events import Heartbeat, decode
    out = {}
    for name in fleet.alive("rollout_worker"):
        try:
            raw = await fleet.bus.js.get_last_msg(topo.TELEMETRY, topo.heartbeat_subject("rollout_worker", name))
            hb = decode(raw.data, Heartbeat)
        except Exception:
            continue
        out[name] = {**hb.metrics, "version": hb.version}
    return out


async def _weights_by_seq(bus) -> list:
    """(stream sequence, event) of every WEIGHTS message, in order."""
    from bus.events import decode
    return [(raw.seq, decode(raw.data)) for raw in await stream_messages(bus, topo.WEIGHTS, "rl.weights.>")]


def _refusals(log_path: Path) -> Counter:
    out = Counter()
    for line in log_path.read_text(errors="replace").splitlines():
        if "weight update refused" in line:
            try:
                out[json.loads(line).get("reason", "?")] += 1
            except ValueError:
                out["?"] += 1
    return out


async def forged_weights(run_dir: Path, tasks: int = 60, seed: int = 9) -> dict:
    """A signed run; a hostile publisher on rl.weights.> replays the first keyframe with a huge
    epoch, re-labels it as a future version, and swaps a validly signed payload of another epoch
    into a delta announcement. Every worker refuses each one and keeps following the real leader
    (its versions keep rising on the real epoch); every task is trained exactly once."""
    import dataclasses

    import delta_codec
    from bus.weights import signed_fields
    from delta_codec.signing import generate_keypair, sign
    sk, pk = generate_keypair()
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            fleet.trainer("A", signing_key=sk.hex())
            for i in range(2):
                fleet.worker(f"w{i}", public_key=pk.hex())
            fleet.scorer("s0")
            await wait_ready(fleet, list(fleet.procs))
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            await fleet.wait_version(2, 300, watch=fleet.alive())
            history = await weights_history(fleet.bus)
            kf0 = next(e for e in history if e.KIND == "Keyframe")
            last = [e for e in history if e.KIND == "Delta"][-1]
            epoch = kf0.epoch
            # a payload validly signed by the trainer's key, but for another (deposed) epoch
            base = {k: v.clone() for k, v in delta_codec.load_keyframe(delta_codec.Keyframe.from_bytes(
                kf0.payload if kf0.payload is not None else await fleet.bus.get_blob(kf0.blob))).items()}
            other = {k: (v + 1).to(v.dtype) if v.is_floating_point() else v for k, v in base.items()}
            d = delta_codec.encode_delta(base, other, from_version=last.to_version, to_version=last.to_version + 1)
            payload = delta_codec.Delta(d.from_version, d.to_version, d.records,
                                        extra=signed_fields(epoch - 1, kf0.trainer_id)).to_bytes()
            await fleet.bus.put_blob("forged-swap", payload)
            forgeries = [
                (topo.KEYFRAME_SUBJECT, dataclasses.replace(kf0, epoch=HUGE_EPOCH), "forged-epoch"),
                (topo.KEYFRAME_SUBJECT, dataclasses.replace(kf0, version=last.to_version + 50), "forged-version"),
                (topo.DELTA_SUBJECT, dataclasses.replace(
                    last, from_version=d.from_version, to_version=d.to_version, size=len(payload),
                    base_digest=d.base_digest, new_digest=d.new_digest, signature=sign(sk, payload),
                    payload=None, blob="forged-swap", epoch=epoch), "forged-swap")]
            t0 = time.monotonic()
            forged_seqs = {(await fleet.bus.publish(subject, ev, msg_id=mid)).seq for subject, ev, mid in forgeries}
            v_forged = await fleet.version()
            await fleet.wait_version(v_forged + 2, 300, watch=fleet.alive())
            # every worker back on the real line: newest versions, the real epoch
            while True:
                beats = await worker_beats(fleet)
                if len(beats) == 2 and all(b["version"] >= v_forged + 1 and b.get("epoch") == epoch
                                           for b in beats.values()):
                    break
                if time.monotonic() - t0 > 120:
                    raise ChaosError(f"workers not back on the real leader: {beats}")
                await asyncio.sleep(0.5)
            recovery = time.monotonic() - t0
            books = await fleet.wait_trained(ids, 600, feeding=feeding, with_checkpoint=True, watch=["A"])
            refusals = {n: dict(_refusals(p.log_path)) for n, p in fleet.procs.items()
                        if p.component == "rollout_worker"}
            # each worker examined the forged keyframe (newer epoch) and the forged future version
            each = all(r.get("fields", 0) + r.get("epoch", 0) >= 1 and r.get("corrupt", 0) >= 1
                       for r in refusals.values())
            line = version_line([e for seq, e in await _weights_by_seq(fleet.bus) if seq not in forged_seqs])
            return row("forged_weights", books, recovery, each and not line["forks"] and not line["gaps"],
                       forgeries=len(forgeries), versions=line["top"],
                       refusals=refusals, worker_epochs=sorted({b.get("epoch") for b in beats.values()}),
                       real_epoch=epoch)
        finally:
            await fleet.close()


async def deposed_leader_publish(run_dir: Path, tasks: int = 80, seed: int = 10, stop_at: int = 3) -> dict:
    """The leader freezes itself exactly between its lease CAS and the WEIGHTS write of version
    `stop_at` (`stop_before_publish`); the standby takes over and publishes; the old leader is
    resumed and its write must be refused by the server: nothing of its epoch after the takeover
    is in the stream, so no worker can apply it."""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            fleet.trainer("A", stop_before_publish=stop_at, probe_when_deposed=True)
            await wait_ready(fleet, ["A"])
            fleet.trainer("B")
            await pipeline(fleet, workers=2, trainers=())
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            a = fleet.procs["A"]
            if not await _wait_log(a.log_path, "fault injection: stopping before publish", 300):
                raise ChaosError(f"leader A never reached its publication of v{stop_at}")
            t_stop = time.monotonic()
            new, failover = await wait_leader(fleet, "A", LEASE_TTL_S + 60)
            await fleet.wait_version(stop_at + 1, 300, watch=[new])     # the new leader published
            first_version_s = time.monotonic() - t_stop
            fleet.signal("A", signal.SIGCONT)
            stepped_down = await _wait_log(a.log_path, "back to standby", 60)
            books = await fleet.wait_trained(ids, 600, feeding=feeding, with_checkpoint=True, watch=[new])
            events = await weights_history(fleet.bus)
            epochs = [e.epoch for e in events]
            e_old = min(epochs)
            takeover = next(i for i, e in enumerate(events) if e.epoch > e_old)
            late = [e.msg_id() for e in events[takeover:] if e.epoch == e_old]
            line = version_line(events)
            deposed = deposed_publishes(a.log_path)
            passed = (stepped_down and not late and not line["gaps"] and not line["forks"]
                      and deposed["attempts"] >= 1 and deposed["refused"] == deposed["attempts"])
            return row("deposed_leader_publish", books, failover, passed, target_s=LEASE_TTL_S + 5,
                       first_version_after_stop_s=round(first_version_s, 2),
                       deposed_publish_attempts=deposed["attempts"], deposed_publish_refused=deposed["refused"],
                       old_epoch_after_takeover=late, old_leader_stepped_down=stepped_down,
                       versions=line["top"], gaps=len(line["gaps"]), forks=len(line["forks"]))
        finally:
            await fleet.close()          # SIGCONT + SIGTERM to everyone, A included

# ------------------------------------------------- supervision: a worker's feed, `asyncrl up`
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
            fleet.worker("w0", fault_weights_after=fault_after, restart_backoff_s=0.5)
            fleet.worker("w1")
            await wait_ready(fleet, ["A", "s0", "w0", "w1"])
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            seen: dict = {}

            async def watch() -> None:       # failure (w0's log) -> first heartbeat on the latest version
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
            except asyncio.TimeoutError:
                pass
            top = await fleet.version()
            w0 = (await worker_beats(fleet)).get("w0", {})
            failed = "fail" in seen
            rec = round(seen["ok"] - seen["fail"], 2) if "ok" in seen else None
            ok = (failed and rec is not None and w0.get("version") == top and w0.get("restarts", 0) >= 1
                  and fleet.procs["w0"].popen.poll() is None)
            return row("worker_feed_crash", books, rec if rec is not None else -1.0, ok, latest_version=top,
                       worker_version=w0.get("version"), feed_restarts=w0.get("restarts"), fault_after=fault_after)
        finally:
            await fleet.close()


async def _up_books(up_dir: Path, counts: Counter, group: int) -> Books:
    """The books of a finished `asyncrl up` run, from its own JetStream store: every rollout of
    every task the trainer fed (TASKS' last sequence) is trained, or still queued (its task in
    TASKS, or it in ROLLOUTS / SCORED: durable, not lost; the run stopped at its step count), or
    parked in DLQ; whatever is none of these is lost."""
    from bus.events import EventError, Rollout, Scored, Task, decode
    async with EmbeddedServer(store_dir=up_dir / "nats") as srv:
        bus = await connect(BusConfig(servers=[srv.url], name="chaos-books"))
        try:
            fed = int((await bus.js.stream_info(topo.TASKS)).state.last_seq)
            queued: set[str] = set()
            for stream, subjects in (*topo.WORK_STREAMS.items(), (topo.DLQ, "rl.dlq.>")):
                for raw in await stream_messages(bus, stream, subjects):
                    try:
                        ev = decode(raw.data)
                    except EventError:
                        continue
                    if isinstance(ev, Task):
                        queued |= {f"{ev.task_id}-{i}" for i in range(group)}
                    elif isinstance(ev, Rollout):
                        queued.add(ev.rollout_id)
                    elif isinstance(ev, Scored):
                        queued.add(ev.rollout.get("rollout_id", ""))
        finally:
            await bus.close()
    accounted = len(set(counts) | queued)
    return Books(tasks=fed, lost=max(0, fed * group - accounted),
                 duplicates_trained=sum(c - 1 for c in counts.values() if c > 1),
                 trained=len(counts), consumed=len(counts), dropped=0)


async def up_supervisor(run_dir: Path, tasks: int = 0, seed: int = 13, kills: int = 5, steps: int = 80) -> dict:
    """`asyncrl up` supervises its children: SIGKILL a random worker or scorer of a running run
    `kills` times; each is restarted with backoff, the run finishes its steps, summary.json counts
    every restart, nothing is trained twice. recovery_s: the longest kill -> replacement running."""
    from bench.up_driver import SMALL_RUN, child_pid, kill_run, start_up, summary_of, trainer_version, wait_for
    rng = random.Random(seed)
    config = SMALL_RUN.replace("[up]\n", "[up]\ngrace_s = 3.0\nmax_restarts = 8\nrestart_backoff_s = 0.5\n") \
        .replace("eval_every = 3", "eval_every = 0")
    run_dir.mkdir(parents=True, exist_ok=True)
    proc, up_dir = start_up(run_dir, config, steps=steps, minutes=8)
    out, done, recs = run_dir / "up.out", Counter(), []
    try:
        await wait_for(lambda: trainer_version(up_dir) >= 1, 240, "version 1", proc, out)
        for _ in range(kills):
            await asyncio.sleep(rng.uniform(0.5, 2.0))
            name = rng.choice(["worker-0", "worker-1", "scorer-0"])
            pid = await wait_for(lambda: child_pid(up_dir, name), 60, f"{name} running", proc, out)
            os.kill(pid, signal.SIGKILL)
            t = time.monotonic()
            done["scorer" if name.startswith("scorer") else "rollout_worker"] += 1
            await wait_for(lambda: child_pid(up_dir, name) not in (None, pid), 60, f"{name} replaced", proc, out)
            recs.append(time.monotonic() - t)
        code = await asyncio.to_thread(proc.wait, 600)
        s = summary_of(up_dir)
        rows = [json.loads(x) for x in (up_dir / "metrics" / "trainer.jsonl").read_text().splitlines() if x]
        counts = Counter(rid for r in rows if "samples" in r for rid in r["rollout_ids"])
        restarts = {k: v for k, v in s.get("restarts", {}).items() if v}
        books = await _up_books(up_dir, counts, group=4)
        ok = code == 0 and s.get("versions", 0) >= steps and restarts == dict(done)
        return row("up_supervisor", books, max(recs, default=0.0), ok, kills=dict(done), restarts=restarts,
                   versions=s.get("versions"), exit_code=code, replacement_s=[round(r, 2) for r in recs])
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_run(up_dir)


SCENARIOS = {
    "worker_sigkill": kill_workers,
    "scorer_sigkill": kill_scorer,
    "trainer_leader": leader_failover,
    "nats_restart": restart_nats,
    "cluster_node_sigkill": cluster_node_loss,
    "worker_sigstop": pause_worker,
    "bad_input_dlq": bad_input,
    "backlog_10k": backlog,
    "slow_step_kill": slow_step_kill,
    "sync_poison_task": sync_poison_task,
    "random_kill_storm": random_kill_storm,
    "forged_weights": forged_weights,
    "deposed_leader_publish": deposed_leader_publish,
    "worker_feed_crash": worker_feed_crash,
    "up_supervisor": up_supervisor,
}


async def _trainer_rank_kill(run_dir: Path, **kw) -> dict:      # bench/chaos_rank_kill.py (imports this module)
    from .chaos_rank_kill import trainer_rank_kill
    return await trainer_rank_kill(run_dir, **kw)


SCENARIOS["trainer_rank_kill"] = _trainer_rank_kill
