"""Keyframe: a full state in the same container as deltas; make_keyframe and load_keyframe."""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from .apply import validate_target
from .bits import (
    SIGNED_INT,
    UNSIGNED_INT,
    combine_digest,
    dtype_from_name,
    int_view,
    np_bits,
    planes,
    tensor_digest,
)
from .compress import zc, zd
from .container import KIND_KEYFRAME, SignedBlob, extra_fields, pack_blob, unpack_blob, with_extra
from .encode import bits_slice, chunked_records, prepared
from .errors import DeltaError, NonFiniteError
from .finite import first_nonfinite
from .modes import CHUNK
from .record import TensorRecord, chunks_of, hollow
from .tasks import parallel, scratch


class Keyframe(SignedBlob):
    """A full state, checksummed per tensor, in the same container as deltas."""

    def __init__(self, version: int, records: list[TensorRecord], extra: dict | None = None):
        self.version, self.records = int(version), records
        self.extra = extra_fields(extra)  # caller's header fields: checksummed and signed with the blob

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.records]

    @property
    def digest(self) -> str:
        return combine_digest((r.name, r.dtype, r.shape, r.digest_a) for r in self.records)

    def to_bytes(self, signing_key=None) -> bytes:
        return pack_blob(
            KIND_KEYFRAME, with_extra({"version": self.version}, self.extra), self.records, signing_key
        )

    @classmethod
    def from_bytes(cls, blob) -> Keyframe:
        meta, recs, region, sig = unpack_blob(blob, KIND_KEYFRAME)
        try:
            kf = cls(meta["version"], recs, meta.get("extra"))
        except (KeyError, TypeError, ValueError):
            raise DeltaError("keyframe header lacks version") from None
        kf.signature, kf._signed_region = sig, region
        return kf

    def __repr__(self) -> str:
        return f"Keyframe(v{self.version}, {len(self.records)} tensors)"


def make_keyframe(state, version: int, *, chunk: int = CHUNK, threads: int | None = None) -> Keyframe:
    """A keyframe of `state`, built chunk by chunk on `threads` threads: each chunk's byte planes
    zstd'd on their own (no whole-tensor temporaries; device tensors are copied to the host a
    chunk at a time). Chunk records: [count, zstd(planes)]."""
    if chunk <= 0 or chunk % 8:
        raise DeltaError(f"chunk must be a positive multiple of 8, got {chunk}")
    tensors = {n: (prepared(t),) for n, t in state.items()}

    def digests(one):
        dig = tensor_digest(one[0])
        return dig, dig

    def encode(one, s):
        b = bits_slice(one[0], s, chunk)
        return hollow([b.size, zc(planes(b, scratch()))]), 0

    return Keyframe(version, chunked_records(tensors, chunk, threads, digests, encode))


def _keyframe_chunks(r: TensorRecord):
    """-> [(start, count, frame)] of a keyframe record, coverage checked."""
    out, start = [], 0
    for i, c in enumerate(chunks_of(r, 2)):
        try:
            count, frame = int(c[0]), c[1]
        except (TypeError, ValueError, IndexError):
            raise DeltaError(f"tensor {r.name!r} chunk {i}: malformed keyframe chunk") from None
        if count < 0:
            raise DeltaError(f"tensor {r.name!r} chunk {i}: malformed keyframe chunk")
        out.append((start, count, frame))
        start += count
    if start != r.numel:
        raise DeltaError(f"tensor {r.name!r}: chunks cover {start} elements, tensor has {r.numel}")
    return out


def _keyframe_chunk_into(dest: np.ndarray, frame, what: str, alloc) -> None:
    """Decode one keyframe chunk (byte planes) straight into `dest` (signed-int bits)."""
    n, size = dest.size, dest.itemsize
    raw = np.frombuffer(zd(frame, n * size, what), np.uint8)
    u = dest.view(UNSIGNED_INT[size])
    u[...] = raw[:n]
    for i in range(1, size):
        t = alloc("kf.plane", n, u.dtype)
        t[...] = raw[i * n : (i + 1) * n]
        t <<= 8 * i
        u |= t


def load_keyframe(
    kf, *, into=None, public_key=None, device=None, threads: int | None = None, finite: bool = False
) -> dict[str, torch.Tensor]:
    """-> {name: tensor} with every tensor digest-checked, decoded chunk by chunk straight into
    the result (on `threads` threads). With `into`, writes into those tensors in place and
    returns `into`: names, shapes and dtypes are validated, then every tensor is decoded once
    into a chunk-sized buffer against its digest, and only then written (so a bad keyframe
    leaves `into` unchanged, and no second copy of the state is ever held). `finite`: refuse
    (NonFiniteError) a keyframe with a NaN or ±inf element, checked on each decoded chunk."""
    if isinstance(kf, (bytes, bytearray, memoryview)):
        kf = Keyframe.from_bytes(kf)
    if public_key is not None:
        kf.verify_signature(public_key)
    if into is not None:
        validate_target(into, kf.records, "keyframe")
    recs = sorted(kf.records, key=lambda r: -r.numel)  # biggest first: balanced threads

    def mismatch(r: TensorRecord) -> DeltaError:
        return DeltaError(f"tensor {r.name!r}: keyframe digest mismatch (corrupted keyframe)")

    def check_finite(r: TensorRecord, start: int, bits: np.ndarray) -> None:
        if finite and (j := first_nonfinite(bits, r.dtype)) >= 0:
            raise NonFiniteError(f"tensor {r.name!r}: keyframe element {start + j} is NaN or ±inf")

    def verify(r: TensorRecord) -> None:  # decode without keeping: streaming digest
        size, alloc = dtype_from_name(r.dtype).itemsize, scratch()
        h = xxhash.xxh3_128()
        for i, (start, count, frame) in enumerate(_keyframe_chunks(r)):
            buf = alloc("kf.chunk", count, SIGNED_INT[size])
            _keyframe_chunk_into(buf, frame, f"tensor {r.name!r} chunk {i}", alloc)
            check_finite(r, start, buf)
            h.update(buf)
        if h.digest() != r.digest_a:
            raise mismatch(r)

    def decode(r: TensorRecord) -> torch.Tensor:
        target = into[r.name] if into is not None else torch.empty(r.shape, dtype=dtype_from_name(r.dtype))
        on_host = target.device.type == "cpu"
        bits = np_bits(target) if on_host else None
        alloc = scratch()
        for i, (start, count, frame) in enumerate(_keyframe_chunks(r)):
            what = f"tensor {r.name!r} chunk {i}"
            if on_host:
                _keyframe_chunk_into(bits[start : start + count], frame, what, alloc)
                if into is None:  # (into: every chunk was checked before anything was written)
                    check_finite(r, start, bits[start : start + count])
            else:
                buf = np.empty(count, SIGNED_INT[target.element_size()])
                _keyframe_chunk_into(buf, frame, what, alloc)
                if into is None:
                    check_finite(r, start, buf)
                with torch.no_grad():
                    int_view(target)[start : start + count].copy_(
                        torch.from_numpy(buf).view(int_view(target).dtype)
                    )
        if tensor_digest(target) != r.digest_a:
            raise mismatch(r)
        return target if device is None or into is not None else target.to(device)

    if into is not None:
        parallel(verify, recs, threads)
    out = dict(zip((r.name for r in recs), parallel(decode, recs, threads)))
    return into if into is not None else {r.name: out[r.name] for r in kf.records}
