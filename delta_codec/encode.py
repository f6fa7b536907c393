"""encode_delta: base and new state -> Delta, chunk by chunk on the thread pool."""

from __future__ import annotations

import numpy as np
import torch

from .bits import SIGNED_INT, dtype_name, exponent_shift, int_view, tensor_digest
from .codec import encode_chunk
from .delta import Delta
from .errors import DeltaError
from .modes import CHUNK
from .record import TensorRecord, hollow, record_parts
from .tasks import parallel, scratch


def _check_pair(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != b.dtype or a.shape != b.shape:
        raise DeltaError(
            f"tensor {name!r}: base is {a.dtype}{list(a.shape)}, new is {b.dtype}{list(b.shape)}"
        )


def encode_delta(
    base,
    new,
    *,
    from_version: int = 0,
    to_version: int | None = None,
    chunk: int = CHUNK,
    threads: int | None = None,
    context: bool = False,
) -> Delta:
    """Encode new - base chunk by chunk (`chunk` elements, a multiple of 8: the granularity of
    the position-coding choice and of the thread pool). Device tensors are copied to the host a
    chunk at a time. context=True lets sparse float chunks code their positions in the context of
    the base (CLASSED: smaller, but its class pass and rank/select cost more CPU than the speed
    floors allow on both sides, see docs/benchmarks.md); the default, False, is format 2's chunk
    coding inside the current container. Either decodes with the same apply_delta."""
    if chunk <= 0 or chunk % 8:
        raise DeltaError(f"chunk must be a positive multiple of 8, got {chunk}")
    missing, extra = [n for n in base if n not in new], [n for n in new if n not in base]
    if missing or extra:
        raise DeltaError(
            f"base and new differ in tensor names: only in base {missing[:5]}, only in new {extra[:5]}"
        )
    for name, bt in base.items():
        _check_pair(name, bt, new[name])
    pairs = {n: (prepared(base[n]), prepared(new[n])) for n in base}

    def digests(pair):
        return tensor_digest(pair[0]), tensor_digest(pair[1])

    def encode(pair, s):
        bt, nt = pair
        rec, m = encode_chunk(
            bits_slice(bt, s, chunk), bits_slice(nt, s, chunk), exponent_shift(bt.dtype), scratch(), context
        )
        return hollow(rec), m

    records = chunked_records(pairs, chunk, threads, digests, encode)
    return Delta(from_version, from_version + 1 if to_version is None else to_version, records)


def chunked_records(tensors: dict, chunk: int, threads: int | None, digests, encode) -> list[TensorRecord]:
    """One TensorRecord per name. tensors: name -> tuple of prepared tensors (the first gives
    dtype and shape); digests(tuple) -> (digest_a, digest_b); encode(tuple, start) -> (packed
    chunk record, changed count). Digests and chunks run as separate jobs on the thread pool."""
    names = list(tensors)
    jobs = [(n, s) for n in names for s in [-1, *range(0, tensors[n][0].numel(), chunk)]]  # -1: digests

    def run(job):
        name, s = job
        return digests(tensors[name]) if s < 0 else encode(tensors[name], s)

    out = iter(parallel(run, jobs, threads))
    records = []
    for n in names:
        t = tensors[n][0]
        da, db = next(out)
        chunks = [next(out) for _ in range(0, t.numel(), chunk)]
        records.append(
            TensorRecord(
                n,
                dtype_name(t.dtype),
                tuple(t.shape),
                da,
                db,
                *record_parts([c for c, _ in chunks]),
                sum(m for _, m in chunks),
            )
        )
    return records


def prepared(t: torch.Tensor) -> torch.Tensor:
    """Detached; contiguous on the host (device tensors stay there, sliced per chunk)."""
    t = t.detach()
    return t.contiguous() if t.device.type == "cpu" else t


def bits_slice(t: torch.Tensor, start: int, n: int) -> np.ndarray:
    v = int_view(t if t.is_contiguous() else t.contiguous())[start : start + n]
    if v.device.type != "cpu":
        v = v.cpu()
    return v.numpy().view(SIGNED_INT[v.element_size()])
