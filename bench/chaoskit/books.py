"""The books of a chaos run, kept from what the processes themselves wrote (independent of the
components' own dedupe), and the report row every scenario returns.

    consumed = rollout ids in every <run_dir>/trainer-*/metrics/trainer.jsonl line, plus the
               newest checkpoint's consumed ids (a leader killed between checkpoint and JSONL
               line has used the batch without logging it)
    trained  = the consumed ids that entered a gradient step with weight > 0 (the line's
               trained_ids); dropped = consumed and not trained (stale, a group of one)
    lost     = tasks with fewer than group_size rollout ids consumed (or, where the scenario asks,
               still queued in a work stream: a run that stops at its step count leaves the late
               members of its last groups durable in SCORED, for the next trainer)
    duplicates_trained = rollout ids that appear in more than one logged step
    rolled back = steps of a leader that died before the checkpoint recording them (trainer
               checkpoint_every > 1): a later epoch logs a version <= theirs, i.e. it resumed
               below them and trained their redelivered batches again; they are out of the
               line that survives, so out of the books (the trainer's weights never kept them)
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from asyncrl.nats_server import EmbeddedServer
from bus import BusConfig, connect
from bus import topology as topo
from bus.events import EventError, Rollout, Scored, Task, decode
from trainer import checkpoint

from .params import GROUP
from .streams import stream_messages


@dataclass
class Books:
    tasks: int
    lost: int
    duplicates_trained: int
    trained: int  # distinct rollout ids trained with weight > 0
    consumed: int = 0  # distinct rollout ids used up (trained or dropped)
    dropped: int = 0  # consumed, weight 0 (never moved the weights)
    queued: int = 0  # not consumed, still durable in TASKS / ROLLOUTS / SCORED

    def ok(self) -> bool:
        return self.lost == 0 and self.duplicates_trained == 0


def row(name: str, books: Books, recovery_s: float, passed: bool, **extra) -> dict:
    return {
        "name": name,
        "tasks": books.tasks,
        "lost": books.lost,
        "duplicates_trained": books.duplicates_trained,
        "trained": books.trained,
        "consumed": books.consumed,
        "dropped": books.dropped,
        "queued": books.queued,
        "recovery_s": round(recovery_s, 2),
        "passed": bool(passed and books.ok()),
        **extra,
    }


def all_step_lines(run_dir: Path) -> list[dict]:
    """Every step line of every trainer of the run (eval lines carry no batch), rolled back or not."""
    out = []
    for p in Path(run_dir).glob("trainer-*/metrics/trainer.jsonl"):
        out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return [d for d in out if "rollout_ids" in d]


def stepped_versions(trainer_dir: Path) -> set[int]:
    """The versions one trainer has written a step line for (its metrics JSONL, read now)."""
    p = Path(trainer_dir) / "metrics" / "trainer.jsonl"
    lines = p.read_text().splitlines() if p.exists() else []
    # a line being appended may be cut short: only whole JSON lines count
    out = set()
    for line in lines:
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if "rollout_ids" in d:
            out.add(d["version"])
    return out


def rolled_back(lines: list[dict]) -> list[dict]:
    """Lines a later epoch resumed below (it trained a version <= theirs): never checkpointed.
    A later line at version y resumed at y - 1 or lower when it trained (the step made y), at y
    or lower when it trained nothing (a batch of dropped samples keeps the version)."""
    floor: dict[int, int] = {}  # epoch -> lowest version a later epoch made or kept + 1
    for e in {d.get("epoch", 0) for d in lines}:
        later = [
            d["version"] + (0 if d.get("live_samples", 1) else 1) for d in lines if d.get("epoch", 0) > e
        ]
        if later:
            floor[e] = min(later)
    return [d for d in lines if d.get("epoch", 0) in floor and d["version"] >= floor[d.get("epoch", 0)]]


def step_lines(run_dir: Path) -> list[dict]:
    """The step lines of the line of versions that survived (rolled-back ones left out)."""
    lines = all_step_lines(run_dir)
    gone = {id(d) for d in rolled_back(lines)}
    return [d for d in lines if id(d) not in gone]


def trained_counts(run_dir: Path) -> Counter:
    """Rollout id -> steps that consumed it."""
    counts: Counter = Counter()
    for d in step_lines(run_dir):
        counts.update(d["rollout_ids"])
    return counts


def weighted_ids(run_dir: Path) -> set[str]:
    """Ids trained with weight > 0 (lines written before trained_ids existed: all of them)."""
    return {rid for d in step_lines(run_dir) for rid in d.get("trained_ids", d["rollout_ids"])}


def checkpoint_consumed(run_dir: Path) -> set[str]:
    """The consumed ids of the newest checkpoint in <run_dir>/ckpt (empty if none)."""
    st = checkpoint.load_latest(Path(run_dir) / "ckpt")
    return set(st.consumed) if st is not None else set()


def tally(
    run_dir: Path, task_ids: list[str], with_checkpoint: bool = False, queued: set[str] = frozenset()
) -> Books:
    counts = trained_counts(run_dir)
    consumed = set(counts) | (checkpoint_consumed(run_dir) if with_checkpoint else set())
    waiting = set(queued) - consumed
    per_task = Counter(rid.rsplit("-", 1)[0] for rid in consumed | waiting)
    lost = sum(1 for t in task_ids if per_task[t] < GROUP)
    mine = {f"{t}-{i}" for t in task_ids for i in range(GROUP)}  # padding tasks are not in the books
    trained = weighted_ids(run_dir) & mine
    return Books(
        tasks=len(task_ids),
        lost=lost,
        duplicates_trained=sum(c - 1 for c in counts.values() if c > 1),
        trained=len(trained),
        consumed=len(consumed & mine),
        dropped=len((consumed & mine) - trained),
        queued=len(waiting & mine),
    )


async def queued_ids(bus, group: int, dlq: bool = False) -> set[str]:
    """Rollout ids still durable in the work streams (a task there stands for its `group` rollouts;
    with `dlq`, parked ones count too)."""
    queued: set[str] = set()
    streams = (*topo.WORK_STREAMS.items(), *(((topo.DLQ, "rl.dlq.>"),) if dlq else ()))
    for stream, subjects in streams:
        for raw in await stream_messages(bus, stream, subjects):
            try:
                ev = decode(raw.data)
            except EventError:
                continue
            if isinstance(ev, Task):
                queued |= {f"{ev.task_id}-{i}" for i in range(group)}
            elif isinstance(ev, Rollout):
                queued.add(ev.rollout_id)
            elif isinstance(ev, Scored):
                queued.add(ev.rollout.get("rollout_id", ""))
    return queued


async def up_books(up_dir: Path, counts: Counter, group: int) -> Books:
    """The books of a finished `asyncrl up` run, from its own JetStream store: every rollout of
    every task the trainer fed (TASKS' last sequence) is trained, or still queued (its task in
    TASKS, or it in ROLLOUTS / SCORED: durable, not lost; the run stopped at its step count), or
    parked in DLQ; whatever is none of these is lost."""
    async with EmbeddedServer(store_dir=up_dir / "nats") as srv:
        bus = await connect(BusConfig(servers=[srv.url], name="chaos-books"))
        try:
            fed = int((await bus.js.stream_info(topo.TASKS)).state.last_seq)
            queued = await queued_ids(bus, group, dlq=True)
        finally:
            await bus.close()
    accounted = len(set(counts) | queued)
    return Books(
        tasks=fed,
        lost=max(0, fed * group - accounted),
        duplicates_trained=sum(c - 1 for c in counts.values() if c > 1),
        trained=len(counts),
        consumed=len(counts),
        dropped=0,
    )
