"""torch.distributed plumbing: rank 0 talks to the bus, the other ranks replay its commands."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .commands import broadcast_obj, world
from .fsdp import is_sharded
from .learner import Learner

__all__ = ["broadcast_obj", "follower_loop", "init_distributed", "sync_state", "world"]


def init_distributed() -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():  # NCCL: one GPU per rank, objects travel via that GPU
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")


def sync_state(model, opt) -> None:
    """After rank 0 changed its weights alone (an unsharded group): every rank gets its model and
    optimizer state. A sharded model is only ever changed by collectives: nothing to do."""
    if world()[1] == 1 or is_sharded(model):
        return
    for p in model.state_dict().values():
        dist.broadcast(p, src=0)
    opt.load_state_dict(broadcast_obj(opt.state_dict() if world()[0] == 0 else None))


async def follower_loop(learner: Learner) -> None:
    """Ranks > 0: do whatever rank 0 broadcasts until told to stop."""
    while True:
        cmd = broadcast_obj()
        if cmd[0] == "stop":
            learner.wait_checkpoint()  # a background shard save of ours finishes before we leave
            return
        if cmd[0] == "sync":
            sync_state(learner.model, learner.opt)
        elif cmd[0] == "step":
            learner.step(cmd[1])
        elif cmd[0] == "call":  # a collective method rank 0 announced (commands.announce)
            getattr(learner, cmd[1])(*cmd[2])


def shutdown_distributed() -> None:
    """Leave the group together: a rank exiting while a peer's gloo pair is still open can abort
    (`terminate called without an active exception`)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
