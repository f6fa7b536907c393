"""The leader loop: batches in, versions out (checkpoint, delta, keyframe, ack), under the lease.

Per step (rank 0 talks to the bus; other ranks only compute):
    batch   <- SCORED (complete groups, deduped, stale samples dropped / down-weighted)
    step    <- PG loss with importance correction, gradient all-reduce, AdamW on fp32 master
    encode  <- the encoder chosen at startup (trainer/encoders.py): gathered, the delta of the last
               published bf16 state to the new one; sharded, every rank encodes the delta of its own
               rows (one signed manifest: bus/weights/manifest.py). Either is one EncodedVersion.
    checkpoint (version v, epoch, consumed ids)  -> publisher.publish(version): the delta or the
               manifest (+ keyframe every K) -> KV version
              (each write: lease CAS, then a write the server refuses once another leader wrote)
    ack the batch's messages
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

import delta_codec
from bus import topology as topo
from bus.consumer import sweep_stranded, watch_max_deliveries
from bus.events import Metrics
from bus.weights.publisher import Fenced, WeightPublisher
from delta_codec.sharded import digest_matches
from kernel import get_logger, metrics
from kernel.lifetime import cancel_and_wait
from policy import ModelConfig, load_tokenizer

from . import checkpoint
from .batcher import Batch, Batcher, ConsumedIds
from .checkpoint_writer import CheckpointWriter
from .config import TrainerConfig
from .digest_chain import DigestChain, read_chain
from .dist import sync_state
from .encoders import Taken, make_encoder
from .evaluate import evaluate
from .feeding import TaskFeeder
from .keys import load_signing_key
from .lag_control import next_lag_cap
from .lambda_control import LambdaSchedule
from .learner import Learner, nonfinite_samples, pack
from .lease import LeaderLease, LeaseLost
from .published import check_finite_state
from .warmstart import anchor_reference, load_reference, load_warm_start, warm_start_learner

log = get_logger("trainer")


def staleness_histogram(lags: list[int]) -> dict[str, int]:
    """{lag: count} over the batch's samples (string keys: JSON/msgpack maps)."""
    vals, counts = np.unique(np.asarray(lags, dtype=np.int64), return_counts=True)
    return {str(int(v)): int(c) for v, c in zip(vals, counts)}


def _mean(xs: list) -> float:
    """A batch whose every rollout was parked (a skipped step) has nothing to average: 0."""
    return float(np.mean(xs)) if len(xs) else 0.0


async def _after(delay_s: float, coro) -> None:
    try:
        await asyncio.sleep(delay_s)
    except BaseException:
        coro.close()  # cancelled while waiting: the publication never starts
        raise
    await coro


async def start_sweeper(bus):
    """While leading: SCORED messages whose deliveries ran out without a verdict (naks on repeated
    step-downs, leaders killed holding them) would sit in the stream forever, never redelivered.
    Park those given up on before we lead (one scan, before our first fetch) and those given up
    on while we lead (the server's MAX_DELIVERIES advisory) in DLQ with a reason.
    Returns the advisory subscription, or None where the role may not do it (logged)."""
    sub = None
    try:
        sub = await watch_max_deliveries(bus, topo.SCORED, topo.TRAINER_CONSUMER)
        await bus.nc.flush()  # subscribed before our first fetch triggers an advisory
        parked = await sweep_stranded(bus, topo.SCORED, topo.TRAINER_CONSUMER)
        if parked:
            log.warning("parked stranded scored rollouts in DLQ", parked=parked)
    except Exception as e:  # no rights (a restricted role) or a broker blip: say so, go on
        log.warning("stranded-message sweep unavailable", error=f"{type(e).__name__}: {e}")
    return sub


def warmstart_record(cfg: TrainerConfig, steps_done: int, checks: list[dict]) -> dict:
    """Flat metrics of a finished warm start: steps done, why it stopped (steps: a plain step
    count; until: a success check passed; cap: [trainer.warmstart] steps reached first) and the last check."""
    stopped = "steps"
    if cfg.warmstart.until > 0:
        passed = (
            checks
            and checks[-1]["warmstart_step"] == steps_done
            and checks[-1]["warmstart_check_success"] >= cfg.warmstart.until
        )
        stopped = "until" if passed else "cap"
    out = {"warmstart_steps_done": steps_done, "warmstart_stopped": stopped}
    if checks:
        out.update(
            warmstart_checks=len(checks),
            warmstart_check_success_last=checks[-1]["warmstart_check_success"],
            warmstart_until=cfg.warmstart.until,
        )
    return out


