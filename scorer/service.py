"""The scorer: ROLLOUTS → verify → reward → SCORED, acking only after SCORED acked the publish.

    rollout ─▶ env = get_env(rollout.env)          unknown env / bad spec  ─▶ DLQ with reason
             ─▶ verdict = env.verify(text, spec)   (thread pool: the sandbox waits on a subprocess)
             ─▶ score, cost, shaping, then its price: reward = score − λ·cost − shaping
                  (policy/reward.py: every formula; the trainer's penalty modes start from these parts)
                  λ: the rollout's own (stamped on its task at feed time: one per group), else
                  the live value of KV rl-control/lambda (a rollout of an older worker)
             ─▶ publish Scored(rl.scored.<env>) ─▶ return (the ConsumerLoop acks)
A verifier crash raises: the loop naks and, after max_deliver, parks the rollout in DLQ; on that
last delivery the scorer first publishes it as an infrastructure failure (Scored.infra
"scorer_crash"), so its group completes and the trainer leaves it out (weight 0, not reward 0).
Infrastructure failures (the sandbox, a workspace that was not made, the scorer) and forged
verdicts (Scored.tampered) are counted by reason in the heartbeat and /metrics.
Bad numbers (NaN/inf wall_s, a score out of [0, 1]) are bad input: the rollout's decode
(bus/events.py) or policy.reward.price refuses them with an EventError naming the field, and the
loop parks the rollout at once.
Many scorer processes share the durable `scorer` consumer; each rollout is scored once
(and a redelivered one is deduped downstream by its Nats-Msg-Id scored-<rollout_id>).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import envs
from bus import ConsumerLoop, HandlerContext, connect
from bus import topology as topo
from bus.control import parse_lambda
from bus.events import EventError, Heartbeat, Rollout, Scored
from envs import SpecError, get_env, isolation, runs_code
from kernel import get_logger, metrics
from kernel.lifetime import cancel_and_wait
from policy.reward import EPISODE_REWARDS, episode_score, overlong_shaping, price, rollout_cost

from .config import ScorerConfig

log = get_logger("scorer")


class Scorer:
    def __init__(self, cfg: ScorerConfig, bus=None):
        self.cfg, self.bus = cfg, bus
        self.lam, self.lam_rev = cfg.reward.default_lambda, 0
        self.pool = ThreadPoolExecutor(cfg.run.verify_threads, thread_name_prefix="verify")
        self.counts = {"scored": 0, "dlq": 0, "success_sum": 0.0, "reward_sum": 0.0, "tampered": 0}
        self.infra: dict[str, int] = {}  # infrastructure failures by reason (not policy failures)
        self.log = log.bind(scorer_id=cfg.scorer_id)

    # -- λ ------------------------------------------------------------------------------------
    def _set_lambda(self, value: bytes | None, rev: int) -> None:
        try:
            lam = parse_lambda(value)
        except ValueError as e:  # keep the last good λ: a typo in KV must not zero the penalty
            self.log.error("ignoring bad lambda in KV", error=str(e), revision=rev, keeping=self.lam)
            return
        if lam != self.lam:
            self.log.info("lambda changed", old=self.lam, new=lam, revision=rev)
        self.lam, self.lam_rev = lam, rev

    async def watch_lambda(self) -> None:
        while True:
            try:
                async for value, rev in self.bus.kv_watch(topo.KEY_LAMBDA):
                    self._set_lambda(value, rev)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # watcher lost (reconnect): start a new one
                self.log.warning("lambda watch failed; rewatching", error=repr(e))
                await asyncio.sleep(1.0)

    # -- one rollout ---------------------------------------------------------------------------
    async def handle(self, ro: Rollout, ctx: HandlerContext) -> None:
        if ro.episode:  # a multi-turn episode, scored by the worker where its workspace was
            r = ro.episode.get("reward")
            if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0.0 <= r <= 1.0:
                return await self._park(
                    ctx, f"episode rollout {ro.rollout_id}: result without a reward in [0, 1] ({r!r})"
                )
            mode = ro.spec.get("reward") if isinstance(ro.spec, dict) else None
            if mode is not None and mode not in EPISODE_REWARDS:
                return await self._park(
                    ctx,
                    f"episode rollout {ro.rollout_id}: reward mode {mode!r} is not one of {EPISODE_REWARDS}",
                )
            return await self._publish(ro, ro.episode, time.perf_counter())
        try:
            env = get_env(ro.env)
        except KeyError as e:
            return await self._park(ctx, e.args[0] if e.args else f"unknown environment {ro.env!r}")
        if runs_code(ro.env):  # a scorer started for code-free environments checks it on the first code
            try:
                await isolation.require_async(self.cfg.sandbox.allow_weak_sandbox)
            except isolation.WeakSandbox as e:
                return await self._park(ctx, f"rollout of {ro.env} refused: {e}")
        t0 = time.perf_counter()
        try:
            if getattr(env, "blocking", False):
                verdict = await asyncio.get_running_loop().run_in_executor(
                    self.pool, env.verify, ro.completion_text, ro.spec
                )
            else:
                verdict = env.verify(ro.completion_text, ro.spec)
        except SpecError as e:  # the task is broken: retrying cannot help
            return await self._park(ctx, f"bad task spec for {ro.env}: {e}")
        except Exception as e:
            if ctx.last_delivery:  # parked next; its group must not wait for it, nor count it a failure
                await self._publish(
                    ro,
                    envs.Verdict(0.0, f"scorer crash: {type(e).__name__}: {e}"[:500], infra="scorer_crash"),
                    t0,
                )
            raise
        await self._publish(ro, verdict, t0)

    async def _publish(self, ro: Rollout, verdict, t0: float) -> None:
        """verdict: an envs Verdict, or an episode's EpisodeResult dict (reward, termination, tool calls)."""
        if isinstance(verdict, dict):
            # an episode is trained on the fraction of its tests that pass (episode_score "fraction")
            # or on its success; its success is all of them passing, as held-out eval_success counts it
            # the task's own mode where its env carries one (the `swe` env: [trainer.tasks.swe] reward)
            mode = ro.spec.get("reward") if isinstance(ro.spec, dict) else None
            mode = mode if mode in EPISODE_REWARDS else self.cfg.reward.episode_reward
            score, resolved = episode_score(verdict, mode)
            infra, tampered = verdict.get("infra_error") or "", bool(verdict.get("tampered"))
            verdict = envs.Verdict(
                1.0 if resolved else 0.0,
                f"episode {ro.termination or '?'}: {verdict.get('detail', '')}".rstrip(": "),
                ro.tool_calls,
                infra=str(infra),
            )
            shaping = 0.0  # overlong shaping is per completion; an episode's limits are its own
        else:
            score, tampered = verdict.success, False
            max_tokens = int(ro.sampling.get("max_tokens", 0) or 0)
            shaping = overlong_shaping(
                ro.cost_tokens, max_tokens, self.cfg.reward.overlong_buffer, self.cfg.reward.overlong_scale
            )
        verify_s = time.perf_counter() - t0
        # the group's λ, stamped on its task when fed: every member priced alike however KV moved since;
        # an older rollout without one gets the live λ. One λ per event, recorded in it.
        lam = ro.lambda_ if ro.lambda_ is not None else self.lam
        try:
            cost = rollout_cost(self.cfg.reward.cost_unit, ro.cost_tokens, ro.wall_s, int(verdict.tool_calls))
            penalty, reward = price(score, cost, lam, shaping)
        except (ValueError, TypeError, OverflowError) as e:  # bad input: parked at once, never retried
            raise EventError(
                f"Rollout {ro.rollout_id}: {e} (cost_unit {self.cfg.reward.cost_unit}: wall_s={ro.wall_s}, "
                f"cost_tokens={ro.cost_tokens})"
            ) from None
        scored = Scored(
            rollout=ro.to_dict(),
            success=float(verdict.success),
            cost=cost,
            lambda_=lam,
            penalty=penalty,
            reward=reward,
            score=float(score),
            shaping=shaping,
            reason=verdict.reason,
            cost_wall_s=float(ro.wall_s),
            tool_calls=int(verdict.tool_calls),
            scorer_id=self.cfg.scorer_id,
            infra=verdict.infra,
            tampered=tampered,
        )
        await self.bus.publish(topo.scored_subject(ro.env), scored)
        if verdict.infra:  # not the policy's doing: out of the success / reward means
            self.infra[verdict.infra] = self.infra.get(verdict.infra, 0) + 1
            metrics.ROLLOUTS_SCORED.labels(ro.env, f"infra_{verdict.infra}").inc()
            self.log.warning(
                "infrastructure failure, published for weight 0",
                rollout_id=ro.rollout_id,
                infra=verdict.infra,
                reason=verdict.reason[:300],
            )
            return
        self.counts["scored"] += 1
        self.counts["tampered"] += tampered
        metrics.ROLLOUTS_SCORED.labels(
            ro.env, "tampered" if tampered else "success" if verdict.success else "failure"
        ).inc()
        self.counts["success_sum"] += verdict.success
        self.counts["reward_sum"] += reward
        self.log.debug(
            "scored",
            rollout_id=ro.rollout_id,
            success=verdict.success,
            reward=reward,
            reason=verdict.reason,
            verify_ms=round(verify_s * 1e3, 2),
        )

    async def _park(self, ctx: HandlerContext, reason: str) -> None:
        await self.bus.dlq(ctx.msg, reason, topo.ROLLOUTS)
        self.counts["dlq"] += 1
        self.log.warning("rollout parked in DLQ", reason=reason)

    # -- telemetry ----------------------------------------------------------------------------
    async def heartbeat(self, loop: ConsumerLoop) -> None:
        last_n, last_t = 0, time.monotonic()
        while True:
            await asyncio.sleep(self.cfg.run.heartbeat_s)
            n, now = self.counts["scored"], time.monotonic()
            m = {
                "scored": n,
                "dlq": self.counts["dlq"],
                "lambda": self.lam,
                "lambda_rev": self.lam_rev,
                "scored_per_s": (n - last_n) / max(now - last_t, 1e-9),
                "success_mean": self.counts["success_sum"] / max(n, 1),
                "reward_mean": self.counts["reward_sum"] / max(n, 1),
                "tampered": self.counts["tampered"],
                **{f"infra_{k}": v for k, v in self.infra.items()},
                **loop.stats.as_dict(),
            }
            last_n, last_t = n, now
            try:
                await self.bus.publish(
                    topo.heartbeat_subject("scorer", self.cfg.scorer_id),
                    Heartbeat(component="scorer", component_id=self.cfg.scorer_id, metrics=m),
                )
            except Exception as e:
                self.log.warning("heartbeat publish failed", error=repr(e))

    # -- process ------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None, handle_signals: bool = True) -> None:
        # before anything else: no rollout is verified in a sandbox weaker than promised
        await isolation.startup_async(self.cfg.sandbox.allow_weak_sandbox, envs=self.cfg.sandbox.envs)
        own_bus = self.bus is None
        if own_bus:
            self.bus = await connect(self.cfg.bus)
        try:
            if self.cfg.run.provision:
                await self.bus.provision()
            value, rev = await self.bus.kv_entry(topo.KEY_LAMBDA)  # λ before the first rollout
            if value is not None:
                self._set_lambda(value, rev)
            loop = ConsumerLoop(
                self.bus,
                topo.ROLLOUTS,
                topo.SCORER_CONSUMER,
                self.handle,
                Rollout,
                concurrency=self.cfg.run.concurrency,
                grace_s=self.cfg.run.grace_s,
                handle_signals=handle_signals,
            )
            side = [asyncio.create_task(self.watch_lambda()), asyncio.create_task(self.heartbeat(loop))]
            self.log.info(
                "scorer started", envs=sorted(envs.ENVS), lam=self.lam, cost_unit=self.cfg.reward.cost_unit
            )
            try:
                await loop.run(stop)
            finally:
                await cancel_and_wait(side, log=self.log)  # (a lost cancel must not hang the stop)
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)
            if own_bus:
                await self.bus.close()
