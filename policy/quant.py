"""fp8 (e4m3) fake-quantisation with straight-through gradients.

Scales are computed per row of the last dim (or per block of it): each token's values are
quantised from their own amax only, so the result never depends on other positions."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def fp8_round(x: torch.Tensor, block: int = 0) -> torch.Tensor:
    """Quantise to fp8 and back, scale = amax / 448 per row (block=0) or per `block` features."""
    shape = x.shape
    if block:
        if shape[-1] % block:
            raise ValueError(f"fp8 block {block} does not divide last dim {shape[-1]}")
        x = x.reshape(*shape[:-1], shape[-1] // block, block)
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
    return q.to(x.dtype).reshape(shape)


def fake_quant(x: torch.Tensor, block: int = 0) -> torch.Tensor:
    """Forward: fp8-rounded values. Backward: identity (straight-through estimator)."""
    return x + (fp8_round(x.detach(), block) - x).detach()
