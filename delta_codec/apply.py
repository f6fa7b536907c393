"""apply_delta: in place, digest-checked, all-or-nothing (every written chunk is rolled back on
any error, a wrong result digest included). With `finite=True` (workers), a result element that
is NaN or ±inf is such an error too (NonFiniteError): checked on the elements each chunk wrote."""

from __future__ import annotations

import threading

import numpy as np
import torch

from . import sparse_jit
from .bits import (
    combine_digest,
    dtype_from_name,
    dtype_name,
    exponent_shift,
    int_view,
    np_bits,
    tensor_digest,
)
from .codec import chunk_header, decode_chunk
from .delta import Delta
from .errors import DeltaError, NonFiniteError
from .finite import checks, first_nonfinite, nonfinite
from .record import TensorRecord, chunk_starts, chunks_of
from .tasks import parallel, run_tasks, scratch


def decode_record(r: TensorRecord, t: torch.Tensor):
    """-> [(start, positions | None, signed differences, count, base bits at positions | None)]
    for the whole tensor, validated. t: the target tensor, still holding the base bits."""
    if t.device.type == "cpu":
        bits = np_bits(t)
        base_at = lambda start, pos: bits[start + pos] if start else bits[pos]
        base_all = lambda start, n: bits[start : start + n]
    else:  # (CLASSED chunks copy the chunk's base bits to the host: the class compares run there)
        bits = int_view(t)
        base_at = lambda start, pos: (
            bits[torch.from_numpy(start + pos).to(t.device)].cpu().numpy().view(f"i{bits.element_size()}")
        )
        base_all = lambda start, n: bits[start : start + n].cpu().numpy().view(f"i{bits.element_size()}")
    chunks = chunks_of(r)
    shift = exponent_shift(dtype_from_name(r.dtype))
    out = []
    for i, (c, start) in enumerate(zip(chunks, chunk_starts(r, chunks))):
        what = f"tensor {r.name!r} chunk {i}"
        n = chunk_header(c, what)[1]
        pos, d, count, old = decode_chunk(
            c,
            t.element_size(),
            what,
            lambda p, s=start: base_at(s, p),
            shift,
            base_all=lambda s=start, n=n: base_all(s, n),
        )
        out.append((start, pos, d, count, old))
    return out


