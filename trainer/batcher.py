"""Pull scored rollouts from SCORED, dedupe by rollout id, assemble complete groups, weigh staleness.

Nothing is acked here on arrival except true duplicates (another stream message with an id that
is already consumed or already pending). A batch's messages are acked by the trainer loop only
after the step's checkpoint is written and its delta published (`Batcher.ack`).

Every held message (waiting in a group, or handed out in a batch that is being trained,
checkpointed and published) is kept alive by one background task that sends `in_progress`
every ack_wait/3, however long the step takes. If the server redelivers a held message anyway
(a heartbeat lost in a broker blip), the new delivery replaces the handle we hold: it is never
acked before the checkpoint that records its rollout.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from bus import topology as topo
from bus.events import EventError, Rollout, Scored, decode
from kernel import get_logger
from policy import QuantConfig, SamplingConfig, SamplingMask

log = get_logger(__name__)


@dataclass
class Sample:
    rollout: Rollout
    scored: Scored
    msg: object  # the JetStream message (acked after publication)
    arrived: float = field(default_factory=time.monotonic)
    group: int = 0  # index of its group in the batch
    lag: int = 0  # current version - oldest token version
    weight: float = 1.0  # 0 = dropped as stale


@dataclass
class Batch:
    samples: list[Sample]
    n_groups: int
    version: int  # trainer version the lags are measured against
    # the books: ids whose sample entered a gradient step with weight > 0 (set by the trainer);
    # the rest of rollout_ids were consumed and dropped (stale, group of one, or no live step)
    trained_ids: list[str] = field(default_factory=list)
    # members of groups closed at their deadline that arrived after: consumed (acked after this
    # batch's checkpoint, like every sample) but never part of a gradient step
    late: list[Sample] = field(default_factory=list)
    # complete groups skipped since the previous batch because their rewards were all equal
    # (skip_uniform_groups): already acked, never part of a gradient step
    skipped: list[Sample] = field(default_factory=list)
    # members whose scoring failed for the infrastructure (Scored.infra: the sandbox, a workspace not
    # made, a scorer crash): consumed and acked like `late`, never in a gradient step nor a baseline
    excluded: list[Sample] = field(default_factory=list)

    @property
    def rollout_ids(self) -> list[str]:
        return [s.rollout.rollout_id for s in self.samples + self.late + self.skipped + self.excluded]

    @property
    def dropped_ids(self) -> list[str]:
        trained = set(self.trained_ids)
        return [r for r in self.rollout_ids if r not in trained]


def stale_weights(lags: list[int], max_lag: int, mode: str, stale_weight: float) -> list[float]:
    """Per-sample weight: 1 within max_lag; beyond it 0 (drop) or stale_weight**(lag-max_lag)."""
    if mode == "drop":
        return [1.0 if lag <= max_lag else 0.0 for lag in lags]
    return [1.0 if lag <= max_lag else stale_weight ** (lag - max_lag) for lag in lags]


class ConsumedIds:
    """Rollout ids already used (or dropped), bounded FIFO; saved in every checkpoint."""

    def __init__(self, ids: list[str] = (), limit: int = 200_000):
        self.limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()
        self.add(ids)

    def __contains__(self, rid: str) -> bool:
        return rid in self._ids

    def add(self, ids) -> None:
        for rid in ids:
            self._ids[rid] = None
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def to_list(self) -> list[str]:
        return list(self._ids)


def check_rollout(r: Rollout, vocab_size: int) -> None:
    """What the learner will need of a rollout, checked on arrival (EventError -> DLQ at once, never
    retried): every number (Rollout.validate: logprobs finite and <= 0, versions monotone, ...), token
    ids and kept ids inside this model's vocabulary, each masked row keeping its sampled token (else
    the replayed logprob is -inf), sampling and quant configs that parse. Vectorised (numpy)."""
    where = f"Rollout {r.rollout_id}"
    try:
        r.validate()
        if not r.prompt_ids:
            raise ValueError("empty prompt")
        for name, ids in (("prompt_ids", r.prompt_ids), ("completion_ids", r.completion_ids)):
            a = np.asarray(ids, dtype=np.int64)
            if (out := np.flatnonzero((a < 0) | (a >= vocab_size))).size:
                i = int(out[0])
                raise ValueError(f"{name}[{i}] = {int(a[i])} outside the vocabulary [0, {vocab_size})")
        if r.sampling_mask:
            mask = SamplingMask.from_wire(r.sampling_mask)
            if len(mask) != len(r.completion_ids):
                raise ValueError("sampling mask rows != completion tokens")
            if len(mask.ids) and int(mask.ids.max()) >= vocab_size:
                raise ValueError(
                    f"sampling_mask keeps id {int(mask.ids.max())} outside the vocabulary [0, {vocab_size})"
                )
            kept = np.clip(mask.counts, 0, None)
            rows = np.repeat(np.arange(len(mask)), kept)
            sampled = np.asarray(r.completion_ids, np.int64)[rows]  # each kept id's row's sampled token
            hit = np.bincount(rows[mask.ids == sampled], minlength=len(mask))
            if (miss := np.flatnonzero((mask.counts > 0) & (hit == 0))).size:
                raise ValueError(
                    f"sampling_mask row {int(miss[0])} does not keep the sampled token "
                    f"completion_ids[{int(miss[0])}]"
                )
        QuantConfig.from_wire(r.quant)
        SamplingConfig.from_dict(r.sampling)
    except EventError:
        raise
    except Exception as e:  # bad input whatever the error type (int(inf) is an OverflowError): parked
        raise EventError(f"{where}: {e}") from None


def _stream_seq(msg) -> int | None:
    try:
        return msg.metadata.sequence.stream
    except Exception:
        return None


class Batcher:
    def __init__(self, bus, cfg, consumed: ConsumedIds, vocab_size: int):
        self.bus, self.cfg, self.consumed, self.vocab_size = bus, cfg, consumed, vocab_size
        self.heartbeat_s = cfg.bus.topology.ack_wait_s / 3  # held messages must not time out
        self.groups: OrderedDict[str, dict[str, Sample]] = OrderedDict()  # task_id -> rollout_id -> sample
        # rollout id -> sample handed out in a batch and not yet acked (trained, being checkpointed)
        self.inflight: dict[str, Sample] = {}
        self.sub = None
        self.max_lag = cfg.batch.max_lag  # the lag cap applied (trainer/lag_control.py moves it: max_k3)
        self.counters = {
            "duplicates": 0,
            "invalid": 0,
            "received": 0,
            "redelivered_held": 0,
            "heartbeats": 0,
            "timed_out": 0,
            "late": 0,
            "uniform_groups": 0,
        }
        self._keepalive: asyncio.Task | None = None
        self.closed: OrderedDict[str, None] = OrderedDict()  # groups closed by group_timeout_s (bounded)
        self.late: dict[str, Sample] = {}  # late members of closed groups, ride along with the next batch
        self.skipped: list[Sample] = []  # uniform groups (acked), recorded with the next batch

    @property
    def pending(self) -> int:
        return sum(len(g) for g in self.groups.values())

    async def start(self) -> None:
        self.sub = await self.bus.pull(topo.SCORED, topo.TRAINER_CONSUMER)
        try:  # the server's ack_wait is the truth (the consumer may be provisioned by another config)
            server_ack_wait = (await self.sub.consumer_info()).config.ack_wait
            if server_ack_wait:
                self.heartbeat_s = min(self.heartbeat_s, float(server_ack_wait) / 3)
        except Exception as e:
            log.debug("consumer_info failed; heartbeat from the local config", error=str(e))
        self._keepalive = asyncio.create_task(self._keep_alive())

    def held(self) -> list[Sample]:
        """Every message we hold and have not acked: waiting in groups and in flight in batches."""
        return (
            [s for g in self.groups.values() for s in g.values()]
            + list(self.inflight.values())
            + list(self.late.values())
        )

    async def _take(self, msg) -> None:
        self.counters["received"] += 1
        try:
            scored = decode(msg.data, Scored)
            rollout = scored.get_rollout()
            check_rollout(rollout, self.vocab_size)
        except EventError as e:
            self.counters["invalid"] += 1
            log.warning("invalid scored rollout, parked in DLQ", reason=str(e))
            await self.bus.dlq(msg, str(e), topo.SCORED)
            return
        rid = rollout.rollout_id
        if rollout.task_id in self.closed and rid not in self.inflight and rid not in self.consumed:
            if rid in self.late:  # a redelivery of one we hold: keep the newest handle
                self.late[rid].msg = msg
                return
            self.counters["late"] += 1  # its group was used without it (timed out): never trained,
            self.late[rid] = Sample(
                rollout, scored, msg
            )  # consumed with the next batch (acked after its checkpoint)
            return
        mine = self.groups.get(rollout.task_id, {}).get(rid) or self.inflight.get(rid)
        if mine is not None and _stream_seq(mine.msg) == _stream_seq(msg):
            # a redelivery of a message we hold (waiting, or in a batch not yet checkpointed): keep
            # the newest delivery's handle and ack that one after the checkpoint, never now
            mine.msg = msg
            self.counters["redelivered_held"] += 1
            return
        if mine is not None or rid in self.consumed:
            # another stream message with the same id: the original is held or used (checkpointed,
            # since in-flight ids are found above first), so this copy is redundant
            self.counters["duplicates"] += 1
            await msg.ack()
            return
        self.groups.setdefault(rollout.task_id, {})[rid] = Sample(rollout, scored, msg)

    def _ready_groups(self) -> list[str]:
        now = time.monotonic()
        ready = []
        for tid, g in self.groups.items():
            first = next(iter(g.values()))
            want = first.rollout.group_size or self.cfg.batch.group_size
            timed_out = now - min(s.arrived for s in g.values()) > self.cfg.batch.group_timeout_s
            if len(g) >= want or timed_out:
                ready.append(tid)
        return ready

    async def _skip_uniform(self, ready: list[str]) -> list[str]:
        """Complete groups whose rewards are all equal carry no advantage: ack them now (held,
        they would count against the feeder's cap on finished work and starve the workers) and
        keep them for the next batch's books; -> the ready groups left. A group closed at its
        deadline is left to the normal path (its late members must find it closed)."""
        keep = []
        for tid in ready:
            g = self.groups[tid]
            first = next(iter(g.values()))
            full = len(g) >= (first.rollout.group_size or self.cfg.batch.group_size)
            # reward: exact rewards equal (A = 0 under any adv_norm); success: cost-only differences too
            by = self.cfg.batch.skip_uniform_by
            if (
                not full
                or len(g) < 2
                or len({getattr(s.scored, by) for s in g.values() if not s.scored.infra}) > 1
            ):
                keep.append(tid)
                continue
            for s in self.groups.pop(tid).values():
                await s.msg.ack()
                self.consumed.add([s.rollout.rollout_id])
                self.skipped.append(s)
            self.counters["uniform_groups"] += 1
        return keep

    async def _keep_alive(self) -> None:
        """Until close(): every ack_wait/3, in_progress() each held message, whatever the trainer
        loop is doing (a step, an encode, a checkpoint or a publication may outlast ack_wait)."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            for s in self.held():
                try:
                    await s.msg.in_progress()
                    self.counters["heartbeats"] += 1
                except Exception as e:  # connection blip: a redelivery only swaps the handle
                    log.debug("in_progress failed", error=str(e))

    async def next_batch(self, version: int, stop=None, max_wait_s: float | None = None) -> Batch | None:
        """Block until `batch_groups` groups are complete; None when stop() (a callable or an
        asyncio.Event) turns true or max_wait_s passes first."""
        stopped = stop if callable(stop) else (lambda: stop is not None and stop.is_set())
        cfg = self.cfg
        deadline = None if max_wait_s is None else time.monotonic() + max_wait_s
        while True:
            ready = self._ready_groups()
            if cfg.batch.skip_uniform and ready:
                ready = await self._skip_uniform(ready)
            if len(ready) >= cfg.batch.groups:
                break
            if stopped() or (deadline and time.monotonic() > deadline):
                return None
            want = max(cfg.batch.groups * cfg.batch.group_size - self.pending, cfg.batch.group_size)
            for msg in await self.sub.fetch(want, cfg.batch.fetch_timeout_s):
                await self._take(msg)
        samples: list[Sample] = []
        excluded: list[Sample] = []
        for gi, tid in enumerate(ready[: cfg.batch.groups]):
            missing = (
                next(iter(self.groups[tid].values())).rollout.group_size or cfg.batch.group_size
            ) - len(self.groups[tid])
            if missing > 0:  # closed at its deadline: baseline from the members that came
                self.counters["timed_out"] += missing
                self.closed[tid] = None
                while len(self.closed) > 100_000:
                    self.closed.popitem(last=False)
            for s in self.groups.pop(tid).values():
                if s.scored.infra:  # no verdict on the policy: out of the group and its baseline
                    self.counters[f"infra_{s.scored.infra}"] = (
                        self.counters.get(f"infra_{s.scored.infra}", 0) + 1
                    )
                    s.weight = 0.0
                    excluded.append(s)
                    continue
                s.group = gi
                s.lag = version - min(
                    (v for v in s.rollout.token_versions if v >= 0), default=version
                )  # -1: observation
                samples.append(s)
        self.inflight.update((s.rollout.rollout_id, s) for s in samples + excluded)
        sizes = {}
        for s in samples:
            sizes[s.group] = sizes.get(s.group, 0) + 1
        for s, w in zip(
            samples,
            stale_weights([s.lag for s in samples], self.max_lag, cfg.batch.stale, cfg.batch.stale_weight),
        ):
            # a timed-out group of one has no baseline: consumed and acked, never trained on
            s.weight = (
                0.0 if sizes[s.group] == 1 and (s.rollout.group_size or cfg.batch.group_size) > 1 else w
            )
        late, self.late = list(self.late.values()), {}
        self.inflight.update((s.rollout.rollout_id, s) for s in late)
        skipped, self.skipped = self.skipped, []
        return Batch(
            samples,
            n_groups=min(len(ready), cfg.batch.groups),
            version=version,
            late=late,
            skipped=skipped,
            excluded=excluded,
        )

    async def close(self, held_back: Batch | None = None) -> None:
        """Stepping down: hand every held message (waiting, in flight, and an unfinished batch)
        back at once."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        held = {
            id(s): s
            for s in self.held()
            + (held_back.samples + held_back.late + held_back.excluded if held_back else [])
        }
        for s in held.values():
            try:
                await s.msg.nak()
            except Exception as e:  # they come back after ack_wait anyway
                log.debug("nak failed", error=str(e))
        self.groups.clear()
        self.inflight.clear()
        self.late.clear()
        if self.sub is not None:
            try:
                await self.sub.unsubscribe()
            except Exception as e:
                log.debug("unsubscribe failed", error=str(e))

    async def park(self, batch: Batch, reasons: dict[str, str]) -> int:
        """Park these samples of `batch` ({rollout id: reason}) in DLQ (termed: never redelivered)
        and take them out of the batch, so they are neither acked nor recorded as consumed;
        -> how many. A skipped (non-finite) step parks what poisoned it this way."""
        parked = [s for s in batch.samples if s.rollout.rollout_id in reasons]
        for s in parked:
            await self.bus.dlq(s.msg, f"trainer: {reasons[s.rollout.rollout_id]}", topo.SCORED)
            self.inflight.pop(s.rollout.rollout_id, None)
        batch.samples = [s for s in batch.samples if s.rollout.rollout_id not in reasons]
        self.counters["parked"] = self.counters.get("parked", 0) + len(parked)
        return len(parked)

    async def ack(self, batch: Batch) -> None:
        """After checkpoint + publication: ack every message of the batch (used or dropped)."""
        for s in batch.samples + batch.late + batch.excluded:
            await s.msg.ack()  # the newest delivery's handle (a redelivery swapped it in)
        for rid in batch.rollout_ids:
            self.inflight.pop(rid, None)
