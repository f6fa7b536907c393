"""Signature check of a parsed Delta/Keyframe or of a raw blob of either kind."""

from __future__ import annotations

from .container import KIND_DELTA, blob_kind
from .delta import Delta
from .keyframe import Keyframe


def verify_signature(blob_or_obj, public_key) -> None:
    """Verify a Delta/Keyframe or raw blob against the trainer's public key (raises DeltaError)."""
    if isinstance(blob_or_obj, (bytes, bytearray, memoryview)):
        mv = memoryview(blob_or_obj).cast("B")
        blob_or_obj = (Delta if blob_kind(mv) == KIND_DELTA else Keyframe).from_bytes(mv)
    blob_or_obj.verify_signature(public_key)
