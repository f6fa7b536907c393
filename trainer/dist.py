"""torch.distributed plumbing: rank 0 talks to the bus, the other ranks run its collectives
(trainer/commands.py) in `follower_loop` until it sends `Stop`."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from .commands import Collective, broadcast_obj, collective, follow, world
from .fsdp import is_sharded
from .learner import Learner

__all__ = [
    "broadcast_obj",
    "end_rank_process",
    "follower_loop",
    "init_distributed",
    "stop_followers",
    "sync_state",
    "world",
]


def init_distributed() -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():  # NCCL: one GPU per rank, objects travel via that GPU
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")


def sync_state(learner: Learner) -> None:
    """After rank 0 changed its weights alone (an unsharded group): every rank gets its model and
    optimizer state. A sharded model is only ever changed by collectives: nothing to do."""
    collective(Sync(), learner)


def stop_followers(learner: Learner) -> None:
    """Rank 0: the other ranks leave `follower_loop` (each first waits for its background save)."""
    collective(Stop(), learner)


@dataclass(frozen=True)
class Sync(Collective[None], on=Learner):
    """Rank 0's model and optimizer state to every rank (nothing when sharded or alone)."""

    def run(self, learner: Learner) -> None:
        model, opt = learner.model, learner.opt
        if world()[1] == 1 or is_sharded(model):
            return
        for p in model.state_dict().values():
            dist.broadcast(p, src=0)
        opt.load_state_dict(broadcast_obj(opt.state_dict() if world()[0] == 0 else None))


@dataclass(frozen=True)
class Stop(Collective[None], on=Learner, last=True):
    """The followers' last command: a background shard save of theirs finishes before they leave
    (on rank 0 nothing is pending by then: the leader waits before naming every save)."""

    def run(self, learner: Learner) -> None:
        learner.checkpoint.wait()


async def follower_loop(learner: Learner) -> None:
    """Ranks > 0: run whatever rank 0 sends until told to stop."""
    follow([learner, learner.checkpoint, learner.publication])


def shutdown_distributed() -> None:
    """Leave the group together: a rank exiting while a peer's gloo pair is still open can abort
    (`terminate called without an active exception`)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def end_rank_process(code: int) -> NoReturn:
    """End a rank's process after it left the group: flush, then exit without interpreter teardown.

    Why: a gloo worker thread drops a finished work item (and with it the last reference to the
    tensors Python made for the final broadcasts) a moment after the collective completes. When
    that moment falls after the main thread began finalizing, the thread's request for the GIL
    makes CPython end it with pthread_exit, whose forced unwind through the work's noexcept C++
    destructor calls std::terminate ("terminate called without an active exception", SIGABRT;
    seen in ~1 of 10 two-rank runs on a loaded 2-core box). Nothing is left to finalize: checkpoint
    writes were awaited before the group was left, metrics rows are appended and closed one by one.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
