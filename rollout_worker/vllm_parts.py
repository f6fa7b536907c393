"""Versions published from shards on the vLLM engine: both halves of `VLLMEngine.apply_parts`.

A sharded version (delta_codec/sharded.py) is N parts, each the delta of a row range of every
tensor (`name@r0:r1`), plus a manifest. The client (rollout worker process) verifies and applies
the parts to its bf16 shadow first, all-or-nothing: a refused version never pauses vLLM. Then
the parts' compressed bytes, not decoded tensors, cross vLLM's RPC with the manifest
(`payload`), and vLLM's worker applies every part to its own tensors (`apply_in_worker`: the
row ranges of its bf16 copy, or of the live device parameters on the in-place GPU path), again
all-or-nothing, before it reloads the touched layers. Whatever fails once vLLM is paused is a
failed push (vllm_engine.py `_push`): paused at version -1 until a keyframe loads.

This module imports nothing from vLLM, so both processes can import it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import delta_codec
from delta_codec.sharded import PART_NAME, Manifest, apply_parts, check_parts


def part_deltas(parts: dict[int, bytes]) -> list[delta_codec.Delta]:
    return [delta_codec.Delta.from_bytes(parts[i]) for i in sorted(parts)]


def changed_names(parts: dict[int, bytes]) -> list[str]:
    """Tensor names (without the row range) that some part changes."""
    return sorted(
        {
            PART_NAME.match(n)[1]
            for d in part_deltas(parts)
            for n, st in d.stats.per_tensor.items()
            if st["changed"] and PART_NAME.match(n)
        }
    )


def apply_to_shadow(
    state: dict[str, torch.Tensor], manifest: Manifest, parts: dict[int, bytes]
) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Client side: the whole version onto the shadow (manifest digests, row tiling of every
    tensor, base digests; raises with the shadow unchanged). -> (changed names, their old values)."""
    deltas = check_parts(state, manifest, parts)  # the manifest first: a clear error for a bad part
    changed = sorted(
        {PART_NAME.match(n)[1] for d in deltas for n, st in d.stats.per_tensor.items() if st["changed"]}
    )
    backup = {n: state[n].clone() for n in changed}
    apply_parts(state, manifest, parts, finite=True)  # a NaN/±inf result: refused, nothing pushed
    return changed, backup


def payload(manifest: Manifest, parts: dict[int, bytes]) -> dict:
    """The update_info of one push: compressed parts and the (unsigned: verified by the client)
    manifest. A list of pairs: vLLM's RPC encoder carries bytes, and int keys are not portable."""
    return {"manifest": manifest.to_bytes(), "parts": [[int(i), bytes(parts[i])] for i in sorted(parts)]}


def payload_bytes(info: dict) -> int:
    """Bytes an update_info carries over the RPC (delta, parts, or whole tensors)."""
    if info.get("delta") is not None:
        return len(info["delta"])
    if info.get("parts") is not None:
        return len(info["manifest"]) + sum(len(b) for _, b in info["parts"])
    return sum(len(r[3]) for r in info.get("tensors", []))


def apply_in_worker(
    manifest_bytes: bytes, parts: list, tensors: dict[str, torch.Tensor], to_hf: Callable[[str], str]
) -> list[str]:
    """vLLM's worker side: every part onto `tensors` (HF name -> the tensor to write: the bf16
    copy or a live device view), all-or-nothing; parts re-checked against the manifest and their
    rows against every tensor they name. -> the changed publisher names (the layers to reload)."""
    manifest = Manifest.from_bytes(manifest_bytes)
    blobs = {int(i): bytes(b) for i, b in parts}
    if len(blobs) != len(parts):
        raise ValueError("a part index appears twice in the push")
    names = sorted(
        {PART_NAME.match(r.name)[1] for d in part_deltas(blobs) for r in d.records if PART_NAME.match(r.name)}
    )
    absent = [n for n in names if to_hf(n) not in tensors]
    if absent:
        raise ValueError(f"part tensors not in the vLLM model: {absent[:5]}")
    # the client checked the tiling over the whole state; here over every tensor the parts name
    apply_parts({n: tensors[to_hf(n)] for n in names}, manifest, blobs)
    return changed_names(blobs)
