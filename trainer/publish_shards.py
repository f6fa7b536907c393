"""Publication from shards: each rank encodes the bf16 delta of the parameter rows it owns.

With FSDP2 every parameter is a DTensor sharded on dim 0; a rank's local tensor is rows
[r0, r1) of the full parameter (delta_codec.sharded.shard_rows). Its part of version v is the
delta of those rows from the rows it published at v-1 (Learner.publish_parts); rank 0 collects the
parts' bytes (small: compressed deltas, not weights), and the leader publishes them as one
`ShardedVersion` (trainer/encoders.py, bus/weights/manifest.py) with one signed manifest."""

from __future__ import annotations

import torch

from delta_codec.sharded import encode_part, shard_rows

from .commands import world


def local_rows(model) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    """This rank's bf16 rows of every parameter, and their row ranges in the full tensors."""
    rank, ws = world()
    rows, ranges = {}, {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            full_rows = p.shape[0]
            r0, r1 = shard_rows(full_rows, rank, ws) if hasattr(p, "to_local") else (0, full_rows)
            if local.shape[0] != r1 - r0:
                raise RuntimeError(
                    f"parameter {n}: local shard has {local.shape[0]} rows, expected {r1 - r0}"
                )
            rows[n], ranges[n] = local.detach().to(torch.bfloat16).cpu().contiguous(), (r0, r1)
    return rows, ranges


def encode_local_part(
    model, base_rows: dict[str, torch.Tensor], from_version: int, to_version: int, context: bool = False
) -> tuple[bytes, dict[str, torch.Tensor]]:
    """This rank's part (unsigned: the manifest carries the signature) against its previous rows;
    -> (part bytes, the new rows: the next part's base)."""
    rows, ranges = local_rows(model)
    blob = encode_part(
        base_rows, rows, ranges, from_version=from_version, to_version=to_version, context=context
    ).to_bytes()
    return blob, rows
