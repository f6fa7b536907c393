"""The processes of a chaos run: real trainer / scorer / rollout-worker processes on a real
nats-server, each with its config and log under the run dir; feeding them tasks, signalling
them, and waiting on what the broker reports (versions, held and redelivered messages).

    fleet = await Fleet(run_dir, servers=[srv.url]).open()   # harness bus connection, provisioned
    fleet.trainer("A"); fleet.scorer("s0"); fleet.worker("w0")
    tasks = await fleet.publish_tasks(200)
    ... SIGKILL / SIGSTOP / server restart ...
    books = await fleet.wait_trained(tasks, timeout_s=300)   # Books(lost, duplicates_trained)
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.launch import Proc, spawn
from bus import BusConfig, TopologyConfig, connect
from bus import topology as topo
from bus.events import SamplingParams
from bus.weights.rules import parse_version
from envs import feeder

from . import books as ledger
from .books import Books
from .params import ACK_WAIT_S, BATCH_GROUPS, GROUP, LEASE_TTL_S, MAX_TOKENS, MODEL


class ChaosError(AssertionError):
    pass


def merged(conf: dict, over: dict) -> dict:
    """`conf` with `over` on top: a section given in both ({key: value}) is merged key by key."""
    return {
        **conf,
        **{
            k: {**conf[k], **v} if isinstance(v, dict) and isinstance(conf.get(k), dict) else v
            for k, v in over.items()
        },
    }


@dataclass
class Fleet:
    run_dir: Path
    servers: list[str]
    ack_wait_s: float = ACK_WAIT_S
    replicas: int = 1
    roles: dict | None = None  # role -> (user, password) on a server with per-role users
    procs: dict = field(default_factory=dict)  # name -> Proc
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
        conf = {
            "servers": list(self.servers),
            "name": name,
            "topology": self.topology(),
            "reconnect_wait_s": 0.25,
        }
        if self.roles:
            user, password = self.roles[role]
            conf |= {"user": user, "password": password}
        return conf

    async def open(self) -> Fleet:
        kw = {}
        if self.roles:
            user, password = self.roles["admin"]
            kw = {"user": user, "password": password}
        self.bus = await connect(
            BusConfig(
                servers=list(self.servers),
                name="chaos-harness",
                topology=TopologyConfig(**self.topology()),
                **kw,
            )
        )
        try:
            await self.bus.provision()
        except BaseException:
            await self.close()  # else its client reconnects forever to servers the caller stops
            raise
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
        """A trainer process; a section in `over` ({key: value}) is merged into these."""
        conf = {
            "trainer_id": name,
            "policy": {"model": dict(MODEL)},
            "batch": {"groups": BATCH_GROUPS, "group_size": GROUP, "max_lag": 1000, "fetch_timeout_s": 0.3},
            "tasks": {"feed": False},
            "optim": {"lr": 1e-3},
            "publish": {"keyframe_interval": 1000},
            "lease": {"ttl_s": LEASE_TTL_S, "renew_s": 1.0},
            "checkpoint": {"dir": str(self.run_dir / "ckpt"), "keep": 3},
            "run": {"dir": str(self.run_dir / f"trainer-{name}")},
            "bus": self.bus_conf("trainer", name),
        }
        return self._spawn(name, "trainer", "trainer", merged(conf, over))

    def worker(self, name: str, **over) -> Proc:
        """A rollout worker process; a section in `over` ({key: value}) is merged into these."""
        conf = {
            "worker_id": name,
            "engine": {"slots": 8, "max_len": 96, "seed": self.rng.randrange(1 << 30)},
            "admission": {"queue": 4},
            "run": {"threads": 1, "heartbeat_s": 2.0, "grace_s": 2.0},
            "bus": self.bus_conf("worker", name),
        }
        return self._spawn(name, "rollout_worker", "rollout_worker", merged(conf, over))

    def scorer(self, name: str, **over) -> Proc:
        """A scorer process; a section in `over` ({key: value}) is merged into these."""
        conf = {
            "scorer_id": name,
            "run": {"concurrency": 8, "heartbeat_s": 2.0, "provision": not self.roles},
            "bus": self.bus_conf("scorer", name),
        }
        return self._spawn(name, "scorer", "scorer", merged(conf, over))

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].popen.send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[name].popen.wait()

    def alive(self, component: str | None = None) -> list[str]:
        return [
            n
            for n, p in self.procs.items()
            if p.popen.poll() is None and (component is None or p.component == component)
        ]

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
                    p.popen.send_signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
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
        sp = SamplingParams(n=GROUP, max_tokens=MAX_TOKENS, temperature=1.0)
        return await feeder.publish_tasks(self.bus, env, n, sp, self.rng)

    async def trickle(self, n: int, over_s: float, ids: list[str]) -> None:
        """Publish `n` tasks spread over `over_s` seconds (a run that lasts, so faults land
        mid-run), appending their ids to `ids`. A broker that is down mid-fault: retry."""
        chunk = max(1, round(n / max(1.0, over_s / 2)))  # a burst every ~2 s: every worker gets some
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

    # the books are kept in books.py, from the run dir; these read them for this fleet
    def step_lines(self) -> list[dict]:
        return ledger.step_lines(self.run_dir)

    def trained_counts(self) -> Counter:
        return ledger.trained_counts(self.run_dir)

    def consumed(self) -> set[str]:
        return ledger.checkpoint_consumed(self.run_dir)

    def books(
        self, task_ids: list[str], with_checkpoint: bool = False, queued: set[str] = frozenset()
    ) -> Books:
        return ledger.tally(self.run_dir, task_ids, with_checkpoint, queued)

    async def wait_trained(
        self,
        task_ids: list[str],
        timeout_s: float,
        with_checkpoint: bool = False,
        watch: tuple = (),
        feeding: asyncio.Task | None = None,
    ) -> Books:
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
        except Exception:  # the broker is down mid-fault: unknown, not an error
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

    async def wait_held(
        self,
        stream: str,
        durable: str,
        at_least: int = 1,
        timeout_s: float = 120.0,
        until: asyncio.Task | None = None,
    ) -> bool:
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

    async def wait_redelivered(
        self, stream: str, durable: str, before, t0: float, timeout_s: float
    ) -> tuple[float, int]:
        """Recovery: every message delivered before the fault (`before`: consumer info taken
        just before it; stream seq <= its last delivered, the victim's included) has been acked,
        i.e. redelivered to a live process and finished. Also returns how many redeliveries
        happened meanwhile: deliveries (consumer seq) minus distinct messages (stream seq)."""
        while (
            info := await self.consumer(stream, durable)
        ).ack_floor.stream_seq < before.delivered.stream_seq:
            if time.monotonic() - t0 > timeout_s:
                raise ChaosError(
                    f"{stream}/{durable}: ack floor still below {before.delivered.stream_seq} "
                    f"after {timeout_s}s"
                )
            await asyncio.sleep(0.05)
        redeliveries = lambda i: i.delivered.consumer_seq - i.delivered.stream_seq  # noqa: E731
        return time.monotonic() - t0, redeliveries(info) - redeliveries(before)


READY = {
    "trainer": ("leading", "waiting for the leader lease"),
    "scorer": ("scorer started",),
    "rollout_worker": ("weights loaded",),
}


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


async def start_signed(fleet: Fleet, sk, pk, workers: int = 2) -> None:
    """A signed run: leader A signs with `sk`, `workers` workers verify with `pk`, one scorer; all ready."""
    fleet.trainer("A", publish={"signing_key": sk.hex()})
    for i in range(workers):
        fleet.worker(f"w{i}", weights={"public_key": pk.hex()})
    fleet.scorer("s0")
    await wait_ready(fleet, list(fleet.procs))


def is_ready(fleet: Fleet, name: str) -> bool:
    p = fleet.procs[name]
    return p.popen.poll() is None and any(
        w in p.log_path.read_text(errors="replace") for w in READY[p.component]
    )


async def kill_and_replace(
    fleet: Fleet, component: str, new_name: str, rng: random.Random
) -> tuple[float, int]:
    """SIGKILL a random live worker or scorer, start `new_name` in its place, and wait until the
    messages it held are handed out again: (recovery seconds, messages redelivered)."""
    stream, durable, start = {
        "rollout_worker": (topo.TASKS, topo.ROLLOUT_CONSUMER, fleet.worker),
        "scorer": (topo.ROLLOUTS, topo.SCORER_CONSUMER, fleet.scorer),
    }[component]
    victim = rng.choice(fleet.alive(component))
    info = await fleet.consumer(stream, durable)
    fleet.signal(victim, signal.SIGKILL)
    t_kill = time.monotonic()
    start(new_name)
    return await fleet.wait_redelivered(stream, durable, info, t_kill, fleet.ack_wait_s + 60)