class Trainer:
    def __init__(self, cfg: TrainerConfig, bus, learner: Learner, model_cfg: ModelConfig):
        self.cfg, self.bus, self.learner, self.model_cfg = cfg, bus, learner, model_cfg
        cfg.configure_envs()  # before the warm start, the feeder or an eval samples a task
        self.lease = LeaderLease(bus, cfg.trainer_id, cfg.lease.ttl_s, cfg.lease.renew_every_s)
        self.version, self.step_n, self.digest = 0, 0, ""
        self.consumed = ConsumedIds(limit=cfg.run.dedupe_window)
        self.published: dict[str, torch.Tensor] = {}
        self.warmstarted = False
        self.warmstart_record: dict = {}  # where this leader's warm start stopped (metrics, once)
        self.fed = asyncio.Event()  # set when a batch is taken or acked: the feeder tops up at once
        self.sync_replaced = 0  # sync: tasks published again because theirs produced nothing
        self.steps_skipped = 0  # non-finite steps skipped (weights untouched), this leader
        self.lambda_schedule = LambdaSchedule(cfg)  # ramp / budget write KV λ per version (fixed: never)
        self.encoder = make_encoder(cfg, learner)  # gathered or sharded, once: see trainer/encoders.py
        self.chain = DigestChain()  # what the run published: a checkpoint must agree with it
        # checkpoint_every > 1: batches of versions published but not yet checkpointed, oldest first;
        # acked only once a checkpoint recording their ids is durable (a crash re-trains them)
        self.unacked: list[Batch] = []
        # [trainer.checkpoint] background: the writer thread, the task acking its newest write (each
        # chained after the previous one's), a write's error (raised at the next step)
        self.writer = (
            CheckpointWriter(
                cfg.checkpoint.dir,
                cfg.checkpoint.keep,
                before_write=learner.checkpoint.wait,  # sharded: the shards complete before named
                delay_s=cfg.faults.checkpoint_delay_s,
            )
            if cfg.checkpoint_in_background
            else None
        )
        self.acking: asyncio.Task | None = None
        self.ack_lock = asyncio.Lock()
        self.write_error: BaseException | None = None
        self.submitted_version = 0  # the version of the newest snapshot handed to the writer
        self.last_snapshot: checkpoint.TrainerState | None = None  # its CPU buffers, reused
        # the checkpoint's share of this term's wall time: seconds the loop was blocked on it
        self.ckpt_block_total_s, self.lead_t0 = 0.0, time.perf_counter()

    def state(self) -> checkpoint.TrainerState:
        return checkpoint.TrainerState(
            version=self.version,
            epoch=self.lease.epoch,
            **self.learner.checkpoint.payload(self.cfg.checkpoint.dir, self.lease.epoch, self.version),
            consumed=self.consumed.to_list(),
            digest=self.digest,
            model_config=self.model_cfg.to_dict(),
            step=self.step_n,
            warmstarted=self.warmstarted,
        )

    def save(self) -> None:
        st = self.state()
        self.learner.checkpoint.wait()  # the shards complete before the file that names them
        checkpoint.save(self.cfg.checkpoint.dir, st, keep=self.cfg.checkpoint.keep)

    def resume(self) -> bool:
        st = checkpoint.load_latest(self.cfg.checkpoint.dir, verify=self.chain.check)
        if st is None:
            sync_state(self.learner)
            return False
        self.learner.checkpoint.load(self.cfg.checkpoint.dir, st.model, st.optimizer)
        self.version, self.step_n, self.warmstarted = st.version, st.step, st.warmstarted
        saved = Path(self.cfg.run.dir) / "warmstart.pt" if self.cfg.run.dir else None
        if (
            st.warmstarted
            and self.learner.reference is not None
            and not (saved and saved.exists() and load_reference(self.learner.reference, str(saved)))
        ):
            log.warning(
                "resumed a warm-started run: its KL reference is the initial weights, not the warm start"
            )
        self.consumed = ConsumedIds(st.consumed, limit=self.cfg.run.dedupe_window)
        sync_state(self.learner)
        bits = self.learner.publication.published_state()
        if st.digest and not digest_matches(bits, st.digest):  # whole-state or sharded (parts) digest
            raise checkpoint.CheckpointError(
                f"checkpoint v{st.version}: bf16 state does not match the recorded digest {st.digest}"
            )
        log.info(
            "resumed from checkpoint", version=st.version, prev_epoch=st.epoch, consumed=len(st.consumed)
        )
        return True

    def prepare(self) -> None:
        """Newly leading: resume, warm start once, checkpoint under our epoch."""
        self.resume()
        if not self.warmstarted and (self.cfg.warmstart.reuse or self.cfg.warmstart.steps):
            if self.cfg.warmstart.reuse:  # an earlier run's warm start, as it saved it
                saved = load_warm_start(self.learner.model, self.cfg.warmstart.reuse, self.model_cfg)
                self.warmstart_record = {
                    "warmstart_steps_done": saved.get("warmstart_steps_done"),
                    "warmstart_stopped": "loaded",
                    "warmstart_from": self.cfg.warmstart.reuse,
                }
            else:
                # every rank takes part (a sharded forward is a collective): see warm_start_learner
                checks: list[dict] = []

                def on_check(rec: dict) -> None:  # each stop check, as it happens (the run's record)
                    checks.append(rec)
                    self.write_jsonl({**rec, "ts": time.time()})

                losses = warm_start_learner(
                    self.learner, self.cfg, self.model_cfg, self.cfg.warmstart.style, on_check=on_check
                )
                self.warmstart_record = warmstart_record(self.cfg, len(losses), checks)
            self.warmstarted = True
            anchor_reference(self.learner)  # kl_coef: the penalty keeps RL near this policy
            log.info("warm start done", **self.warmstart_record)
            self.write_jsonl({**self.warmstart_record, "ts": time.time()})
            if self.cfg.run.dir:  # the policy RL starts from (`asyncrl calibrate-cost --checkpoint` and
                # the final eval's initial row read it)
                torch.save(
                    {
                        "model": self.learner.publication.full_state(),
                        "model_config": self.model_cfg.to_dict(),
                        "version": self.version,
                        "warmstart_steps_done": self.warmstart_record["warmstart_steps_done"],
                    },
                    Path(self.cfg.run.dir) / "warmstart.pt",
                )
            sync_state(self.learner)
        self.published = self.learner.publication.published_state()
        self.submitted_version = self.version
        self.encoder.start()  # the base of the next version (sharded: every rank's rows)
        self.full_bytes = sum(t.numel() * t.element_size() for t in self.published.values())
        self.digest = delta_codec.state_digest(self.published)
        self.save()

    async def publish_metrics(self, values: dict) -> None:
        values = {k: v for k, v in values.items() if k not in ("rollout_ids", "trained_ids", "dropped_ids")}
        try:
            await self.bus.publish(
                topo.metrics_subject("trainer", self.cfg.trainer_id),
                Metrics(
                    component="trainer", component_id=self.cfg.trainer_id, step=self.step_n, values=values
                ),
            )
        except Exception as e:  # metrics are best effort; the step is already durable
            log.warning("metrics publish failed", error=str(e))

    async def maybe_evaluate(self, version: int, published: dict) -> dict:
        """Held-out success of the published policy every `eval_every` versions (and at the start)."""
        cfg = self.cfg
        if not cfg.tasks.eval_every or version % cfg.tasks.eval_every:
            return {}
        return await asyncio.to_thread(
            evaluate,
            published,
            self.model_cfg,
            load_tokenizer(cfg.policy.tokenizer),
            cfg.tasks.envs,
            cfg.tasks.sampling,
            cfg.tasks.eval_prompts,
            cfg.run.seed,
            cfg.tasks.chat_template,
        )

    def write_jsonl(self, values: dict) -> None:
        if not self.cfg.run.dir:
            return
        p = Path(self.cfg.run.dir) / "metrics" / "trainer.jsonl"
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "a") as f:
            f.write(json.dumps(values) + "\n")

    async def lead(self, stop: asyncio.Event) -> int:
        cfg = self.cfg
        epoch = await self.lease.acquire(stop)
        if not epoch:
            return 0
        lost = asyncio.Event()
        self.unacked = []  # a previous term's were handed back (nak) when it ended
        keeper = asyncio.create_task(self.lease.keep(stop, lost))
        self.chain = await read_chain(self.bus)  # resume only a checkpoint of this run's own line
        await asyncio.to_thread(self.prepare)  # in a thread: the lease keeps being renewed
        publisher = self.make_publisher(epoch)
        await publisher.publish_keyframe(self.published, self.version, self.model_cfg)
        if self.warmstart_record:  # the live table says where the warm start stopped
            await self.publish_metrics({**self.warmstart_record, "version": self.version})
            self.warmstart_record = {}
        ev = await self.maybe_evaluate(self.version, self.published)
        if ev:
            values = {**ev, "version": self.version, "epoch": epoch, "ts": time.time()}
            log.info("eval", **values)
            self.write_jsonl(values)
            await self.publish_metrics(values)
        sweeper = await start_sweeper(self.bus) if cfg.run.sweep_stranded else None
        batcher = Batcher(self.bus, cfg, self.consumed, self.model_cfg.vocab_size)
        await batcher.start()
        await self.lambda_schedule.start(self.bus, self.version)  # before the first group is stamped
        feeder = TaskFeeder(self.bus, cfg, held=self.held_messages)
        feed_task = (
            asyncio.create_task(feeder.run(stop, lambda: self.version, kick=self.fed))
            if cfg.tasks.feed and cfg.run.mode == "async"
            else None
        )
        log.info("leading", epoch=epoch, version=self.version, mode=cfg.run.mode)
        self.ckpt_block_total_s, self.lead_t0 = 0.0, time.perf_counter()
        batch, publishing = None, None
        try:
            while not stop.is_set() and not lost.is_set():
                if cfg.run.max_steps and self.step_n >= cfg.run.max_steps:
                    break
                stopped = lambda: stop.is_set() or lost.is_set()  # noqa: E731
                if cfg.run.mode == "sync" and cfg.tasks.feed:
                    if publishing is not None:  # the barrier: tasks for v only once v is out
                        await publishing
                    await feeder.publish(cfg.batch.groups, min_version=self.version)
                    batch = await self.next_sync_batch(batcher, feeder, stopped)
                else:
                    batch = await batcher.next_batch(self.version, stopped)
                if batch is None:
                    continue
                self.fed.set()
                publishing = await self.train_on(batch, batcher, publisher, lost, publishing)
                batch = None
            if publishing is not None:
                await publishing
            await self._drain_writes()  # a clean stop: the write in flight lands (and acks) first
            if self.unacked:  # a clean end checkpoints the last version: nothing to re-train
                await self.checkpoint_unacked(batcher, lost)
        except LeaseLost as e:  # deposed mid-step: nothing of this step was published
            log.error("stepping down", error=str(e))
            lost.set()
        finally:
            if publishing is not None and not publishing.done():
                publishing.cancel()  # only on an error path: its batch is redelivered
            await cancel_and_wait([feed_task])
            if self.writer is not None:  # never a write of this term in flight past it
                await asyncio.to_thread(self.writer.wait_quietly)
                self.writer.release()
                if self.acking is not None:  # acks only while leading: deposed, it acks nothing
                    await asyncio.gather(self.acking, return_exceptions=True)
                self.acking = None
            if sweeper is not None:
                try:
                    await sweeper.unsubscribe()
                except Exception as e:
                    log.debug("sweeper unsubscribe failed", error=str(e))
            await batcher.close(held_back=batch)
            stop_keeper = stop.is_set() or lost.is_set()
            await cancel_and_wait([keeper])  # (a keeper that lost its cancel would renew a released lease)
            if not lost.is_set():
                await self.lease.release()
            log.info("leader loop ended", version=self.version, lost=lost.is_set(), stopped=stop_keeper)
        if lost.is_set() and cfg.faults.probe_when_deposed:
            await self.probe_deposed(publisher)
        return 3 if lost.is_set() else 0

    async def next_sync_batch(self, batcher: Batcher, feeder: TaskFeeder, stopped) -> Batch | None:
        """Sync mode: this version's `batch_groups` tasks were just published. A task none of whose
        rollouts reaches SCORED (all parked in DLQ, or the task expired) never forms a group, and
        group_timeout only covers groups with a member: without a top-up the barrier waits forever.
        So after sync_task_timeout_s without a full batch, publish again the tasks that have not
        a single rollout here (late originals are not wasted: they join the next batch)."""
        wait_s = self.cfg.run.sync_task_timeout_s or self.cfg.batch.group_timeout_s
        while True:
            batch = await batcher.next_batch(self.version, stopped, max_wait_s=wait_s)
            if batch is not None or stopped():
                return batch
            missing = self.cfg.batch.groups - len(batcher.groups)
            if missing > 0:
                log.warning(
                    "sync: tasks of this version produced no rollout; publishing replacements",
                    version=self.version,
                    missing=missing,
                    waited_s=wait_s,
                )
                await feeder.publish(missing, min_version=self.version)
                self.sync_replaced += missing

    def make_publisher(self, epoch: int) -> WeightPublisher:
        """Every write fenced twice: the lease CAS (`confirm`) just before it, and the server's
        expected-last-sequence check in it, so a deposed leader's write is refused however long
        it was paused, and a standby takes over only versions already checkpointed."""
        cfg = self.cfg
        pub = WeightPublisher(
            self.bus,
            epoch,
            cfg.trainer_id,
            load_signing_key(cfg.publish.signing_key),
            fence=self.lease.confirm,
        )
        if cfg.faults.stop_before_publish:
            pub.before_write = self._stop_before(cfg.faults.stop_before_publish)
        return pub

    def _stop_before(self, version: int):
        """Fault injection: freeze this process between the lease CAS and the write of `version`."""
        done = False

        async def hook(ev) -> None:
            nonlocal done
            if not done and ev.version == version:
                done = True
                log.warning(
                    "fault injection: stopping before publish",
                    version=version,
                    msg=ev.msg_id(),
                    epoch=ev.epoch,
                )
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGSTOP)

        return hook

    async def probe_deposed(self, publisher: WeightPublisher) -> None:
        """Fault injection: a deposed leader publishes its next version anyway, skipping its own
        lease checks; the server must refuse the write (bench.chaos counts these log lines)."""
        if publisher.last_seq is None:
            log.info("deposed leader never published: nothing to probe")
            return
        publisher.fence, publisher.before_write, publisher.max_conflicts = None, None, 0
        v = self.version + 1
        try:  # a keyframe; sharded, a manifest of the last parts once there are some
            await self.encoder.probe(publisher, self.published, v, self.model_cfg)
        except Fenced as e:
            log.warning(
                "deposed leader publish refused by the server", version=v, epoch=publisher.epoch, error=str(e)
            )
        except Exception as e:
            log.warning("deposed leader publish failed", version=v, error=f"{type(e).__name__}: {e}")
        else:
            log.error("deposed leader publish ACCEPTED by the server", version=v, epoch=publisher.epoch)

    def _step(self, packed) -> dict:
        return self.learner.step(packed)

    async def train_on(
        self,
        batch,
        batcher: Batcher,
        publisher: WeightPublisher,
        lost: asyncio.Event,
        previous: asyncio.Task | None = None,
    ) -> asyncio.Task:
        """Compute version v+1 from `batch`; return the task that checkpoints and publishes it.

        Publication (encode, checkpoint, delta, ack, metrics) overlaps the next batch's step: it
        waits on I/O and the bus more than on the CPU. At most one publication is in flight, and
        each starts only after the previous one finished, so versions go out in order."""
        t0 = time.perf_counter()
        if self.write_error is not None:  # a background write failed: stop as an inline one would
            raise self.write_error
        packed = pack(batch)
        live = sum(1 for s in packed if s.weight > 0 and s.completion_ids)
        # CPU/GPU-heavy parts run in a thread so the event loop keeps renewing the lease
        stats: dict = await asyncio.to_thread(self._step, packed) if live else {}
        if stats.get("skipped"):  # weights untouched: park what poisoned it, retry the rest once
            packed, stats = await self._after_skip(batch, batcher, packed, stats)
            live = sum(1 for s in packed if s.weight > 0 and s.completion_ids) if stats else 0
        if live:
            self.version += 1
            self.step_n += 1
        stats["max_lag_applied"] = batcher.max_lag  # the cap this batch was weighed with
        batcher.max_lag = next_lag_cap(
            batcher.max_lag, stats.get("k3_mean"), self.cfg.batch.max_k3, self.cfg.batch.max_lag
        )
        batch.trained_ids = [p.rollout_id for p in packed if live and p.weight > 0 and p.completion_ids]
        self.consumed.add(batch.rollout_ids)
        # what the learner hands over now, before the next step changes the weights: the gathered
        # state, or (sharded) every rank's part, a collective
        taken = await self.encoder.take(self.published, live, self.version, stats)
        new = taken.state
        if new is not None and live:  # never encode, checkpoint or publish a non-finite weight
            await asyncio.to_thread(check_finite_state, new, self.version)
        # the next step updates the weights and optimizer in place: checkpoint a copy of this state
        # (checkpoint_every > 1: only every K-th version; the others are published uncheckpointed)
        ts = time.perf_counter()
        due = self._checkpoints(live)
        if due and self.writer is not None:
            self.writer.claim()  # the next version finds the writer busy: it takes no second snapshot
            self.submitted_version = self.version
        snapshot = None
        if due and self.writer is not None:  # the writer is idle: the last snapshot's buffers are free
            snapshot = await asyncio.to_thread(lambda: checkpoint.snapshot(self.state(), self.last_snapshot))
            self.last_snapshot = snapshot
        elif due:  # inline: the previous publication may still be writing its snapshot
            snapshot = await asyncio.to_thread(lambda: checkpoint.snapshot(self.state()))
        stats["snapshot_s"] = time.perf_counter() - ts  # on the critical path (the copy)
        if previous is not None:
            await previous  # v-1 is out (or raised) before v starts going out
        if snapshot is not None:
            snapshot.digest = self.digest  # v-1's, now final; a live step replaces it with v's below
        if new is not None:
            self.published = new
        publication = self.publish_version(
            batch, packed, stats, live, taken, snapshot, batcher, publisher, lost, t0, self.version
        )
        if self.cfg.faults.step_delay_s:  # tests only: a step + publication slower than ack_wait
            publication = _after(self.cfg.faults.step_delay_s, publication)
        return asyncio.create_task(publication)

    async def _after_skip(self, batch, batcher: Batcher, packed, stats: dict) -> tuple[list, dict]:
        """A step skipped on a non-finite loss or gradient norm (parameters and optimizer state
        untouched): park in DLQ the rollouts whose shipped numbers are not finite and train once
        more on the rest; when no rollout is to blame, or the retry fails too, park every live
        rollout of the batch (the step cannot say which one). -> (packed, stats); stats are
        empty when nothing was trained."""
        for attempt in (1, 2):
            reason = stats["skipped"]
            self.steps_skipped += 1
            metrics.STEPS_SKIPPED.labels(reason).inc()
            blame = nonfinite_samples(packed)
            last = attempt == 2 or not blame
            if last:
                blame = {
                    p.rollout_id: f"{reason} in a step on it (no single rollout to blame)"
                    for p in packed
                    if p.weight > 0 and p.completion_ids and p.rollout_id not in blame
                } | blame
            parked = await batcher.park(batch, {k: f"{reason}: {v}" for k, v in blame.items()})
            log.error(
                "non-finite step skipped: parameters and optimizer state untouched",
                reason=reason,
                version=self.version,
                parked=parked,
                attempt=attempt,
            )
            packed = pack(batch)
            if last or not any(p.weight > 0 and p.completion_ids for p in packed):
                return packed, {}
            stats = await asyncio.to_thread(self._step, packed)
            if not stats.get("skipped"):
                return packed, stats
        return packed, {}

    def _checkpoints(self, live: bool) -> bool:
        """Whether this version is checkpointed before it goes out: every version, or (checkpoint_every
        = K > 1) every K-th trained one; a batch that trained nothing waits for the next checkpoint.
        In the background: a version due while a write is still in flight is published uncheckpointed
        (trainer/checkpoint_writer.py says why), K counted from the last version written."""
        k = self.cfg.checkpoint.every
        if self.writer is None:
            return k == 1 or (live and self.version % k == 0)
        if not self.writer.idle():
            return False
        return k == 1 or (live and self.version - self.submitted_version >= k)

    def _track_write(self, fut, upto: Batch, batcher: Batcher, lost: asyncio.Event) -> None:
        """Ack, once the write `fut` is durable, every unacked batch up to `upto` (its snapshot records
        their ids); in write order (each ack task awaits the previous one)."""
        self.acking = asyncio.create_task(self._ack_when_durable(fut, upto, batcher, lost, self.acking))

    async def _ack_when_durable(self, fut, upto: Batch, batcher: Batcher, lost: asyncio.Event, prev) -> None:
        if prev is not None:
            await asyncio.gather(prev, return_exceptions=True)
        try:
            await asyncio.wrap_future(fut)
        except Exception as e:
            if not self.lease.valid() or lost.is_set():  # refused its rename (commit_if): deposed
                log.warning("background checkpoint not committed: no longer leading", error=str(e))
                lost.set()
            else:
                log.error("background checkpoint failed", error=f"{type(e).__name__}: {e}")
                self.write_error = e
            return
        async with self.ack_lock:
            while any(b is upto for b in self.unacked):
                # acks only while leading (as the inline path): a new leader resumed without this
                # file may need these messages; unacked, they come back to it
                if not self.lease.valid() or lost.is_set():
                    log.warning(
                        "deposed: a durable checkpoint's batches left unacked", held=len(self.unacked)
                    )
                    return
                await batcher.ack(self.unacked[0])
                self.unacked.pop(0)
        self.fed.set()

    async def _drain_writes(self) -> None:
        """The background write in flight is durable and its batches acked; raises a write's error."""
        if self.writer is None:
            return
        if self.acking is not None:
            await self.acking
        if self.write_error is not None:
            raise self.write_error

    async def checkpoint_unacked(self, batcher: Batcher, lost: asyncio.Event) -> None:
        """Checkpoint the current state (no step running) and ack the batches it records."""
        if not self.lease.valid() or lost.is_set():
            raise LeaseLost("leader lease no longer valid: refusing to checkpoint")
        await asyncio.to_thread(self.save)
        await self._ack_unacked(batcher)

    def held_messages(self) -> int:
        """SCORED messages of versions published but not yet checkpointed (acked by the next one)."""
        return sum(len(b.samples) + len(b.late) + len(b.excluded) for b in self.unacked)

    async def _ack_unacked(self, batcher: Batcher) -> None:
        """A checkpoint recording every batch in `unacked` is durable: ack them, oldest first."""
        async with self.ack_lock:
            while self.unacked:
                await batcher.ack(self.unacked[0])
                self.unacked.pop(0)

    def _checkpoint_metrics(self, stats: dict) -> None:
        """checkpoint_block_s: what this version's checkpoint held the loop up (the CPU copy, plus the
        write itself when inline: a version goes out only after it); checkpoint_write_s: the newest
        completed write (background: off the critical path); checkpoint_share: this term's blocked
        seconds over its wall seconds."""
        block = stats.get("snapshot_s", 0.0) + stats.get("checkpoint_s", 0.0)
        self.ckpt_block_total_s += block
        wall = time.perf_counter() - self.lead_t0
        stats.update(
            checkpoint_background=self.writer is not None,
            checkpoint_block_s=block,
            checkpoint_block_total_s=self.ckpt_block_total_s,
            lead_wall_s=wall,
            checkpoint_share=self.ckpt_block_total_s / wall if wall > 0 else 0.0,
        )
        if self.writer is None:
            stats["checkpoint_write_s"] = stats.get("checkpoint_s", 0.0)
        elif self.writer.last_write_s is not None:
            stats.update(
                checkpoint_write_s=self.writer.last_write_s,
                checkpoint_written_version=self.writer.last_written_version,
                checkpoint_write_total_s=self.writer.write_total_s,
                checkpoint_write_cpu_total_s=self.writer.write_cpu_total_s,
            )

    async def publish_version(
        self,
        batch,
        packed,
        stats,
        live,
        taken: Taken,
        snapshot,
        batcher: Batcher,
        publisher: WeightPublisher,
        lost: asyncio.Event,
        t0: float,
        version: int,
    ) -> None:
        """`taken`: version v as the step left it (trainer/encoders.py), encoded here into the one
        EncodedVersion the publisher takes (None when the batch trained nothing: nothing goes out).
        `snapshot`: the state to checkpoint before publishing, None for a version published
        uncheckpointed (checkpoint_every > 1): its batch then waits in `unacked` for the next one."""
        cfg = self.cfg
        encoded = await taken.encode(stats)  # gathered: the delta is coded now (encode_s)
        if "encode_s" in stats and stats.get("step_s"):  # what the delta coding costs against the step
            stats["encode_frac"] = stats["encode_s"] / stats["step_s"]
        if not self.lease.valid() or lost.is_set():
            raise LeaseLost("leader lease no longer valid: refusing to checkpoint or publish")
        if encoded is not None:  # the codec already hashed every tensor of v: no second pass
            self.digest = encoded.new_digest
            if snapshot is not None:
                snapshot.digest = encoded.new_digest
        tc = time.perf_counter()
        write = None
        if snapshot is not None and self.writer is not None:  # published now, acked once durable
            # (idle: it was claimed for this snapshot; waiting here, off the event loop, only if not)
            await asyncio.to_thread(self.writer.wait_quietly)
            write = self.writer.submit(snapshot, commit_if=self.lease.valid)
        elif snapshot is not None:
            await asyncio.to_thread(self.learner.checkpoint.wait)  # async shard save: complete before named
            await asyncio.to_thread(checkpoint.save, cfg.checkpoint.dir, snapshot, cfg.checkpoint.keep)
        stats["checkpoint_s"] = time.perf_counter() - tc
        self._checkpoint_metrics(stats)
        tp = time.perf_counter()
        # the delta or the manifest, then the keyframe every keyframe_interval versions
        delta_bytes = await publisher.publish(encoded, self.model_cfg) if encoded is not None else 0
        stats["publish_s"] = time.perf_counter() - tp
        self.unacked.append(batch)
        if write is not None:  # the checkpoint being written records every unacked batch
            self._track_write(write, batch, batcher, lost)
        elif snapshot is not None:  # the checkpoint just written records every unacked batch
            await self._ack_unacked(batcher)
        stats.update(checkpointed=snapshot is not None, unacked_versions=len(self.unacked))
        self.fed.set()
        lags = [s.lag for s in packed]
        # outcomes of every episode this version consumed: skipped uniform groups included
        outcome = [(s.reward, s.success, s.cost) for s in packed] + [
            (x.scored.reward, x.scored.success, x.scored.cost) for x in batch.skipped
        ]
        # each group's λ (stamped at feed time: one per group; > 1 distinct only from older feeders)
        group_lams: dict[int, set[float]] = {}
        for s in packed:
            group_lams.setdefault(s.group, set()).add(s.lambda_)
        tokens = (
            _mean([x.rollout.cost_tokens for x in batch.samples + batch.skipped])
            if batch.samples or batch.skipped
            else None
        )
        values = {
            **{k: v for k, v in stats.items()},
            "version": version,
            "epoch": self.lease.epoch,
            "reward_mean": _mean([o[0] for o in outcome]),
            "success_mean": _mean([o[1] for o in outcome]),
            "cost_mean": _mean([o[2] for o in outcome]),
            "lambda": _mean([s.lambda_ for s in packed]),
            "group_lambda": [max(group_lams[g]) for g in sorted(group_lams)],
            "lambda_mixed_groups": sum(1 for v in group_lams.values() if len(v) > 1),
            "tokens_per_answer": tokens,
            "penalty_mode": self.cfg.cost.penalty,
            **(await self.lambda_schedule.after_version(self.bus, version, tokens)),
            "uniform_groups_skipped": len({x.rollout.task_id for x in batch.skipped}),
            "samples": len(packed),
            "live_samples": live,
            "groups": batch.n_groups,
            "staleness_mean": _mean(lags),
            "staleness_hist": staleness_histogram(lags),
            "dropped_stale": sum(1 for s in packed if s.weight == 0),
            # in-flight updates: trajectories whose tokens came from more than one policy version
            "multi_version_samples": sum(
                1
                for s in batch.samples  # -1 marks observation tokens (no version)
                if len({v for v in s.rollout.token_versions if v >= 0}) > 1
            ),
            "late_members": len(batch.late),
            "timed_out_members": batcher.counters["timed_out"],
            "delta_bytes": delta_bytes,
            "delta_ratio": delta_bytes / self.full_bytes,
            "changed_frac": encoded.changed_frac if encoded is not None else 0.0,
            "duplicates": batcher.counters["duplicates"],
            "invalid": batcher.counters["invalid"],
            "steps_skipped": self.steps_skipped,
            "parked_by_trainer": batcher.counters.get("parked", 0),
            "total_s": time.perf_counter() - t0,
            "threads": torch.get_num_threads(),  # (up: thread_plan)
            "rollout_ids": batch.rollout_ids,
            "ts": time.time(),
            "trained_ids": batch.trained_ids,
            "dropped_ids": batch.dropped_ids,
            "sync_replaced": self.sync_replaced,
            "newest_token_version": max(
                (max(s.rollout.token_versions, default=0) for s in batch.samples), default=0
            ),
            **(await self.maybe_evaluate(version, taken.state)),
        }
        log.info(
            "step",
            **{
                k: (round(v, 5) if isinstance(v, float) else v)
                for k, v in values.items()
                if k not in ("rollout_ids", "trained_ids", "dropped_ids", "staleness_hist")
            },
        )
        self.write_jsonl(values)
        metrics.observe_trainer_step(values)
        await self.publish_metrics(values)
