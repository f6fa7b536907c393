"""What `asyncrl up` starts: each child's table and its spec.

A child gets its table of the run config as the user wrote it (the tree `asyncrl config check`
built and checked), between two layers only the run knows: defaults the file may override (the
drain grace, the environments the run plays, the swe task set) and facts it may not (the broker's
address, the run's folder, each process's thread share, max_lag 0 in a sync run). The child builds
its typed config from that table itself (kernel.config), so a value means the same under `up` as
under systemd.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import reduce
from pathlib import Path

from asyncrl.model_refs import resolve as resolve_model_refs
from asyncrl.supervisor import ChildSpec
from asyncrl.thread_plan import ThreadPlan
from kernel.config import merge


@dataclass(frozen=True)
class RunFacts:
    run_dir: Path
    servers: list[str]
    weights_keep: int
    grace_s: float
    sync: bool
    threads: ThreadPlan
    endpoint_token_file: str | None = None  # the run's bearer token file, where up made one


def stack(*layers: dict) -> dict:
    """Tables merged key by key, the later layer winning (kernel.config.merge, layer on layer)."""
    return reduce(merge, layers, {})


def worker_episodes(tasks) -> dict:
    """The workers' [worker.episodes] defaults: the run's environments (where none runs code the
    sandbox check waits for the first episode) and, with env "swe", the trainer's task set
    (absolute: a child's working directory may differ; the workers start episodes only from it)."""
    out = {"envs": list(tasks.envs)}
    if "swe" in tasks.envs:
        out["task_set"] = os.path.abspath(tasks.swe.task_set)
    return out


def tables(conf: dict, resolved: dict, run: RunFacts) -> dict[str, dict]:
    """{"trainer" | "worker" | "scorer": the table that process is started with}."""
    bus = {"servers": run.servers, "topology": {"weights_keep": run.weights_keep}}
    drain = {"run": {"grace_s": run.grace_s}}  # each child drains within this unless its table says
    no_lag = {"max_lag": 0} if run.sync else None
    tasks = resolved["trainer"].tasks
    trainer = stack(
        {"trainer_id": "trainer"},  # fixed: the task feeder is seeded alike in every run (async vs sync)
        drain,
        resolve_model_refs(conf.get("trainer", {})),
        {
            "run": {
                "dir": str(run.run_dir),
                "mode": "sync" if run.sync else "async",
                "threads": run.threads.trainer,
            },
            "checkpoint": {"dir": str(run.run_dir / "checkpoints")},
        },
        {"batch": no_lag} if no_lag else {},
    )
    worker = stack(
        drain,
        {"episodes": worker_episodes(tasks)},
        resolve_model_refs(conf.get("worker", {})),
        {"run": {"threads": run.threads.worker}},
        {"harness": {"endpoint_token_file": run.endpoint_token_file}} if run.endpoint_token_file else {},
        {"admission": no_lag} if no_lag else {},
    )
    scorer = stack(
        drain,
        {"sandbox": {"envs": list(tasks.envs)}},
        conf.get("scorer", {}),
        {"run": {"threads": run.threads.scorer}},
    )
    # the bus table is the run's as a whole: every child provisions the same retention
    return {
        name: {**t, "bus": bus} for name, t in (("trainer", trainer), ("worker", worker), ("scorer", scorer))
    }


def specs(
    tables: dict, trainers: int, scorers: int, workers: int, threads: ThreadPlan, worker_nice: int
) -> list:
    """One ChildSpec per process: the leader and its standbys, the scorers, the workers (each its
    own id and sampling seed); a worker runs at `worker_nice`."""
    t, s, w = tables["trainer"], tables["scorer"], tables["worker"]
    out = [ChildSpec("trainer", "trainer", "trainer", t, threads=threads.trainer)]
    out += [
        ChildSpec(
            f"trainer-standby-{i}",
            "trainer",
            "trainer",
            {**t, "trainer_id": f"{t['trainer_id']}-standby-{i}"},
            threads=threads.trainer,
        )
        for i in range(1, trainers)
    ]
    out += [
        ChildSpec(
            f"scorer-{i}", "scorer", "scorer", {**s, "scorer_id": f"scorer-{i}"}, threads=threads.scorer
        )
        for i in range(scorers)
    ]
    out += [
        ChildSpec(
            f"worker-{i}",
            "rollout_worker",
            "rollout_worker",
            merge(w, {"worker_id": f"worker-{i}", "engine": {"seed": 1000 + i}}),
            nice=worker_nice,
            threads=threads.worker,
        )
        for i in range(workers)
    ]
    return out
