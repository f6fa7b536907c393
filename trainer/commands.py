"""Rank bookkeeping and rank 0's command channel to the other ranks (a pickled object broadcast).

Only rank 0 talks to the bus; every collective the other ranks must join (a step, gathering the
published weights, a sharded checkpoint) is announced first, so all ranks issue the same
collectives in the same order."""

from __future__ import annotations

import torch.distributed as dist


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def broadcast_obj(obj=None):
    """Rank 0's object to every rank (identity with one process)."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def announce(method: str, *args) -> None:
    """On rank 0 of a group: tell the followers to call learner.<method>(*args) now."""
    rank, ws = world()
    if ws > 1 and rank == 0:
        broadcast_obj(("call", method, args))
