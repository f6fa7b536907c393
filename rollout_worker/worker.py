"""The rollout worker: tasks in, rollouts out, weights hot-patched underneath.

weights   WeightFollower.follow(engine): latest keyframe, then every verified delta in order
lag       KV `version` watched; no new task is admitted while latest - mine > max_lag
tasks     ConsumerLoop on TASKS/`rollout`, fetching only what free slots can take
handler   n completions of the task concurrently -> one Rollout each -> publish (acked)
          -> return (the loop acks the task). Killed before that: the task is redelivered,
          and Nats-Msg-Id (rollout-<task>-<i>) drops the duplicates of a partial publish.
drain     SIGTERM: stop fetching, finish within grace_s, nak the rest (EngineClosed)
supervise weight follower, version watch and heartbeat are restarted with backoff when they fail (the
          follower from the latest keyframe, so the engine is back on the newest policy);
          past max_restarts in a row the worker stops and run() raises BackgroundFailed
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
import zlib
from dataclasses import dataclass, field

import policy
from bus import BusConfig, ConsumerLoop, TransientError, get_logger, metrics
from bus import topology as topo
from bus.events import Heartbeat, Metrics, SamplingParams, Task
from bus.lifetime import cancel_and_wait
from bus.rollout_build import build_rollout
from bus.weights.regions import weight_follower
from bus.weights.rules import parse_version
from envs import isolation
from envs.episode_pool import EpisodePool
from envs.sandbox_latency import SandboxLatency
from envs.workspace import default_root

from .engine import Engine, EngineClosed
from .episodes import EpisodeRunner, is_episode_task, workspace_backend

log = get_logger(__name__)


@dataclass
class WorkerConfig:
    bus: BusConfig = field(default_factory=BusConfig)
    worker_id: str = ""  # default: <host>-<pid>
    engine: str = "torch"  # torch | vllm
    slots: int = 8  # concurrent sequences (KV cache slots)
    queue: int = -1  # sequences allowed to wait for a slot (-1: slots // 2), keeps slots full
    # episodes in flight at most (0: slots). An episode waiting on its command holds a KV row but
    # no decode row (torch engine: kv_slots = this), so > slots keeps the decoder busy while
    # episodes wait on slow tools, at the memory of the extra KV rows
    max_inflight: int = 0
    max_lag: int = 4  # stop admitting while latest_version - my_version > max_lag
    max_len: int = 0  # KV positions per slot (0: the model's max_seq_len)
    model: str = ""  # vllm: HF model dir; torch: unused (the model comes from the keyframe)
    tokenizer: str = "char"  # char (policy.CharTokenizer) | path to a tokenizer.json
    quant_sites: list[str] = field(default_factory=list)  # policy fp8 fake-quant sites to run (and replay)
    quant_block: int = 0
    seed: int = 0
    threads: int = 0  # torch intra-op threads (0: torch default)
    update_mode: str = "swap"  # torch: swap (prepare off the decode path) | inline (at the boundary)
    device: str = "cpu"  # torch engine: cpu | cuda | cuda:N (weights, KV cache and delta apply there)
    public_key: str = ""  # trainer's ed25519 public key: hex, or a file holding it; empty: no check
    metrics_port: int = 0  # Prometheus /metrics (bus.metrics); 0 = off
    heartbeat_s: float = 5.0
    grace_s: float = 30.0  # drain: time to finish held tasks before they are nak'ed
    max_restarts: int = 5  # a background task failing this many times in a row stops the worker
    restart_backoff_s: float = 0.5  # first restart delay; doubles per consecutive failure (max 30 s)
    workspace: str = "local"  # episodes' workspaces: local (directories + sandbox) | docker (containers)
    docker_image: str = ""  # workspace="docker": the default image (a task's meta["image"] wins)
    # a remote sandbox's test-suite time, modelled (envs/sandbox_latency.py; median_s 0: off):
    # every run_tests and scoring run of a task waits its deterministic lognormal draw, no local CPU
    sandbox_latency: SandboxLatency = field(default_factory=SandboxLatency)
    episode_wall_s: float = 0.0  # > 0: replaces the tasks' episode wall limit (slow sandboxes)
    # who plays multi-turn episodes: "builtin" (rollout_worker/episodes.py) | "mini-swe-agent" (an
    # external harness through the OpenAI-compatible endpoint, rollout_worker/harness.py) |
    # "external" (a harness the worker does not launch claims episodes on the endpoint,
    # rollout_worker/external.py)
    harness: str = "builtin"
    external_deadline_s: float = 600.0  # external: a claimed episode not ended by then is handed back
    harness_config: str = ""  # the harness's own config file (mini-swe-agent YAML), merged over ours
    endpoint_host: str = "127.0.0.1"  # the OpenAI-compatible endpoint the harness talks to
    endpoint_port: int = 0  # 0: any free port
    fault_weights_after: int = 0  # test hook: the weight follower fails once, at its Nth update (0: never)
    log_level: str = "info"
    # start even where the code sandbox lacks isolation layers (envs/isolation.py; never in production)
    allow_weak_sandbox: bool = False

    def __post_init__(self):
        if not self.worker_id:
            self.worker_id = f"{socket.gethostname()}-{os.getpid()}"
        if self.engine not in ("torch", "vllm"):
            raise ValueError(f"engine must be 'torch' or 'vllm', got {self.engine!r}")
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.workspace not in ("local", "docker"):
            raise ValueError(f"workspace must be 'local' or 'docker', got {self.workspace!r}")
        if self.max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {self.max_lag}")
        if self.queue < 0:
            self.queue = self.slots // 2
        if isinstance(self.sandbox_latency, dict):
            self.sandbox_latency = SandboxLatency(**self.sandbox_latency)
        if self.max_inflight == 0:
            self.max_inflight = self.slots
        if self.max_inflight < self.slots:
            raise ValueError(f"max_inflight must be 0 or >= slots ({self.slots}), got {self.max_inflight}")
        if self.harness not in ("builtin", "mini-swe-agent", "external"):
            raise ValueError(
                f"harness must be 'builtin', 'mini-swe-agent' or 'external', got {self.harness!r}"
            )
        if self.external_deadline_s <= 0:
            raise ValueError(f"external_deadline_s must be > 0, got {self.external_deadline_s}")
        if not 0 <= self.endpoint_port <= 65535:
            raise ValueError(f"endpoint_port must be in [0, 65535], got {self.endpoint_port}")
        if self.harness_config and not os.path.isfile(self.harness_config):
            raise ValueError(f"harness_config {self.harness_config!r} is not a file")
        if self.harness == "mini-swe-agent":
            import importlib.util

            if importlib.util.find_spec("minisweagent") is None:
                raise ValueError(
                    "harness 'mini-swe-agent' needs the mini-swe-agent package: pip install 'asyncrl[agents]'"
                )
        if self.episode_wall_s < 0:
            raise ValueError(f"episode_wall_s must be >= 0, got {self.episode_wall_s}")
        if self.max_restarts < 0 or self.restart_backoff_s <= 0:
            raise ValueError(
                f"max_restarts must be >= 0 and restart_backoff_s > 0, got "
                f"{self.max_restarts}, {self.restart_backoff_s}"
            )
        if self.fault_weights_after < 0:
            raise ValueError(f"fault_weights_after must be >= 0, got {self.fault_weights_after}")
        if not (self.device == "cpu" or self.device == "cuda" or re.fullmatch(r"cuda:\d+", self.device)):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")


class BackgroundFailed(RuntimeError):
    """A background task of the worker kept failing past max_restarts: replace the process."""


class InjectedFault(RuntimeError):
    """Raised by the fault_weights_after test hook."""


def make_engine(cfg: WorkerConfig, model_config: dict, eos_id: int | None) -> Engine:
    import policy

    quant = policy.QuantConfig(sites=tuple(cfg.quant_sites), block=cfg.quant_block)
    if cfg.engine == "vllm":
        from .vllm_engine import VLLMEngine

        return VLLMEngine(cfg, model_config=model_config, quant=quant, eos_id=eos_id)
    from .torch_engine import TorchEngine

    return TorchEngine(
        model_config,
        slots=cfg.slots,
        max_len=cfg.max_len,
        quant=quant,
        eos_id=eos_id,
        seed=cfg.seed,
        threads=cfg.threads,
        update_mode=cfg.update_mode,
        device=cfg.device,
        kv_slots=cfg.max_inflight,
    )


def make_episode_runner(cfg: WorkerConfig, engine: Engine, tok) -> EpisodeRunner:
    """The runner of multi-turn tasks `cfg.harness` names; its thread pool hosts every episode's commands."""
    # a pool thread per episode that can be in flight: one waiting on a slow command must
    # not hold another's reset or step back (8 threads served 12 episodes before)
    kw = dict(
        pool=EpisodePool(max(getattr(cfg, "max_inflight", cfg.slots) + cfg.queue, 1)),
        worker_id=cfg.worker_id,
        backend=workspace_backend(cfg),
        episode_wall_s=getattr(cfg, "episode_wall_s", 0.0),
    )
    harness = getattr(cfg, "harness", "builtin")
    if harness == "external":  # a harness the worker does not launch (rollout_worker/external.py)
        from .external import ExternalRunner

        return ExternalRunner(
            engine,
            tok,
            host=cfg.endpoint_host,
            port=cfg.endpoint_port,
            deadline_s=cfg.external_deadline_s,
            **kw,
        )
    if harness != "builtin":  # a harness the worker launches (rollout_worker/harness.py)
        from .harness import HarnessRunner

        return HarnessRunner(
            engine,
            tok,
            harness=cfg.harness,
            harness_config=cfg.harness_config,
            host=cfg.endpoint_host,
            port=cfg.endpoint_port,
            **kw,
        )
    return EpisodeRunner(engine, tok, **kw)


