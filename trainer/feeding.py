"""Keeps TASKS topped up: async mode holds ~feed_backlog groups queued; sync mode publishes one
batch per version (min_version = that version) through envs.feeder.publish_tasks."""
from __future__ import annotations

import asyncio
import random

from bus import get_logger
from bus.events import SamplingParams
from bus import topology as topo

log = get_logger(__name__)


class TaskFeeder:
    def __init__(self, bus, cfg):
        self.bus, self.cfg = bus, cfg
        self.published = 0
        self._next_env = 0
        self.rng = random.Random(f"{cfg.seed}-{cfg.trainer_id}")

    def sampling(self) -> SamplingParams:
        return SamplingParams(**{**self.cfg.task_sampling, "n": self.cfg.group_size})

    async def publish(self, n_groups: int, min_version: int = 0) -> list[str]:
        from envs.feeder import publish_tasks    # imported here: only a feeding trainer needs it
        ids = []
        for _ in range(n_groups):                 # round-robin over the configured environments
            env = self.cfg.envs[self._next_env % len(self.cfg.envs)]
            self._next_env += 1
            ids += await publish_tasks(self.bus, env, 1, self.sampling(), self.rng, min_version=min_version)
        self.published += len(ids)
        return ids

    async def backlog(self) -> tuple[int, float]:
        """(tasks queued and not yet taken by a worker, groups not yet trained on).

        Tasks being generated do not count towards the first: counting them would cap the work
        in flight and leave worker slots idle. Everything untrained counts towards the second:
        work produced faster than the trainer consumes it only waits, goes stale, and is dropped."""
        js = self.bus.js
        pending = (await js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)).num_pending
        tasks = (await js.stream_info(topo.TASKS)).state.messages
        rollouts = sum([(await js.stream_info(s)).state.messages for s in (topo.ROLLOUTS, topo.SCORED)])
        return int(pending), tasks + rollouts / max(self.cfg.group_size, 1)

    def max_outstanding(self) -> int:
        # one batch training, one ready, one being generated: keeps slots busy, lag ~2 versions
        return self.cfg.feed_max_outstanding or 3 * self.cfg.batch_groups

    async def run(self, stop: asyncio.Event, version_fn, period_s: float = 0.25) -> None:
        while not stop.is_set():
            try:
                pending, untrained = await self.backlog()
                missing = min(self.cfg.feed_backlog - pending, int(self.max_outstanding() - untrained))
                if missing > 0:
                    await self.publish(missing, min_version=0)
            except Exception as e:          # broker blip: try again next period
                log.warning("task feeding failed", error=str(e))
            try:
                await asyncio.wait_for(stop.wait(), period_s)
            except asyncio.TimeoutError:
                pass
