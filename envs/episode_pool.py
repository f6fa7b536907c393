"""Runs episodes' blocking calls off the event loop.

Threads, not processes: a step spends its time waiting on the sandboxed child process (the
thread sleeps in select()/wait() with the GIL released); the Python work around it (parsing the
action, cutting the output, sizing the workspace) is small. Threads keep each Episode object in
place (no pickling of its state at every call) and need no process management, which libraries
here do not do. Episodes stay picklable, so a process pool or an env pool behind NATS can host
them later without changing the protocol.

One episode's calls must be made in order (reset, step, ..., score, close): the pool refuses a
call on an episode that has one in flight rather than interleave them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from .episode import Episode, EpisodeResult, StepResult


class EpisodePool:
    def __init__(self, max_workers: int = 8):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._ex = ThreadPoolExecutor(max_workers, thread_name_prefix="episode")
        self.max_workers = max_workers  # episodes it can serve at once
        self._busy: set[int] = set()

    async def _call(self, ep: Episode, fn, *args):
        if id(ep) in self._busy:
            raise RuntimeError(f"episode {ep.task.task_id} already has a call in flight")
        self._busy.add(id(ep))
        try:
            return await asyncio.get_running_loop().run_in_executor(self._ex, fn, *args)
        finally:
            self._busy.discard(id(ep))

    async def reset(self, ep: Episode) -> list[dict]:
        return await self._call(ep, ep.reset)

    async def step(self, ep: Episode, action: str, n_tokens: int | None = None) -> StepResult:
        return await self._call(ep, ep.step, action, n_tokens)

    async def score(self, ep: Episode) -> EpisodeResult:
        return await self._call(ep, ep.score)

    async def close(self, ep: Episode) -> None:
        await self._call(ep, ep.close)

    async def run(
        self, ep: Episode, policy: Callable[[list[dict], list[tuple[str, StepResult]]], Awaitable[str]]
    ) -> tuple[list[tuple[str, StepResult]], EpisodeResult]:
        """Drive one episode with an async policy (messages, turns so far) -> next action text,
        then score it; the workspace is always removed."""
        turns: list[tuple[str, StepResult]] = []
        try:
            msgs = await self.reset(ep)
            while not ep.done:
                action = await policy(msgs, turns)
                turns.append((action, await self.step(ep, action)))
            return turns, await self.score(ep)
        finally:
            await self.close(ep)

    def shutdown(self, wait: bool = True) -> None:
        self._ex.shutdown(wait=wait, cancel_futures=True)


class InlinePool:
    """EpisodePool's calls made in the caller's thread: the held-out eval, whose episodes wait on
    each other's generation anyway (envs/lockstep.py)."""

    async def reset(self, ep: Episode) -> list[dict]:
        return ep.reset()

    async def step(self, ep: Episode, action: str, n_tokens: int | None = None) -> StepResult:
        return ep.step(action, n_tokens)

    async def score(self, ep: Episode) -> EpisodeResult:
        return ep.score()

    async def close(self, ep: Episode) -> None:
        ep.close()
