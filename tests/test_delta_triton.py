"""The Triton apply kernel, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1 must be
set before the kernel is defined, so the check runs in a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import numpy as np, torch
    from delta_codec import encode_delta
    from delta_codec.apply import decode_record as _decode_record
    from delta_codec.triton_apply import use_triton, apply_on_device, apply_sparse
    g = torch.Generator().manual_seed(0)
    base = {
        "bf16": (torch.randn(4096, generator=g) * 0.02).to(torch.bfloat16),
        "fp16": torch.randn(3000, generator=g).to(torch.float16),
        "fp32": torch.randn(2000, generator=g),
        "fp8": torch.randn(1000, generator=g).to(torch.float8_e4m3fn),
        "i32": torch.randint(-2**31, 2**31 - 1, (999,), generator=g, dtype=torch.int32),
    }
    base["bf16"][:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    new = {}
    for k, v in base.items():
        x = v.clone()
        m = torch.rand(v.shape, generator=g) < 0.2
        if v.dtype.is_floating_point:
            x[m] = (v[m].float() * 1.003 - 1e-4).to(v.dtype)        # small moves, across zero too
            x[:2] = torch.tensor([-0.0, 0.0]).to(v.dtype)            # sign flips of zero
        else:
            x[m] = torch.randint(-2**31, 2**31 - 1, (int(m.sum()),), generator=g, dtype=torch.int32)
        new[k] = x
    d = encode_delta(base, new, chunk=512)                           # several chunks and modes
    state = {k: v.clone() for k, v in base.items()}
    for r in d.records:
        t = state[r.name]
        bits = t.view(-1).view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])
        assert use_triton(bits), r.name
        undo = []
        apply_on_device(t, _decode_record(r, t), undo)
        assert torch.equal(t.view(-1).view(bits.dtype), new[r.name].view(-1).view(bits.dtype)), r.name
        for u in reversed(undo):                                     # the saved old bits restore exactly
            u()
        assert torch.equal(t.view(-1).view(bits.dtype), base[r.name].view(-1).view(bits.dtype)), r.name
    # wrap-around at the element width: +1 from the largest int16 and -1 from the most negative
    b = torch.tensor([32767, -32768, 5], dtype=torch.int16)
    old = apply_sparse(b, torch.tensor([0, 1]), torch.tensor([1, -1], dtype=torch.int16), False)
    assert b.tolist() == [-32768, 32767, 5] and old.tolist() == [32767, -32768]
    print("TRITON-OK")
""")


def test_triton_apply_kernel_in_interpreter():
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and "TRITON-OK" in out.stdout, out.stdout + out.stderr
