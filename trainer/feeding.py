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

    async def backlog(self) -> int:
        """Tasks queued and not yet taken by any worker (tasks being generated do not count:
        counting them would cap the work in flight and leave worker slots idle)."""
        info = await self.bus.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)
        return int(info.num_pending)

    async def run(self, stop: asyncio.Event, version_fn, period_s: float = 0.25) -> None:
        while not stop.is_set():
            try:
                missing = self.cfg.feed_backlog - await self.backlog()
                if missing > 0:
                    await self.publish(missing, min_version=0)
            except Exception as e:          # broker blip: try again next period
                log.warning("task feeding failed", error=str(e))
            try:
                await asyncio.wait_for(stop.wait(), period_s)
            except asyncio.TimeoutError:
                pass