def parse_sampling(d: dict) -> SamplingParams:
    known = set(SamplingParams.__dataclass_fields__)
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"task sampling has unknown keys {sorted(unknown)}")
    sp = SamplingParams(**d)
    if not (isinstance(sp.n, int) and 1 <= sp.n <= 1024):
        raise ValueError(f"task sampling n must be an int in [1, 1024], got {sp.n!r}")
    return sp


class Worker:
    def __init__(self, cfg: WorkerConfig, bus, engine: Engine | None = None):
        self.cfg, self.bus, self.engine = cfg, bus, engine
        self.tok = policy.load_tokenizer(cfg.tokenizer)
        self.eos_id = getattr(self.tok, "eos_id", None)
        public_key = None
        if cfg.public_key:
            from delta_codec import signing

            key = cfg.public_key
            if os.path.isfile(key):
                key = open(key).read().strip()
            public_key = signing.public_key(key)  # raises a clear DeltaError on a bad key
        self.weights = weight_follower(bus, public_key=public_key, name=cfg.worker_id)  # region: its mirrors
        self.latest_version = -1
        self.group_hint = 0  # n of the last task seen: sizes fetches in slots (0: none seen yet)
        # episodes accepted and not ended: one holds no engine slot while its workspace is set up
        # (or its task waits for a version), so free_slots alone would admit far more than fit
        self.episodes_in_flight = 0
        self.episode_runner: EpisodeRunner | None = None  # made on the first episode (open_episodes)
        self.rollouts = 0
        self.tasks_done = 0
        self.parked = 0
        self.paused = False
        self.loop: ConsumerLoop | None = None
        self.restarts: dict[str, int] = {}  # background task -> restarts so far
        self.failed: str = ""  # set when a background task gave up
        self.updates = 0  # weight updates the follower applied (fault hook counts them)
        self._closing = False  # run() is shutting down: background tasks end, not restart
        self.log = log.bind(worker_id=cfg.worker_id)

    # -- admission -----------------------------------------------------------------------
    @property
    def lag(self) -> int:
        return max(0, self.latest_version - self.engine.version)

    def admissible(self) -> bool:
        ok = self.lag <= self.cfg.max_lag
        if ok == self.paused:  # log transitions only
            self.paused = not ok
            self.log.info(
                "admission paused" if self.paused else "admission resumed",
                version=self.engine.version,
                latest=self.latest_version,
                max_lag=self.cfg.max_lag,
            )
        return ok

    def capacity(self) -> int:
        if not self.admissible():
            return 0
        free = min(
            getattr(self.engine, "free_slots", self.cfg.slots),
            self.cfg.max_inflight - self.episodes_in_flight,
        )
        room = max(0, free + self.cfg.queue)
        if not self.group_hint:  # a task's n is unknown until one is seen: one at a time till then
            return min(room, 1)
        return room // self.group_hint

    async def _wait_until(self, cond) -> None:
        while not cond():
            await asyncio.sleep(0.02)

    # -- tasks ---------------------------------------------------------------------------
    async def handle(self, task: Task, ctx) -> None:
        if is_episode_task(task):  # multi-turn: turn by turn on the same engine
            return await self.handle_episodes(task, ctx)
        try:  # a task that cannot be generated here (bad sampling, prompt outside the vocab) is parked
            sp = parse_sampling(task.sampling)
            prompt_ids = self.tok.encode(task.prompt, bos=True)  # as the trainer's warm start
        except (ValueError, TypeError) as e:
            return await self._park(ctx, task, str(e))
        self.group_hint = sp.n
        # sync mode and staleness: hold the task (the loop heartbeats it) until we may generate
        await self._wait_until(lambda: self.engine.version >= task.min_version and self.admissible())
        try:
            gens = await asyncio.gather(
                *(
                    self.engine.generate(prompt_ids, sp, seed=zlib.crc32(f"{task.task_id}-{i}".encode()))
                    for i in range(sp.n)
                )
            )
        except EngineClosed as e:
            raise TransientError(f"released: {e}", delay=0) from None
        except (ValueError, TypeError) as e:  # refused by the engine: too long, bad sampling values
            return await self._park(ctx, task, str(e))
        rollouts = [
            build_rollout(
                task, i, sp.n, self.cfg.worker_id, prompt_ids, g, self.tok.decode(g.completion_ids), g.wall_s
            )
            for i, g in enumerate(gens)
        ]
        subject = topo.rollout_subject(task.env)
        await asyncio.gather(*(self.bus.publish(subject, r) for r in rollouts))  # acked by JetStream
        self.rollouts += len(rollouts)
        metrics.ROLLOUTS_PUBLISHED.inc(len(rollouts))
        self.tasks_done += 1

    def open_episodes(self) -> EpisodeRunner:
        """The worker's episode runner, made on first use (the engine exists by then): one per worker."""
        if self.episode_runner is None:
            self.episode_runner = make_episode_runner(self.cfg, self.engine, self.tok)
        return self.episode_runner

    async def handle_episodes(self, task: Task, ctx) -> None:
        """A multi-turn task: sampling.n episodes -> n Rollouts, each published as soon as it ends."""
        try:
            sp = parse_sampling(task.sampling)
            runner = self.open_episodes()
            runner.parse(task)
        except (ValueError, TypeError, KeyError) as e:
            return await self._park(ctx, task, f"bad episode task: {e}")
        self.group_hint = sp.n
        subject = topo.rollout_subject(task.env)
        self.episodes_in_flight += sp.n  # counted from here: capacity() must see them at once
        unstarted = [sp.n]

        async def one(i: int) -> None:
            # each episode is published as soon as it ends: a stuck sibling must not hold the group's
            # finished members back (the trainer closes a group after group_timeout_s with what came)
            unstarted[0] -= 1
            try:
                r = await runner.run(task, sp, i)
            finally:
                self.episodes_in_flight -= 1
            await self.bus.publish(subject, r)
            self.rollouts += 1

        try:
            await self._wait_until(lambda: self.engine.version >= task.min_version and self.admissible())
            await asyncio.gather(*(one(i) for i in range(sp.n)))
        except EngineClosed as e:
            raise TransientError(f"released: {e}", delay=0) from None
        except (ValueError, TypeError) as e:
            return await self._park(ctx, task, str(e))
        finally:
            self.episodes_in_flight -= unstarted[0]  # never started (cancelled in the version wait)
            unstarted[0] = 0
        self.tasks_done += 1

    async def _park(self, ctx, task: Task, reason: str) -> None:
        """Bad input: DLQ with the reason at once (retrying cannot help); the loop's ack is a no-op."""
        self.parked += 1
        self.log.warning("task parked in DLQ", task_id=task.task_id, reason=reason)
        await self.bus.dlq(ctx.msg, f"bad task {task.task_id}: {reason}", topo.TASKS)

    # -- background loops ----------------------------------------------------------------
    async def watch_version(self) -> None:
        while True:  # a watch broken by a reconnect is re-established
            try:
                async for value, _rev in self.bus.kv_watch(topo.KEY_VERSION):
                    self.latest_version = parse_version(value)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.log.warning("version watch failed; retrying", error=repr(e))
                await asyncio.sleep(1.0)

    def snapshot(self) -> dict:
        return {
            **self.engine.stats(),
            "lag": self.lag,
            "latest_version": self.latest_version,
            "paused": self.paused,
            "rollouts": self.rollouts,
            "tasks": self.tasks_done,
            "parked": self.parked,
            "restarts": sum(self.restarts.values()),
            "restarts_by_task": dict(self.restarts),
            "weights": self.weights.stats(),
            "loop": self.loop.stats.as_dict() if self.loop else {},
            **({"episodes": dict(self.episode_runner.stats)} if self.episode_runner else {}),
        }

    async def beat(self, event: str = "heartbeat") -> None:
        cid = self.cfg.worker_id
        m = self.snapshot()
        metrics.observe_worker(m)
        flat = {k: v for k, v in m.items() if isinstance(v, (int, float, bool, str))}
        flat["beat"] = event
        try:
            await self.bus.publish(
                topo.heartbeat_subject("rollout_worker", cid),
                Heartbeat(
                    component="rollout_worker", component_id=cid, version=self.engine.version, metrics=flat
                ),
            )
        except Exception as e:  # telemetry must never take the worker down
            self.log.warning("heartbeat publish failed", error=repr(e))
        return m, flat

    async def on_update(self, version: int, epoch: int) -> None:
        """A new version is live: say so at once (operators, `inspect`, bench.worker's publish->patched)."""
        self.log.debug("weights updated", version=version, epoch=epoch)
        self.updates += 1
        if self.updates == self.cfg.fault_weights_after:  # the one injection point of the test hook
            raise InjectedFault(
                f"injected weights-follower failure at weight update {self.updates} (fault_weights_after)"
            )
        await self.beat("patched")

    async def follow_weights(self, stop: asyncio.Event, start=None) -> None:
        """The weight follower. `start` None (a restart): from the latest keyframe, then every delta
        after it, so an engine that missed updates while the follower was down catches up."""
        await self.weights.follow(self.engine, stop, start=start, on_update=self.on_update)

    async def supervise(self, name: str, run, stop: asyncio.Event) -> None:
        """Run `run(attempt)` until the worker closes; a failure is logged and retried with
        exponential backoff. More than `max_restarts` failures in a row (a run that lasted 60 s
        resets the count) set `stop`: a supervisor can do better than a worker without weights."""
        attempt, in_a_row = 0, 0
        while not self._closing:
            t0 = time.monotonic()
            try:
                await run(attempt)
                if self._closing:
                    return
                raise RuntimeError(f"{name} returned while the worker runs")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                in_a_row = 1 if time.monotonic() - t0 > 60.0 else in_a_row + 1
                if in_a_row > self.cfg.max_restarts:
                    self.failed = f"{name}: {type(e).__name__}: {e}"
                    self.log.error(
                        "background task failed past max_restarts; stopping the worker",
                        task=name,
                        restarts=self.restarts.get(name, 0),
                        error=repr(e),
                    )
                    stop.set()
                    return
                delay = min(self.cfg.restart_backoff_s * 2 ** (in_a_row - 1), 30.0)
                self.restarts[name] = self.restarts.get(name, 0) + 1
                self.log.error(
                    "background task failed; restarting",
                    task=name,
                    error=repr(e),
                    restart=self.restarts[name],
                    in_a_row=in_a_row,
                    backoff_s=delay,
                    exc_info=e,
                )
                await asyncio.sleep(delay)
                attempt += 1

    async def heartbeat(self) -> None:
        step = 0
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            step += 1
            m, flat = await self.beat()
            if self.episode_runner:  # per-episode records ride on the metrics only
                m = {**m, "episodes_ended": self.episode_runner.drain()}
            self.log.info(
                "worker metrics", **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in flat.items()}
            )
            cid = self.cfg.worker_id
            try:
                await self.bus.publish(
                    topo.metrics_subject("rollout_worker", cid),
                    Metrics(component="rollout_worker", component_id=cid, step=step, values=m),
                )
            except Exception as e:
                self.log.warning("metrics publish failed", error=repr(e))

    # -- lifecycle -----------------------------------------------------------------------
    async def start_weights(self, stop: asyncio.Event):
        """Wait for a keyframe, build the engine from its model config, load it."""
        self.log.info("waiting for a keyframe")
        kf = await self.weights.latest_keyframe(wait=True, stop=stop)
        if kf is None:
            return None
        vocab = int(kf.model_config.get("vocab_size", 0))
        if self.cfg.engine == "torch" and getattr(self.tok, "vocab_size", 0) > vocab:
            raise ValueError(
                f"tokenizer {self.cfg.tokenizer!r} has {self.tok.vocab_size} ids but the "
                f"published model's vocab_size is {vocab}"
            )
        if self.engine is None:
            self.engine = make_engine(self.cfg, kf.model_config, self.eos_id)
        await self.engine.load_keyframe(kf.state, kf.version, kf.epoch)
        self.log.info("weights loaded", version=kf.version, epoch=kf.epoch, engine=self.cfg.engine)
        return kf

    async def run(self, stop: asyncio.Event | None = None, handle_signals: bool = True) -> None:
        # before anything else: a killed predecessor's workspaces go, and no episode runs in a
        # sandbox weaker than promised
        await isolation.startup_async(
            self.cfg.allow_weak_sandbox, default_root() if self.cfg.workspace == "local" else None
        )
        stop = stop or asyncio.Event()
        kf = await self.start_weights(stop)
        if kf is None:
            return
        if self.cfg.harness == "external":  # harnesses claim episodes there: serving before any task
            await self.open_episodes().url()
        follow_stop = asyncio.Event()
        specs = {
            "weights": lambda attempt: self.follow_weights(follow_stop, start=kf if attempt == 0 else None),
            "version": lambda attempt: self.watch_version(),
            "heartbeat": lambda attempt: self.heartbeat(),
        }
        # a background task that gives up sets `stop`: the loop drains and run() raises
        background = [
            asyncio.create_task(self.supervise(name, fn, stop), name=name) for name, fn in specs.items()
        ]
        self.loop = ConsumerLoop(
            self.bus,
            topo.TASKS,
            topo.ROLLOUT_CONSUMER,
            self.handle,
            Task,
            concurrency=self.cfg.max_inflight + self.cfg.queue,
            capacity=self.capacity,
            grace_s=self.cfg.grace_s,
            handle_signals=handle_signals,
        )
        t0 = time.perf_counter()
        try:
            await self.loop.run(stop)
        finally:
            self._closing = True
            follow_stop.set()
            await self.engine.close()
            if hasattr(self.episode_runner, "close"):  # a harness's endpoint
                await self.episode_runner.close()
            await cancel_and_wait(
                background, log=self.log
            )  # (a heartbeat that lost its cancel must not hang the stop)
            await self.weights.close()
            self.log.info(
                "worker stopped",
                wall_s=round(time.perf_counter() - t0, 2),
                failed=self.failed,
                **{k: v for k, v in self.snapshot().items() if isinstance(v, (int, float, bool, str))},
            )
        if self.failed:
            raise BackgroundFailed(self.failed)
