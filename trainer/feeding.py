"""Keeps TASKS topped up: async mode holds ~[trainer.tasks] backlog groups queued; sync mode publishes one
batch per version (min_version = that version) through envs.feeder.publish_tasks. Each group is
stamped with KV rl-control/lambda as read when it is published (Task.lambda_): the scorers price
all its members with that one λ, however KV moves while it is generated and scored."""

from __future__ import annotations

import asyncio
import random

from bus import topology as topo
from bus.events import SamplingParams
from kernel import get_logger

from . import lambda_control

log = get_logger(__name__)


class TaskFeeder:
    def __init__(self, bus, cfg, held=lambda: 0):
        """`held()`: SCORED messages the leader has trained on and holds unacked until a checkpoint
        records them ([trainer.checkpoint] every > 1): consumed work, not work ready to train."""
        self.bus, self.cfg, self.held = bus, cfg, held
        self.published = 0
        self._next_env = 0
        self.rng = random.Random(f"{cfg.run.seed}-{cfg.trainer_id}")
        self.render = None
        self.lam: float | None = None  # the last good KV λ (None: none yet; scorers use their own)
        if cfg.tasks.chat_template:  # instruct models: prompts go out as the chat template's user turn
            import policy
            from envs.feeder import chat_renderer

            self.render = chat_renderer(policy.load_tokenizer(cfg.policy.tokenizer))

    def sampling(self) -> SamplingParams:
        return SamplingParams(**{**self.cfg.tasks.sampling, "n": self.cfg.batch.group_size})

    async def publish(self, n_groups: int, min_version: int = 0) -> list[str]:
        from envs.feeder import publish_tasks  # imported here: only a feeding trainer needs it

        ids = []
        for _ in range(n_groups):  # round-robin over the configured environments
            env = self.cfg.tasks.envs[self._next_env % len(self.cfg.tasks.envs)]
            self._next_env += 1
            self.lam = await lambda_control.read(self.bus, self.lam)  # per group: one λ stamped on it
            ids += await publish_tasks(
                self.bus,
                env,
                1,
                self.sampling(),
                self.rng,
                min_version=min_version,
                render=self.render,
                lambda_=self.lam,
            )
        self.published += len(ids)
        return ids

    async def backlog(self) -> tuple[int, float]:
        """(tasks queued and not yet taken by a worker, groups generated but not yet trained on).

        Tasks being generated count towards neither: capping them would leave worker slots idle,
        and they are bounded by the workers' slots anyway. Finished work that waits for the
        trainer is capped: produced faster than the trainer consumes it, it only goes stale.
        Batches already trained but held for a checkpoint stay in SCORED (a work queue drops a
        message on its ack) and are not counted: counted, K - 1 of them would stop the feeding
        before the K-th version could train, and the run would wait forever for its checkpoint."""
        js = self.bus.js
        pending = (await js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)).num_pending
        done = sum([(await js.stream_info(s)).state.messages for s in (topo.ROLLOUTS, topo.SCORED)])
        done = max(done - self.held(), 0)
        return int(pending), done / max(self.cfg.batch.group_size, 1)

    def max_ready(self) -> int:
        # one batch in training (held until published) + one ready + one assembling
        return self.cfg.tasks.max_outstanding or 3 * self.cfg.batch.groups

    async def run(
        self, stop: asyncio.Event, version_fn, period_s: float = 0.25, kick: asyncio.Event | None = None
    ) -> None:
        """Top up every period_s, and at once when `kick` is set (the trainer took a batch)."""
        kick = kick or asyncio.Event()
        while not stop.is_set():
            kick.clear()  # before the check: a kick during it is not lost
            try:
                pending, ready = await self.backlog()
                missing = min(self.cfg.tasks.backlog - pending, int(self.max_ready() - ready))
                if missing > 0:
                    await self.publish(missing, min_version=0)
            except Exception as e:  # broker blip: try again next period
                log.warning("task feeding failed", error=str(e))
            try:
                await asyncio.wait_for(kick.wait(), period_s)
            except TimeoutError:
                pass
