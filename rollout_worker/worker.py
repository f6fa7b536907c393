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
config    WorkerConfig (rollout_worker/config.py), in sections: [worker.engine] to make_engine,
          [worker.admission] to admissible/capacity, [worker.episodes] and [worker.harness] to
          make_episode_runner, [worker.weights] to the follower, [worker.run] to the loops
"""

from __future__ import annotations

import asyncio
import os
import time
import zlib

import policy
from bus import ConsumerLoop, TransientError
from bus import topology as topo
from bus.events import Heartbeat, Metrics, SamplingParams, Task
from bus.rollout_build import build_rollout
from bus.weights.regions import weight_follower
from bus.weights.rules import parse_version
from envs import isolation
from envs.episode_pool import EpisodePool
from envs.workspace import default_root, private_root
from kernel import get_logger, metrics
from kernel.lifetime import cancel_and_wait

from .config import WorkerConfig
from .endpoint_token import load_tokens
from .engine import Engine, EngineClosed
from .episodes import EpisodeRunner, is_episode_task, workspace_backend

log = get_logger(__name__)


class BackgroundFailed(RuntimeError):
    """A background task of the worker kept failing past max_restarts: replace the process."""


class InjectedFault(RuntimeError):
    """Raised by the [worker.faults] weights_after test hook."""


def make_engine(cfg: WorkerConfig, model_config: dict, eos_id: int | None) -> Engine:
    """The engine [worker.engine] names; the torch engine keeps a KV row per episode that may be in
    flight ([worker.admission] max_inflight) and runs on the process's threads ([worker.run])."""
    import policy

    eng = cfg.engine
    quant = policy.QuantConfig(sites=tuple(eng.quant_sites), block=eng.quant_block)
    if eng.kind == "vllm":
        from .vllm_engine import VLLMEngine

        return VLLMEngine(eng, model_config=model_config, quant=quant, eos_id=eos_id)
    from .torch_engine import TorchEngine

    return TorchEngine(
        model_config,
        slots=eng.slots,
        max_len=eng.max_len,
        quant=quant,
        eos_id=eos_id,
        seed=eng.seed,
        threads=cfg.run.threads,
        update_mode=eng.update_mode,
        device=eng.device,
        kv_slots=cfg.admission.max_inflight,
    )


def make_episode_runner(cfg: WorkerConfig, engine: Engine, tok) -> EpisodeRunner:
    """The runner of multi-turn tasks [worker.harness] kind names; its thread pool hosts every
    episode's commands."""
    adm, h = cfg.admission, cfg.harness
    # a pool thread per episode that can be in flight: one waiting on a slow command must
    # not hold another's reset or step back (8 threads served 12 episodes before)
    kw = dict(
        pool=EpisodePool(max(adm.max_inflight + adm.queue, 1)),
        worker_id=cfg.worker_id,
        backend=workspace_backend(cfg.episodes),
        episode_wall_s=cfg.episodes.episode_wall_s,
        task_set=cfg.episodes.task_set,
    )
    if h.token_problem():
        raise ValueError(h.token_problem())
    if h.kind != "builtin":  # the endpoint's bearer tokens: from the file, else one in memory
        kw.update(
            host=h.endpoint_host,
            port=h.endpoint_port,
            bounds=h.bounds,
            tokens=load_tokens(h.endpoint_token_file) if h.endpoint_token_file else None,
        )
        if h.endpoint_token_file:
            log.info("endpoint bearer token", file=h.endpoint_token_file)  # where, never the token
    if h.kind == "external":  # a harness the worker does not launch (rollout_worker/external.py)
        from .external import ExternalRunner

        return ExternalRunner(engine, tok, deadline_s=h.external_deadline_s, **kw)
    if h.kind != "builtin":  # a harness the worker launches (rollout_worker/harness.py)
        from .harness import HarnessRunner

        return HarnessRunner(
            engine,
            tok,
            harness=h.kind,
            harness_config=h.config,
            **kw,
        )
    return EpisodeRunner(engine, tok, **kw)


def parse_sampling(d: dict) -> SamplingParams:
    known = set(SamplingParams.__struct_fields__)
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
        self.tok = policy.load_tokenizer(cfg.engine.tokenizer)
        self.eos_id = getattr(self.tok, "eos_id", None)
        public_key = None
        if cfg.weights.public_key:
            from delta_codec import signing

            key = cfg.weights.public_key
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
        ok = self.lag <= self.cfg.admission.max_lag
        if ok == self.paused:  # log transitions only
            self.paused = not ok
            self.log.info(
                "admission paused" if self.paused else "admission resumed",
                version=self.engine.version,
                latest=self.latest_version,
                max_lag=self.cfg.admission.max_lag,
            )
        return ok

    def capacity(self) -> int:
        if not self.admissible():
            return 0
        free = min(
            getattr(self.engine, "free_slots", self.cfg.engine.slots),
            self.cfg.admission.max_inflight - self.episodes_in_flight,
        )
        room = max(0, free + self.cfg.admission.queue)
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
        try:  # a worker started for code-free environments checks the sandbox on its first episode
            await isolation.require_async(self.cfg.episodes.allow_weak_sandbox)
        except isolation.WeakSandbox as e:
            return await self._park(ctx, task, f"episode of {task.env} refused: {e}")
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
        if self.updates == self.cfg.faults.weights_after:  # the one injection point of the test hook
            raise InjectedFault(
                f"injected weights-follower failure at weight update {self.updates} "
                "([worker.faults] weights_after)"
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
                if in_a_row > self.cfg.run.max_restarts:
                    self.failed = f"{name}: {type(e).__name__}: {e}"
                    self.log.error(
                        "background task failed past max_restarts; stopping the worker",
                        task=name,
                        restarts=self.restarts.get(name, 0),
                        error=repr(e),
                    )
                    stop.set()
                    return
                delay = min(self.cfg.run.restart_backoff_s * 2 ** (in_a_row - 1), 30.0)
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
            await asyncio.sleep(self.cfg.run.heartbeat_s)
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
        if self.cfg.engine.kind == "torch" and getattr(self.tok, "vocab_size", 0) > vocab:
            raise ValueError(
                f"tokenizer {self.cfg.engine.tokenizer!r} has {self.tok.vocab_size} ids but the "
                f"published model's vocab_size is {vocab}"
            )
        if self.engine is None:
            self.engine = make_engine(self.cfg, kf.model_config, self.eos_id)
        await self.engine.load_keyframe(kf.state, kf.version, kf.epoch)
        self.log.info("weights loaded", version=kf.version, epoch=kf.epoch, engine=self.cfg.engine.kind)
        return kf

    async def run(self, stop: asyncio.Event | None = None, handle_signals: bool = True) -> None:
        # before anything else: the episodes root is this uid's own, a killed predecessor's
        # workspaces go, and no episode runs in a sandbox weaker than promised
        if self.cfg.episodes.workspace == "local":
            private_root(default_root())
        await isolation.startup_async(
            self.cfg.episodes.allow_weak_sandbox,
            default_root() if self.cfg.episodes.workspace == "local" else None,
            self.cfg.episodes.envs,
        )
        stop = stop or asyncio.Event()
        kf = await self.start_weights(stop)
        if kf is None:
            return
        if self.cfg.harness.kind == "external":  # harnesses claim episodes there: serving before any task
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
            concurrency=self.cfg.admission.max_inflight + self.cfg.admission.queue,
            capacity=self.capacity,
            grace_s=self.cfg.run.grace_s,
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