def validate_target(state, recs: list[TensorRecord], what: str) -> None:
    names = {r.name for r in recs}
    missing, extra = [n for n in names if n not in state], [n for n in state if n not in names]
    if missing or extra:
        raise DeltaError(
            f"{what} and state differ in tensor names: missing in state {sorted(missing)[:5]}, "
            f"not in {what} {sorted(extra)[:5]}"
        )
    # tied weights (overlapping memory under two names): writing one would change the other.
    # Views into one flat buffer that do not overlap are fine.
    spans = sorted(
        (str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n)
        for n, t in ((r.name, state[r.name]) for r in recs)
        if t.numel()
    )
    for a, b in zip(spans, spans[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            raise DeltaError(
                f"tensors {a[3]!r} and {b[3]!r} overlap in memory (tied weights); "
                "give the state one name per tensor"
            )
    for r in recs:
        t = state[r.name]
        if dtype_name(t.dtype) != r.dtype or tuple(t.shape) != r.shape:
            raise DeltaError(
                f"tensor {r.name!r}: {what} is for {r.dtype}{list(r.shape)}, "
                f"state has {t.dtype}{list(t.shape)}"
            )
        if not t.is_contiguous():
            raise DeltaError(f"tensor {r.name!r}: in-place apply needs a contiguous tensor")


def apply_delta(
    state,
    delta,
    *,
    public_key=None,
    expect_from: int | None = None,
    threads: int | None = None,
    finite: bool = False,
) -> None:
    """Apply in place. Verifies the signature (if public_key); then applies every tensor's
    chunks and hashes each result tensor (tensors and chunks on `threads` threads), and compares
    the result's state digest, combined from those, with the delta's new digest. On any error
    (a malformed chunk, that digest) every chunk written so far is rolled back, so a refused
    delta leaves the state as it was; only then is the restored state hashed, to say whether it
    was the wrong base version or the delta that was bad. (The base is not hashed up front: a
    delta applied to its base, the only case that matters for speed, hashes the state once.)
    `finite`: refuse (NonFiniteError, rolled back) a result with a NaN or ±inf element, checked
    on the elements each chunk wrote (a signed delta can still carry NaN weights)."""
    if isinstance(delta, (bytes, bytearray, memoryview)):
        delta = Delta.from_bytes(delta)
    if public_key is not None:
        delta.verify_signature(public_key)
    if expect_from is not None and delta.from_version != expect_from:
        raise DeltaError(
            f"delta goes {delta.from_version}->{delta.to_version}, but the state is version {expect_from}"
        )
    validate_target(state, delta.records, "delta")
    recs = delta.records
    want_new, want_base = delta.new_digest, delta.base_digest  # (before anything is written)
    result: dict[str, bytes] = {}  # name -> result tensor digest (dict stores are atomic)

    def tensor(r: TensorRecord):
        """The tensor's chunks as jobs; the last one to finish queues its result digest."""
        t = state[r.name]
        if t.device.type != "cpu":
            _apply_job(r, t, -1, 0, None, undo, finite)
            return [lambda: hash_result(r)]
        chunks = chunks_of(r)
        left = [len(chunks)]
        lock = threading.Lock()

        def chunk_job(i: int, start: int, c):
            _apply_job(r, t, i, start, c, undo, finite)
            with lock:
                left[0] -= 1
                last = left[0] == 0
            return [lambda: hash_result(r)] if last else None

        jobs = [
            lambda i=i, s=s, c=c: chunk_job(i, s, c)
            for i, (c, s) in enumerate(zip(chunks, chunk_starts(r, chunks)))
        ]
        return jobs or [lambda: hash_result(r)]

    def hash_result(r: TensorRecord) -> None:
        result[r.name] = tensor_digest(state[r.name])

    undo: list = []  # (list.append is atomic; chunks are disjoint, so restore order is free)
    try:
        # biggest tensors first: the threads finish together
        run_tasks([lambda r=r: tensor(r) for r in sorted(recs, key=lambda r: -r.numel)], threads)
        if combine_digest((r.name, r.dtype, r.shape, result[r.name]) for r in recs) != want_new:
            raise DeltaError("result digest mismatch after apply (corrupted delta); state rolled back")
    except BaseException as e:
        with torch.no_grad():
            for restore in reversed(undo):
                restore()
        # a chunk that does not decode, or a wrong result, on the wrong base says nothing about
        # the delta: name the real cause
        if isinstance(e, Exception) and _state_root(state, recs, threads) != want_base:
            raise DeltaError(
                f"base digest mismatch: the state is not the delta's base version {delta.from_version} "
                "(state unchanged)"
            ) from None
        raise


def _state_root(state, recs: list[TensorRecord], threads: int | None) -> str:
    digs = parallel(lambda r: tensor_digest(state[r.name]), recs, threads)
    return combine_digest((r.name, r.dtype, r.shape, d) for r, d in zip(recs, digs))


def _apply_job(
    r: TensorRecord, t: torch.Tensor, i: int, start: int, chunk, undo: list, finite: bool = False
) -> None:
    finite = finite and checks(r.dtype)
    if i < 0:
        from .triton_apply import apply_on_device

        with torch.no_grad():  # (grad mode is per thread)
            apply_on_device(t, decode_record(r, t), undo)
            bits = int_view(t)
            bits = bits.view(torch.int8) if bits.dtype == torch.uint8 else bits  # (signed, as np_bits)
            if finite and bool(nonfinite(bits, r.dtype).any()):
                raise NonFiniteError(
                    f"tensor {r.name!r}: the update makes elements NaN or ±inf (state rolled back)"
                )
        return
    what, size = f"tensor {r.name!r} chunk {i}", t.element_size()
    view = np_bits(t)[start : start + chunk_header(chunk, what)[1]]
    pos, d, _, old = decode_chunk(
        chunk, size, what, lambda p: np.take(view, p), exponent_shift(t.dtype), scratch(), lambda: view
    )
    if pos is None:
        view += d  # dense: wraps at the element width
    elif old is not None:  # grouped (sparse) chunk: keep the old bits to restore
        if not sparse_jit.enabled:
            view[pos] = old + d
        elif (bad := sparse_jit.set_at(view, pos, old, d)) >= 0:
            raise DeltaError(f"{what}: position {int(pos[bad])} beyond the chunk of {view.size}")
        pos = pos.copy()  # (may live in the scratch buffers)
        undo.append(lambda: view.__setitem__(pos, old))
        if finite:
            _refuse_nonfinite(r, start, view, pos)
        return
    elif pos.size:
        add_at(view, pos, d)
    else:
        return
    # the inverse, decoded again from the (small) record only if needed: nothing kept meanwhile
    undo.append(lambda: _unapply(view, chunk, size, what))
    if finite:
        _refuse_nonfinite(r, start, view, pos)


def _refuse_nonfinite(r: TensorRecord, start: int, view: np.ndarray, pos: np.ndarray | None) -> None:
    """NonFiniteError if an element this chunk wrote (`pos`, or the whole chunk) is NaN or ±inf:
    one vectorised pass over the written elements only. The caller has queued the undo."""
    written = view if pos is None else view[pos]
    j = first_nonfinite(written, r.dtype)
    if j >= 0:
        at = start + (j if pos is None else int(pos[j]))
        raise NonFiniteError(
            f"tensor {r.name!r}: the update makes element {at} NaN or ±inf (state rolled back)"
        )


def add_at(view: np.ndarray, pos: np.ndarray, d: np.ndarray) -> None:
    """view[pos] += d for distinct positions, wrapping. torch's index_add_: as fast as numpy's
    add.at (and faster than take, add, scatter) but, unlike it, releases the GIL, so apply
    threads run side by side."""
    torch.from_numpy(view).index_add_(0, torch.from_numpy(pos), torch.from_numpy(d))


def _unapply(view: np.ndarray, chunk, size: int, what: str) -> None:
    pos, d, _, _ = decode_chunk(chunk, size, what)
    if pos is None:
        view -= d
    else:
        np.subtract.at(view, pos, d)
