"""delta_codec: lossless sparse weight deltas and keyframes (pure: no I/O, no NATS).

    d = encode_delta(base, new, from_version=v - 1, to_version=v)
    blob = d.to_bytes(signing_key=sk); d = Delta.from_bytes(blob)
    apply_delta(state, d, public_key=pk)      # in place, digest-checked, all-or-nothing
"""
from .bits import state_digest
from .container import (CODEC, Delta, DeltaStats, Keyframe, apply_delta, encode_delta, load_keyframe,
                        make_keyframe, verify_signature)
from .errors import DeltaError

__all__ = ["CODEC", "Delta", "DeltaError", "DeltaStats", "Keyframe", "apply_delta", "encode_delta",
           "load_keyframe", "make_keyframe", "state_digest", "verify_signature"]
