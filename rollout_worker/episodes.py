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

The turn loop is envs/episode_play.py's (the held-out eval plays the same one); here the engine's
side of it (EnginePlayer) and the runner the worker owns (EpisodeRunner: Task -> Rollout; the
worker's handler admits, publishes and counts).

The worker scores the episode (the workspace lives here); the scorer only turns the result into
a reward and a cost (scorer/service.py). Needs an engine with `extend`: the torch engine (kept slot
and KV cache) or the vLLM engine (a new request on the exact ids so far, KV from its prefix cache).
"""

from __future__ import annotations

import dataclasses
import os
import time
import zlib

import msgspec

from bus.events import Rollout, SamplingParams, Task
from bus.rollout_build import build_rollout

# (shared with the warm start: re-exported)
from envs.conversation import PlainFormat, TemplateFormat, chat_format, episode_spec  # noqa: F401
from envs.episode import Episode, EpisodeLimits, EpisodeTask
from envs.episode_play import Turn, play_episode
from envs.episode_pool import EpisodePool

OBS_VERSION = -1
FENCE = "\n```"  # a turn may end at its bash block's closing fence (a stop sequence)


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
    epoch: int = 0
    quant: dict = dataclasses.field(default_factory=dict)
    finish: str = ""

    # the episode as one generation (an engine Generation's fields: bus.rollout_build reads them)
    @property
    def completion_ids(self) -> list[int]:
        return self.ids

    @property
    def token_versions(self) -> list[int]:
        return self.versions

    @property
    def finish_reason(self) -> str:
        return self.finish or "abort"

    @property
    def sampling_mask(self) -> dict:
        import policy

        return policy.SamplingMask.from_rows(self.rows).to_wire()

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
        self.rows += [(-1, None)] * len(ids)  # the whole vocabulary (policy FULL)


class EnginePlayer:
    """The worker's side of one episode (envs/episode_play.py): turns generated on the engine, the
    sequence kept between turns (torch: its slot and KV cache; vLLM: its prefix cache)."""

    def __init__(self, engine, tok, sp: SamplingParams, seed: int, fence: list[list[int]]):
        self.engine, self.tok, self.sp, self.seed, self.fence = engine, tok, sp, seed, fence
        self.traj: Trajectory | None = None
        self.handle: int | None = None  # the engine's kept sequence
        self.append: list[int] = []  # observation ids the next turn prefills first

    def start(self, prompt_ids: list[int]) -> None:
        self.traj = Trajectory(prompt_ids)

    def length(self) -> int:
        return len(self.traj.prompt_ids) + len(self.traj.ids)

    def observe(self, ids: list[int]) -> None:
        self.traj.add_observation(ids)
        self.append = ids

    async def turn(self) -> Turn:
        eng, turn = self.engine, []
        while True:  # one turn: continue past a stop at an opening fence
            tsp = msgspec.structs.replace(self.sp, max_tokens=max(self.sp.max_tokens - len(turn), 1))
            if self.handle is None:
                g = await eng.generate(
                    self.traj.prompt_ids, tsp, seed=self.seed, keep=True, stop_seqs=self.fence
                )
                self.handle = g.handle
            else:
                g = await eng.extend(self.handle, self.append, tsp, stop_seqs=self.fence)
            self.append = []
            self.traj.add_model(g)
            turn += g.completion_ids
            if (
                g.finish_reason != "stop_seq"
                or len(turn) >= self.sp.max_tokens
                or _block_closed(self.tok.decode(turn))
            ):
                break
        return Turn(self.tok.decode(turn), len(turn), g.finish_reason, eos_kept=g.finish_reason == "stop")

    def release(self) -> None:
        """Free the kept sequence (no more turns: the KV row is not held through the scoring run)."""
        if self.handle is not None:
            self.engine.release(self.handle)
            self.handle = None


class EpisodeRunner:
    """Runs the episodes of multi-turn tasks on an engine that supports `extend`."""

    def __init__(
        self,
        engine,
        tok,
        pool: EpisodePool | None = None,
        worker_id: str = "",
        fmt=None,
        fence_stop: bool = True,
        backend=None,
        episode_wall_s: float = 0.0,
        task_set: str = "",
    ):
        if not hasattr(engine, "extend"):
            raise ValueError(
                f"engine {type(engine).__name__} cannot continue a sequence (no extend): "
                f"multi-turn episodes need the torch or vLLM engine"
            )
        self.engine, self.tok, self.worker_id = engine, tok, worker_id
        self.backend = backend  # envs WorkspaceBackend; None: LocalBackend
        self.episode_wall_s = episode_wall_s  # > 0: replaces the task's episode wall limit
        # where tasks' repository snapshots may lie ('' : anywhere): [worker.episodes] task_set
        self.task_root = os.path.realpath(task_set) if task_set else ""
        self.pool = pool or EpisodePool()
        self.fmt = fmt or chat_format(tok)
        # the closing fence as a stop sequence only where it is one token run whatever precedes it
        self.fence = [tok.encode(FENCE)] if fence_stop and type(self.fmt) is PlainFormat else []
        self.stats = {"episodes": 0, "turns": 0, "tool_calls": 0, "tool_wall_s": 0.0, "wall_s": 0.0}
        self.ended: list[dict] = []  # per episode since the last drain (bench.agentic's distributions)

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
        et = EpisodeTask.from_dict(spec["episode"])
        for path, what in ((et.base_dir, "repository snapshot"), (et.env_dir, "repository environment")):
            if self.task_root and path and not os.path.realpath(path).startswith(self.task_root + os.sep):
                raise ValueError(
                    f"task {et.task_id}: {what} {path} is outside this worker's "
                    f"task set {self.task_root} ([worker.episodes] task_set)"
                )
        return et, EpisodeLimits(**lim)

    def open(self, task: Task) -> tuple[EpisodeTask, EpisodeLimits, Episode, int]:
        """The task's episode, its limits fitted to the engine, and the context room left for it."""
        et, limits = self.parse(task)
        # the episode ends with context_limit before the engine's slot is full (a turn always fits)
        room = self.engine.max_len - limits.max_turn_tokens - 1
        if room < 1:
            raise ValueError(
                f"max_turn_tokens {limits.max_turn_tokens} leaves no room in the engine's "
                f"max_len {self.engine.max_len}"
            )
        limits = dataclasses.replace(
            limits,
            max_context_tokens=min(limits.max_context_tokens, room),
            episode_wall_s=self.episode_wall_s or limits.episode_wall_s,
        )
        return (
            et,
            limits,
            Episode(et, limits, backend=self.backend, token_counter=TokenCounter(self.tok)),
            room,
        )

    async def run(self, task: Task, sp: SamplingParams, index: int) -> Rollout:
        _, limits, ep, _ = self.open(task)
        turn_sp = msgspec.structs.replace(sp, n=1, max_tokens=min(sp.max_tokens, limits.max_turn_tokens))
        player = EnginePlayer(
            self.engine, self.tok, turn_sp, zlib.crc32(f"{task.task_id}-{index}".encode()), self.fence
        )
        t0 = time.perf_counter()
        try:
            log = await play_episode(ep, self.pool, player, self.fmt, self.tok, self.engine.max_len)
            player.release()
            result = await self.pool.score(ep)
        finally:
            player.release()
            await self.pool.close(ep)
        traj = player.traj
        self.count(ep, traj, result, time.perf_counter() - t0)
        return build_rollout(
            task,
            index,
            sp.n,
            self.worker_id,
            traj.prompt_ids,
            traj,
            self.tok.decode(traj.ids),
            result.wall_s,
            loss_mask=traj.mask,
            result=result,
            turns=result.turns,
            episode={"turn_log": [{"finish": t["finish"]} for t in log]},
        )

    def count(self, ep: Episode, traj: Trajectory, result, wall_s: float) -> None:
        """The books of one played episode: the counters (the worker's metrics) and its record."""
        self.stats["episodes"] += 1
        self.stats["turns"] += result.turns
        self.stats["tool_calls"] += result.tool_calls
        self.stats["tool_wall_s"] += result.tool_wall_s
        self.stats["wall_s"] += wall_s
        if len(self.ended) < 4096:
            # ended_at: wall clock, the trainer's `ts` clock (bench.agentic places episodes in its window)
            self.ended.append(
                {
                    "ended_at": time.time(),
                    "turns": result.turns,
                    "tool_calls": result.tool_calls,
                    "tokens": len(traj.ids),
                    "model_tokens": sum(traj.mask),
                    "wall_s": result.wall_s,
                    "tool_wall_s": result.tool_wall_s,
                    "termination": result.termination,
                    "reward": result.reward,
                    "resolved": result.resolved,
                    # modelled remote test-suite time (envs/sandbox_latency.py), scoring run included
                    "suite_wait_s": getattr(ep.workspace, "waited_s", 0.0),
                    "suite_runs": getattr(ep.workspace, "suite_runs", 0),
                }
            )


def workspace_backend(cfg):
    """The workspace backend of a `[worker.episodes]` section (rollout_worker.sections.EpisodesSection;
    None: the episode's default, LocalBackend), with the modelled remote test-suite time around it
    when `sandbox_latency` is on."""
    backend = None
    if cfg.workspace == "docker":
        from envs.workspace_docker import DockerBackend

        backend = DockerBackend(image=cfg.docker_image) if cfg.docker_image else DockerBackend()
    latency = cfg.sandbox_latency
    if latency is not None and latency.enabled:
        from envs.sandbox_latency import LatencyBackend
        from envs.workspace import LocalBackend

        backend = LatencyBackend(backend or LocalBackend(), latency)
    return backend


def _block_closed(text: str) -> bool:
    from envs.actions import BASH_BLOCK

    return BASH_BLOCK.search(text) is not None
