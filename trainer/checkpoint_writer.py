"""Background trainer checkpoints: one writer thread, at most one write in flight.

The leader hands over a CPU snapshot (trainer/checkpoint.py `snapshot`: nothing the next step
mutates) and publishes the version at once; the batches the snapshot records are acked only once
`save` returned, i.e. the file is fsync'd and renamed (trainer/leader.py `_ack_when_durable`).

A version that comes due while a write is still running is not queued: it is published
uncheckpointed, exactly as between two checkpoints of `[trainer.checkpoint] every = K`, and the next
write (whose snapshot records its rollout ids too) acks its batch. Waiting instead would put the
write back on the critical path whenever it is slower than a step (a 1.6 GB file on a loaded disk
is), and queueing would hold a second GB-sized snapshot only to write a state the next one
supersedes. The cost: a crash re-trains the versions since the last durable write (about
write time / step time of them), as with `every`.

Fencing: a write is committed (renamed) only while `commit_if()` (the leader's lease) holds; a
deposed leader whose write is past that check when a new leader takes over still cannot win:
its file carries the old epoch, and resume takes the highest epoch first (trainer/checkpoint.py),
so it never shadows the new leader's line. Its batches are not acked by it either (the leader acks
only while it still leads); they come back and the new leader's consumed ids decide.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from kernel import get_logger

from . import checkpoint

log = get_logger(__name__)


def _lowest_priority() -> None:
    """The writer thread runs at nice 19: its CPU (serialising GBs into the page cache) is taken
    from whatever else is runnable, and on a small machine that is the rollout workers (nice 10 under
    `up`), which the trainer waits on. A write that yields to them finishes later, which costs nothing:
    the next version only finds the writer busy and goes out uncheckpointed (see above)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not permitted: the default priority
        pass


class CheckpointWriter:
    def __init__(self, ckpt_dir: str | Path, keep: int, before_write=None, delay_s: float = 0.0):
        self.ckpt_dir, self.keep, self.delay_s = ckpt_dir, keep, delay_s
        self.before_write = before_write  # e.g. CheckpointState.wait: shards complete before named
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="checkpoint-writer", initializer=_lowest_priority
        )
        self._inflight: Future | None = None
        self._claimed = False  # a snapshot is taken for a write not yet submitted
        self.writes, self.write_total_s, self.write_cpu_total_s = 0, 0.0, 0.0
        self.last_write_s: float | None = None
        self.last_written_version: int | None = None

    def idle(self) -> bool:
        """No write in flight or promised: a version due now is snapshotted and written."""
        return not self._claimed and (self._inflight is None or self._inflight.done())

    def claim(self) -> None:
        """The next submit is this version's (between its snapshot and its publication the writer
        counts as busy, so the version after it does not take a second snapshot)."""
        self._claimed = True

    def release(self) -> None:
        """A claimed write that will not be submitted (the publication failed first)."""
        self._claimed = False

    def submit(self, st: checkpoint.TrainerState, commit_if=None) -> Future:
        """Write `st` in the background; the future's result is the file, once durable. Never two in
        flight: a submit while one runs waits for it (the leader claims first, so it does not)."""
        self.wait_quietly()
        self._claimed = False
        self._inflight = self._pool.submit(self._write, st, commit_if)
        return self._inflight

    def _write(self, st: checkpoint.TrainerState, commit_if) -> Path:
        t0, c0 = time.perf_counter(), time.thread_time()
        if self.delay_s:  # fault injection (tests): a write slower than a step
            time.sleep(self.delay_s)
        if self.before_write is not None:
            self.before_write()
        path = checkpoint.save(self.ckpt_dir, st, keep=self.keep, commit_if=commit_if)
        self.last_write_s = time.perf_counter() - t0
        self.write_total_s += self.last_write_s
        self.write_cpu_total_s += time.thread_time() - c0
        self.writes += 1
        self.last_written_version = st.version
        return path

    def wait(self) -> None:
        """Block until the write in flight is durable; raises its error."""
        f = self._inflight
        if f is not None:
            f.result()

    def wait_quietly(self) -> None:
        """Block until the write in flight ended, whatever its outcome (its owner saw the error)."""
        f = self._inflight
        if f is not None:
            try:
                f.result()
            except Exception:
                pass

    def close(self) -> None:
        """The write in flight finishes (a clean stop loses nothing durable); the thread ends."""
        self.wait_quietly()
        self._pool.shutdown(wait=True)
