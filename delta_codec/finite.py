"""Finiteness of weights, read from their raw bits: numpy has no bfloat16, and the bits are what
apply and load_keyframe already hold (signed-int views, bits.np_bits / bits.int_view).

    bad = nonfinite(bits, "bfloat16")     # bool array (numpy or torch, as `bits`): NaN or ±inf
    i = first_nonfinite(bits, "float32")  # -1 when every element is finite

An IEEE float is NaN or ±inf exactly when its exponent bits are all ones; float8 e4m3fn has no
inf and one NaN pattern per sign (S.1111.111); the *fnuz formats have one NaN, 0x80. Integer and
bool tensors are always finite. One vectorised `&` and `==` over the elements asked about.
"""

from __future__ import annotations

import numpy as np

# dtype name -> (mask, value): the element is non-finite where bits & mask == value
_PATTERN = {
    "bfloat16": (0x7F80, 0x7F80),
    "float16": (0x7C00, 0x7C00),
    "float32": (0x7F800000, 0x7F800000),
    "float64": (0x7FF0000000000000, 0x7FF0000000000000),
    "float8_e5m2": (0x7C, 0x7C),
    "float8_e4m3fn": (0x7F, 0x7F),
    "float8_e4m3fnuz": (0xFF, 0x80),
    "float8_e5m2fnuz": (0xFF, 0x80),
}


def checks(dtype_name: str) -> bool:
    """Whether elements of this dtype can be non-finite (float dtypes)."""
    return dtype_name in _PATTERN


def nonfinite(bits, dtype_name: str):
    """Bool array: where the elements whose signed-int bits are `bits` are NaN or ±inf."""
    mask, value = _PATTERN[dtype_name]
    if mask == 0xFF:  # 1-byte signed views: 0x80 is -128
        return bits == np.int8(-128) if isinstance(bits, np.ndarray) else bits == -128
    return (bits & mask) == value


def first_nonfinite(bits, dtype_name: str) -> int:
    """Index of the first NaN/±inf element of `bits` (numpy), -1 if none or not a float dtype."""
    if not checks(dtype_name) or not bits.size:
        return -1
    bad = nonfinite(bits, dtype_name)
    return int(np.argmax(bad)) if bad.any() else -1
