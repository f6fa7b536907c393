"""Applying decoded chunks to device tensors: one fused Triton scatter per chunk.

The kernel gathers the old bits at each changed index, saves them (for rollback), adds the
difference with wrap-around at the element width and stores. (It can also add in monotonic
float order, ORDERED; the wire format since version 2 carries raw-bit differences.) Tensors on
devices without Triton use the same arithmetic in torch ops. Tested on the CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import numpy as np
import torch

from .bits import int_view

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-ops path only
    triton = None

if triton is not None:

    @triton.jit
    def _apply_kernel(
        bits_ptr, idx_ptr, d_ptr, old_ptr, n, ORDERED: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = offs < n
        idx = tl.load(idx_ptr + offs, mask=live, other=0)
        old = tl.load(bits_ptr + idx, mask=live, other=0)
        tl.store(old_ptr + offs, old, mask=live)
        d = tl.load(d_ptr + offs, mask=live, other=0).to(tl.int64)
        w = old.to(tl.int64)  # sign-extended: wide arithmetic, then wrap to BITS explicitly
        if ORDERED:
            w = w ^ ((w >> 63) & ((1 << (BITS - 1)) - 1))
        w = w + d
        w = (w << (64 - BITS)) >> (64 - BITS)
        if ORDERED:
            w = w ^ ((w >> 63) & ((1 << (BITS - 1)) - 1))
        tl.store(bits_ptr + idx, w.to(old.dtype), mask=live)


def use_triton(bits: torch.Tensor) -> bool:
    import os

    return (
        triton is not None
        and bits.dtype in (torch.int8, torch.int16, torch.int32)
        and (bits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    )


def apply_sparse(bits: torch.Tensor, idx: torch.Tensor, d: torch.Tensor, ordered: bool) -> torch.Tensor:
    """bits[idx] += d (in float order when `ordered`), in place on a flat signed-int tensor.
    Returns the old bits at idx (for rollback)."""
    n = idx.numel()
    if use_triton(bits):
        old = torch.empty(n, dtype=bits.dtype, device=bits.device)
        if n:
            block = 1024
            _apply_kernel[(triton.cdiv(n, block),)](
                bits, idx, d, old, n, ORDERED=ordered, BITS=bits.element_size() * 8, BLOCK=block
            )
        return old
    old = bits[idx]
    w = old
    width = bits.element_size() * 8
    mask = (1 << (width - 1)) - 1
    if ordered:
        w = w ^ ((w >> (width - 1)) & mask)
    w = w + d.to(bits.dtype)  # integer add wraps at the element width
    if ordered:
        w = w ^ ((w >> (width - 1)) & mask)
    bits[idx] = w
    return old


def apply_on_device(t: torch.Tensor, decoded, undo: list) -> None:
    """Apply decoded chunks [(start, positions | None, signed differences, count, _)] to device
    tensor t."""
    bits = int_view(t)
    if bits.dtype == torch.uint8:  # 1-byte dtypes: signed view for the arithmetic
        bits = bits.view(torch.int8)
    for start, pos, d, count, _ in decoded:
        if pos is None:
            idx = torch.arange(start, start + count, device=t.device)
        elif pos.size:
            idx = torch.from_numpy(pos + start).to(t.device, non_blocking=True)
        else:
            continue
        dd = torch.from_numpy(np.ascontiguousarray(d)).to(t.device, non_blocking=True)
        old = apply_sparse(bits, idx, dd, False)
        undo.append(lambda b=bits, i=idx, o=old: b.index_copy_(0, i, o))
