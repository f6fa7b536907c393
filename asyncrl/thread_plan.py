"""How many intra-op threads each process of `asyncrl up` gets (all on one machine).

    plan(conf, workers, scorers, cpus=None) -> ThreadPlan    raises ConfigError on a bad `threads`

A section's `threads` key ([trainer.run], [worker.run], [scorer.run]) is used as given; it must be an integer
>= 1. Without one: each worker 1, each scorer 1, and the trainer the cores the workers leave (at
least 1). The trainer is the serial part of async RL (every version waits for its step) while the
workers run niced in parallel; the scorers idle between verdicts (their sandboxed verifiers are
separate processes), so they are not counted; a trainer group ([layout]) splits the trainer's
share between its ranks. Standby trainers get the leader's count (only the
lease holder steps). `up` writes the count into each child's config (the trainer and the torch
engine call torch.set_num_threads with it) and its environment (OMP_NUM_THREADS, and
ASYNCRL_DELTA_THREADS unless `up`'s own environment sets that): see asyncrl.supervisor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from asyncrl import child_conf
from kernel.config import ConfigError

SECTIONS = ("trainer", "worker", "scorer")


@dataclass(frozen=True)
class ThreadPlan:
    trainer: int
    worker: int
    scorer: int
    cpus: int
    configured: tuple[str, ...]  # the sections whose `threads` key set their count

    def line(self, workers: int, scorers: int, trainers: int = 1) -> str:
        """One line for `asyncrl config check` and the log."""
        src = lambda s: "set" if s in self.configured else "default"  # noqa: E731
        standby = f" (+{trainers - 1} standby)" if trainers > 1 else ""
        return (
            f"threads per process under `asyncrl up` ({self.cpus} cores): "
            f"trainer {self.trainer}{standby} [{src('trainer')}], "
            f"worker {self.worker} x {workers} [{src('worker')}], "
            f"scorer {self.scorer} x {scorers} [{src('scorer')}]"
        )


def available_cpus() -> int:
    """The cores this process may run on (an affinity mask or cpuset counts, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def configured(conf: dict) -> dict[str, int]:
    """{section: threads} for the sections that set `threads`; a bad value raises ConfigError."""
    out = {}
    for s in SECTIONS:
        table = child_conf.process_table(s, conf.get(s) or {}) if isinstance(conf.get(s) or {}, dict) else {}
        if "threads" not in table:
            continue
        v = table["threads"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(
                f"[{child_conf.where(s)}] threads = {v!r}: must be an integer >= 1 (intra-op "
                f"threads of each {s} process; leave it out for the default)"
            )
        out[s] = v
    return out


def plan(conf: dict, workers: int, scorers: int, cpus: int | None = None, ranks: int = 1) -> ThreadPlan:
    """`ranks`: the trainer group's processes ([layout] trainer_devices); each gets its share of
    the cores the workers leave."""
    cpus = cpus or available_cpus()
    given = configured(conf)
    worker = given.get("worker", 1)
    scorer = given.get("scorer", 1)
    trainer = given.get("trainer", max(1, (cpus - workers * worker) // max(1, ranks)))
    return ThreadPlan(trainer, worker, scorer, cpus, tuple(s for s in SECTIONS if s in given))
