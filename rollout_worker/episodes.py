"""Multi-turn episodes in the worker: a task whose spec holds an `episode` runs turn by turn.

    reset (EpisodePool thread)     -> messages -> prompt ids (the chat format below)
    turn:  engine.generate(keep=True) / engine.extend(handle, observation ids)
           until the turn ends: the end-of-turn token (eos), or the closing fence of the ```bash block
    step   (EpisodePool thread, off the decode loop) -> observation text
           -> its ids appended after the ids generated so far; the slot's KV cache is kept, so
              only the observation is prefilled and earlier turns are never re-tokenised
    score  (EpisodePool thread: the hidden tests run where the workspace is) -> one Rollout

Per token of the Rollout's completion: loss mask (1 model, 0 observation), behaviour logprob and
sampling-mask row (observation tokens: 0.0 and a whole-vocabulary row), policy version (a weight
update may land between two tokens or two turns; observation tokens: -1).

The worker scores the episode (the workspace lives here); the scorer only turns the result into
a reward and a cost (scorer/service.py). Needs an engine with `extend`: the torch engine (kept slot
and KV cache) or the vLLM engine (a new request on the exact ids so far, KV from its prefix cache).
"""
from __future__ import annotations

import dataclasses
import time
import zlib

from bus.events import Rollout, SamplingParams, Task
from envs.episode import Episode, EpisodeLimits, EpisodeTask
from envs.episode_pool import EpisodePool
from envs.conversation import PlainFormat, TemplateFormat, chat_format, episode_spec  # noqa: F401  (shared with the warm start)

OBS_VERSION = -1
FENCE = "\n```"          # a turn may end at its bash block's closing fence (a stop sequence)


def is_episode_task(task: Task) -> bool:
    return isinstance(task.spec, dict) and "episode" in task.spec


