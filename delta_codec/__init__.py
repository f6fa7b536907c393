"""delta_codec: lossless sparse weight deltas and keyframes (pure: no I/O, no NATS).

    d = encode_delta(base, new, from_version=v - 1, to_version=v)
    blob = d.to_bytes(signing_key=sk); d = Delta.from_bytes(blob)
    apply_delta(state, d, public_key=pk)      # in place, digest-checked, all-or-nothing

Modules: bits (raw-bit views, digests), codec (one chunk's record) with modes (its codings and
thresholds), values, positions (gaps, Rice, bitmaps), classed (positions by base magnitude, with
context / context_jit), sparse_jit (compiled per-change decoding) and compress (zstd); container
(the binary format), record (a tensor's record framing), tasks (the thread pool), delta / encode /
apply, keyframe, verify (signatures of either kind), signing (ed25519), triton_apply (device
tensors).
"""

from .apply import apply_delta
from .bits import state_digest
from .container import CODEC
from .delta import Delta, DeltaStats
from .encode import encode_delta
from .errors import DeltaError
from .keyframe import Keyframe, load_keyframe, make_keyframe
from .verify import verify_signature


def warm() -> None:
    """Compile, or load from numba's cache, every compiled kernel now: a process that applies
    deltas calls this at start, so its first delta does not pay it (~0.5 s here, more on a
    first run) between two decode steps."""
    from . import context_jit, sparse_jit

    sparse_jit.warm()
    context_jit.warm()


__all__ = [
    "CODEC",
    "Delta",
    "DeltaError",
    "DeltaStats",
    "Keyframe",
    "apply_delta",
    "encode_delta",
    "load_keyframe",
    "make_keyframe",
    "state_digest",
    "verify_signature",
    "warm",
]
