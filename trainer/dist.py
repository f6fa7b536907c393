"""torch.distributed plumbing: rank 0 talks to the bus, the other ranks replay its commands."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .learner import Learner, world


def init_distributed() -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():          # NCCL: one GPU per rank, objects travel via that GPU
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")


def broadcast_obj(obj=None):
    """Rank 0's object to every rank (identity with one process)."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sync_state(model, opt) -> None:
    """After rank 0 loaded a checkpoint: every rank gets its model and optimizer state."""
    if world()[1] == 1:
        return
    for p in model.state_dict().values():
        dist.broadcast(p, src=0)
    opt.load_state_dict(broadcast_obj(opt.state_dict() if world()[0] == 0 else None))


async def follower_loop(learner: Learner) -> None:
    """Ranks > 0: do whatever rank 0 broadcasts until told to stop."""
    while True:
        cmd = broadcast_obj()
        if cmd[0] == "stop":
            return
        if cmd[0] == "sync":
            sync_state(learner.model, learner.opt)
        elif cmd[0] == "step":
            learner.step(cmd[1])