class TokenCounter:
    """The worker's tokenizer as the episode's token counter (so context_limit is exact)."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, text: str) -> int:
        return len(self.tok.encode(text))


@dataclasses.dataclass
class Trajectory:
    prompt_ids: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    rows: list = dataclasses.field(default_factory=list)
    turns: list[dict] = dataclasses.field(default_factory=list)   # per turn: action, observation, finish
    epoch: int = 0
    quant: dict = dataclasses.field(default_factory=dict)
    finish: str = ""

    def add_model(self, g) -> None:
        import policy
        self.ids += g.completion_ids
        self.mask += [1] * len(g.completion_ids)
        self.logprobs += g.logprobs
        self.versions += g.token_versions
        self.rows += policy.SamplingMask.from_wire(g.sampling_mask).row_parts()
        self.epoch, self.quant, self.finish = g.epoch, g.quant, g.finish_reason

    def add_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [OBS_VERSION] * len(ids)
        self.rows += [(-1, None)] * len(ids)                 # the whole vocabulary (policy FULL)


class EpisodeRunner:
    """Runs the episodes of multi-turn tasks on an engine that supports `extend`."""

    def __init__(self, engine, tok, pool: EpisodePool | None = None, worker_id: str = "", fmt=None,
                 fence_stop: bool = True, backend=None, episode_wall_s: float = 0.0):
        if not hasattr(engine, "extend"):
            raise ValueError(f"engine {type(engine).__name__} cannot continue a sequence (no extend): "
                             f"multi-turn episodes need the torch or vLLM engine")
        self.engine, self.tok, self.worker_id = engine, tok, worker_id
        self.backend = backend           # envs WorkspaceBackend; None: LocalBackend
        self.episode_wall_s = episode_wall_s   # > 0: replaces the task's episode wall limit
        self.pool = pool or EpisodePool()
        self.fmt = fmt or chat_format(tok)
        # the closing fence as a stop sequence only where it is one token run whatever precedes it
        self.fence = [tok.encode(FENCE)] if fence_stop and type(self.fmt) is PlainFormat else []
        self.stats = {"episodes": 0, "turns": 0, "tool_calls": 0, "tool_wall_s": 0.0, "wall_s": 0.0}
        self.ended: list[dict] = []        # per episode since the last drain (bench.agentic's distributions)

    def drain(self) -> list[dict]:
        """The episodes that ended since the last call (the worker's metrics carry them)."""
        ended, self.ended = self.ended, []
        return ended

    def parse(self, task: Task) -> tuple[EpisodeTask, EpisodeLimits]:
        """The task's EpisodeTask and limits; ValueError/TypeError (-> parked) when malformed."""
        spec = task.spec
        lim = spec.get("limits") or {}
        if not isinstance(lim, dict):
            raise ValueError(f"episode limits must be a map, got {type(lim).__name__}")
        return EpisodeTask.from_dict(spec["episode"]), EpisodeLimits(**lim)

    def open(self, task: Task) -> tuple[EpisodeTask, EpisodeLimits, Episode, int]:
        """The task's episode, its limits fitted to the engine, and the context room left for it."""
        et, limits = self.parse(task)
        # the episode ends with context_limit before the engine's slot is full (a turn always fits)
        room = self.engine.max_len - limits.max_turn_tokens - 1
        if room < 1:
            raise ValueError(f"max_turn_tokens {limits.max_turn_tokens} leaves no room in the engine's "
                             f"max_len {self.engine.max_len}")
        limits = dataclasses.replace(limits, max_context_tokens=min(limits.max_context_tokens, room),
                                     episode_wall_s=self.episode_wall_s or limits.episode_wall_s)
        return et, limits, Episode(et, limits, backend=self.backend, token_counter=TokenCounter(self.tok)), room

    async def run(self, task: Task, sp: SamplingParams, index: int) -> Rollout:
        et, limits, ep, room = self.open(task)
        eng = self.engine
        seed = zlib.crc32(f"{task.task_id}-{index}".encode())
        turn_sp = dataclasses.replace(sp, n=1, max_tokens=min(sp.max_tokens, limits.max_turn_tokens))
        handle, t0 = None, time.perf_counter()
        try:
            msgs = await self.pool.reset(ep)
            traj = Trajectory(self.tok.encode(self.fmt.prompt(msgs), bos=True))
            if len(traj.prompt_ids) > room:
                ep._end("context_limit", f"prompt of {len(traj.prompt_ids)} tokens > {room}")   # noqa: SLF001
            append: list[int] | None = None
            while not ep.done:
                turn: list[int] = []
                while True:       # one turn: continue past a stop at an opening fence
                    left = turn_sp.max_tokens - len(turn)
                    tsp = dataclasses.replace(turn_sp, max_tokens=max(left, 1))
                    if handle is None:
                        g = await eng.generate(traj.prompt_ids, tsp, seed=seed, keep=True, stop_seqs=self.fence)
                        handle = g.handle
                    else:
                        g = await eng.extend(handle, append or [], tsp, stop_seqs=self.fence)
                    append = []
                    traj.add_model(g)
                    turn += g.completion_ids
                    if g.finish_reason != "stop_seq" or len(turn) >= turn_sp.max_tokens \
                            or _block_closed(self.tok.decode(turn)):
                        break
                action = self.tok.decode(turn)
                r = await self.pool.step(ep, action, len(turn))
                traj.turns.append({"action": action, "observation": r.observation, "finish": g.finish_reason})
                if r.done:
                    break
                append = self.tok.encode(self.fmt.observation(r.observation, g.finish_reason == "stop"))
                if len(traj.prompt_ids) + len(traj.ids) + 1 + len(append) + limits.max_turn_tokens > eng.max_len:
                    ep._end("context_limit", "the engine's slot is full")          # noqa: SLF001
                    break
                traj.add_observation(append)
            if handle is not None:       # no more turns: the KV row is not held through the scoring run
                eng.release(handle)
                handle = None
            result = await self.pool.score(ep)
        finally:
            if handle is not None:
                eng.release(handle)
            await self.pool.close(ep)
        self.stats["episodes"] += 1
        self.stats["turns"] += result.turns
        self.stats["tool_calls"] += result.tool_calls
        self.stats["tool_wall_s"] += result.tool_wall_s
        self.stats["wall_s"] += time.perf_counter() - t0
        if len(self.ended) < 4096:
            # ended_at: wall clock, the trainer's `ts` clock (bench.agentic places episodes in its window)
            self.ended.append({"ended_at": time.time(), "turns": result.turns, "tool_calls": result.tool_calls, "tokens": len(traj.ids),
                               "model_tokens": sum(traj.mask), "wall_s": result.wall_s,
                               "tool_wall_s": result.tool_wall_s, "termination": result.termination,
                               "reward": result.reward, "resolved": result.resolved,
                               # modelled remote test-suite time (envs/sandbox_latency.py), scoring run included
                               "suite_wait_s": getattr(ep.workspace, "waited_s", 0.0),
                               "suite_runs": getattr(ep.workspace, "suite_runs", 0)})
        import policy
        return Rollout(rollout_id=f"{task.task_id}-{index}", task_id=task.task_id, env=task.env, sample_index=index,
                       group_size=sp.n, prompt=task.prompt, spec=task.spec, prompt_ids=traj.prompt_ids,
                       completion_ids=traj.ids, completion_text=self.tok.decode(traj.ids), logprobs=traj.logprobs,
                       token_versions=traj.versions, sampling=task.sampling,
                       sampling_mask=policy.SamplingMask.from_rows(traj.rows).to_wire(), quant=traj.quant,
                       finish_reason=traj.finish or "abort", cost_tokens=sum(traj.mask), wall_s=result.wall_s,
                       worker_id=self.worker_id, split=task.split, epoch=traj.epoch, loss_mask=traj.mask,
                       turns=max(result.turns, 1), tool_calls=result.tool_calls, termination=result.termination,
                       lambda_=task.lambda_,
                       episode={**result.to_dict(), "turn_log": [{"finish": t["finish"]} for t in traj.turns]})


def workspace_backend(cfg):
    """The worker config's workspace backend (None: the episode's default, LocalBackend), with the
    modelled remote test-suite time around it when `sandbox_latency` is on."""
    backend = None
    if getattr(cfg, "workspace", "local") == "docker":
        from envs.workspace_docker import DockerBackend
        backend = DockerBackend(image=cfg.docker_image) if cfg.docker_image else DockerBackend()
    latency = getattr(cfg, "sandbox_latency", None)
    if latency is not None and latency.enabled:
        from envs.sandbox_latency import LatencyBackend
        from envs.workspace import LocalBackend
        backend = LatencyBackend(backend or LocalBackend(), latency)
    return backend


def _block_closed(text: str) -> bool:
    from envs.actions import BASH_BLOCK
    return BASH_BLOCK.search(text) is not None


def episode_runner(worker) -> EpisodeRunner:
    """The worker's episode runner, made on first use: one per worker, its thread pool hosts every
    episode's commands."""
    runner = getattr(worker, "episode_runner", None)
    if runner is None:
        # a pool thread per episode that can be in flight: one waiting on a slow command must
        # not hold another's reset or step back (8 threads served 12 episodes before)
        cfg = worker.cfg
        kw = dict(pool=EpisodePool(max(getattr(cfg, "max_inflight", cfg.slots) + cfg.queue, 1)),
                  worker_id=cfg.worker_id, backend=workspace_backend(cfg),
                  episode_wall_s=getattr(cfg, "episode_wall_s", 0.0))
        harness = getattr(cfg, "harness", "builtin")
        if harness == "external":        # a harness the worker does not launch (rollout_worker/external.py)
            from .external import ExternalRunner
            runner = worker.episode_runner = ExternalRunner(
                worker.engine, worker.tok, host=cfg.endpoint_host, port=cfg.endpoint_port,
                deadline_s=cfg.external_deadline_s, **kw)
        elif harness != "builtin":       # a harness the worker launches (rollout_worker/harness.py)
            from .harness import HarnessRunner
            runner = worker.episode_runner = HarnessRunner(
                worker.engine, worker.tok, harness=cfg.harness, harness_config=cfg.harness_config,
                host=cfg.endpoint_host, port=cfg.endpoint_port, **kw)
        else:
            runner = worker.episode_runner = EpisodeRunner(worker.engine, worker.tok, **kw)
    return runner


async def handle_episode_task(worker, task: Task, ctx) -> None:
    """The worker's handler for a multi-turn task: sampling.n episodes -> n Rollouts -> publish."""
    import asyncio

    from bus import TransientError
    from bus import topology as topo

    from .engine import EngineClosed
    from .worker import parse_sampling
    try:
        sp = parse_sampling(task.sampling)
        runner = episode_runner(worker)
        runner.parse(task)
    except (ValueError, TypeError, KeyError) as e:
        return await worker._park(ctx, task, f"bad episode task: {e}")          # noqa: SLF001
    worker.group_hint = sp.n
    subject = topo.rollout_subject(task.env)
    worker.episodes_in_flight += sp.n        # counted from here: capacity() must see them at once
    unstarted = [sp.n]

    async def one(i: int) -> None:
        # each episode is published as soon as it ends: a stuck sibling must not hold the group's
        # finished members back (the trainer closes a group after group_timeout_s with what came)
        unstarted[0] -= 1
        try:
            r = await runner.run(task, sp, i)
        finally:
            worker.episodes_in_flight -= 1
        await worker.bus.publish(subject, r)
        worker.rollouts += 1
    try:
        await worker._wait_until(lambda: worker.engine.version >= task.min_version and worker.admissible())  # noqa: SLF001
        await asyncio.gather(*(one(i) for i in range(sp.n)))
    except EngineClosed as e:
        raise TransientError(f"released: {e}", delay=0) from None
    except (ValueError, TypeError) as e:
        return await worker._park(ctx, task, str(e))                             # noqa: SLF001
    finally:
        worker.episodes_in_flight -= unstarted[0]    # never started (cancelled in the version wait)
        unstarted[0] = 0
    worker.tasks_done += 1
