"""torch FSDP2 for the trainer: one `fully_shard` per transformer block plus the root (embedding,
final norm, head: a tied head lives with its embedding), on a 1-d device mesh over the group.

gloo on CPU in fp32; NCCL on GPU with bf16 parameters for compute and fp32 gradient reduction.
Activation checkpointing recomputes each block's activations in backward (memory for time);
it replaces the block's `forward` on the instance, so parameter names do not change."""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from .commands import world


def is_sharded(model) -> bool:
    return isinstance(model, FSDPModule)


def checkpoint_blocks(model) -> None:
    """Recompute block activations in backward (training only; cached decoding is untouched)."""
    for blk in model.layers:
        inner = blk.forward

        def fwd(x, cos, sin, pos, cache=None, layer=0, slots=None, mask=None, *, _inner=inner):
            if cache is None and torch.is_grad_enabled():
                return checkpoint(_inner, x, cos, sin, pos, cache, layer, slots, mask, use_reentrant=False)
            return _inner(x, cos, sin, pos, cache, layer, slots, mask)

        blk.forward = functools.wraps(inner)(fwd)


def shard(model, device: torch.device, mixed_precision: bool | None = None):
    """Shard `model` in place over all ranks (every rank must hold the same initial weights)."""
    _, ws = world()
    mesh = init_device_mesh(device.type, (ws,))
    if mixed_precision is None:
        mixed_precision = device.type == "cuda"
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    for blk in model.layers:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter: a collective for a DTensor."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p
