"""The codec's thread pool: jobs (and the follow-up jobs they return) on a few threads, each
with a borrowed per-worker Scratch; first error stops new jobs and is re-raised."""

from __future__ import annotations

import collections
import functools
import os
import threading
from contextlib import contextmanager

from .bits import Scratch, fresh


def default_threads() -> int:
    """All cores (at most 8); ASYNCRL_DELTA_THREADS overrides. The codec runs while its caller
    waits for it (the trainer awaits the encode before publishing, an engine applies between two
    decode steps), so those cores would otherwise idle (thread gains: docs/benchmarks.md)."""
    env = os.environ.get("ASYNCRL_DELTA_THREADS")
    if env:
        return max(1, int(env))
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


_scratch_pool: list[Scratch] = []  # one per worker at a time, kept between calls (no page faults)
_scratch_lock = threading.Lock()
_worker = threading.local()


@contextmanager
def _scratch_borrowed():
    with _scratch_lock:
        s = _scratch_pool.pop() if _scratch_pool else Scratch()
    _worker.scratch = s
    try:
        yield s
    finally:
        _worker.scratch = None
        with _scratch_lock:
            _scratch_pool.append(s)


def scratch():
    """This worker's Scratch (inside run_tasks), else fresh allocation."""
    return getattr(_worker, "scratch", None) or fresh


def run_tasks(jobs: list, threads: int | None) -> None:
    """Run zero-argument jobs on `threads` threads, the caller's included, each with a borrowed
    Scratch (numpy, zstd, xxhash and the torch ops used release the GIL); a job may return
    follow-up jobs, which run next (depth first: a tensor's chunks right after its base
    check, while its bits are still in cache). After the first error no new job starts; returns
    once every started job has finished, then re-raises that error."""
    threads = default_threads() if threads is None else threads
    todo = collections.deque(jobs)
    cond = threading.Condition()
    state = {"running": 0, "error": None}

    def work() -> None:
        with _scratch_borrowed():
            while True:
                with cond:
                    while not todo and state["running"] and state["error"] is None:
                        cond.wait()
                    if not todo or state["error"] is not None:
                        cond.notify_all()
                        return
                    job = todo.popleft()
                    state["running"] += 1
                more, error = None, None
                try:
                    more = job()
                except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
                    error = e
                with cond:
                    state["running"] -= 1
                    if error is not None and state["error"] is None:
                        state["error"] = error
                    if more:
                        todo.extendleft(reversed(more))
                    cond.notify_all()

    helpers = [threading.Thread(target=work, daemon=True) for _ in range(max(threads, 1) - 1)]
    for h in helpers:
        h.start()
    try:
        work()
    finally:
        for h in helpers:
            h.join()
    if state["error"] is not None:
        raise state["error"]


def parallel(fn, items, threads: int | None) -> list:
    """[fn(x) for x in items] on `threads` threads (see run_tasks)."""
    results: list = [None] * len(items)

    def job(i: int) -> None:
        results[i] = fn(items[i])

    run_tasks([functools.partial(job, i) for i in range(len(items))], threads)
    return results
