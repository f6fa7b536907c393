"""Raw-bit views of tensors: integer views, float ordering, zig-zag, digests, byte planes.

Everything here is lossless by construction: a tensor is handled as the integer that has its
bits, so NaN payloads, -0, Inf and subnormals round-trip exactly.
"""
from __future__ import annotations

import numpy as np
import torch
import xxhash

from .errors import DeltaError

_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# dtype names on the wire; a receiver refuses a name it does not know rather than guessing.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8,
              torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise DeltaError(f"unsupported dtype {dtype}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise DeltaError(f"unknown dtype {name!r}") from None


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Flat integer view sharing storage with a contiguous tensor (the bits, not the values)."""
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_TORCH_INT[flat.element_size()])


def np_bits(t: torch.Tensor) -> np.ndarray:
    """Signed numpy view of a CPU tensor's bits (no copy when contiguous)."""
    v = int_view(t.detach().contiguous() if not t.is_contiguous() else t.detach())
    return v.numpy().view(_SIGNED[v.element_size()])


# mantissa bits of float dtypes: the exponent (bits >> mantissa) is the value-grouping context
MANTISSA = {"bfloat16": 7, "float16": 10, "float32": 23, "float64": 52, "float8_e4m3fn": 3, "float8_e5m2": 2,
            "float8_e4m3fnuz": 3, "float8_e5m2fnuz": 2}


def exponent_shift(dtype: torch.dtype) -> int | None:
    return MANTISSA.get(str(dtype).removeprefix("torch."))


def is_ordered(dtype: torch.dtype) -> bool:
    """Floats are differenced in their monotonic integer order, so +-1 ulp is +-1 even across 0."""
    return dtype.is_floating_point


def to_order(x: np.ndarray) -> np.ndarray:
    """Sign-magnitude float bits -> two's complement order (a bijection; -0 -> -1, +0 -> 0)."""
    mask = np.array(np.iinfo(x.dtype).max, dtype=x.dtype)
    return x ^ ((x >> (x.itemsize * 8 - 1)) & mask)


from_order = to_order  # the map is an involution


def zigzag(d: np.ndarray) -> np.ndarray:
    """Signed -> unsigned with small magnitudes first: 0,-1,1,-2,... -> 0,1,2,3,..."""
    return ((d << 1) ^ (d >> (d.itemsize * 8 - 1))).view(_UNSIGNED[d.itemsize])


def unzigzag(z: np.ndarray) -> np.ndarray:
    s = z.dtype.type(1)
    return ((z >> s) ^ (np.zeros_like(z) - (z & s))).view(_SIGNED[z.itemsize])


def to_planes(z: np.ndarray) -> bytes:
    """Byte planes (all low bytes, then all next bytes...): the high planes of small values are
    long zero runs that zstd removes almost for free. Shifts, not a strided transpose: faster."""
    if z.itemsize == 1:
        return z.tobytes()
    return b"".join((z >> z.dtype.type(8 * i)).astype(np.uint8).tobytes() for i in range(z.itemsize))


def from_planes(buf, itemsize: int, count: int) -> np.ndarray:
    a = np.frombuffer(buf, dtype=np.uint8)
    if a.size != itemsize * count:
        raise DeltaError(f"value stream has {a.size} bytes, expected {itemsize * count}")
    ut = _UNSIGNED[itemsize]
    z = a[:count].astype(ut)
    for i in range(1, itemsize):
        z |= a[i * count:(i + 1) * count].astype(ut) << ut(8 * i)
    return z


_HOST_CHUNK = 1 << 26  # bytes copied from a device at a time when hashing device tensors


def tensor_digest(t: torch.Tensor) -> bytes:
    """xxh3-128 of the tensor's raw bytes (device tensors are streamed to the host in chunks)."""
    v = int_view(t.detach() if t.is_contiguous() else t.detach().contiguous())
    if v.device.type == "cpu":
        return xxhash.xxh3_128_digest(v.numpy())
    h = xxhash.xxh3_128()
    step = max(1, _HOST_CHUNK // v.element_size())
    for i in range(0, v.numel(), step):
        h.update(v[i:i + step].cpu().numpy())
    return h.digest()


def combine_digest(entries) -> str:
    """State digest from (name, dtype, shape, tensor digest) in name order."""
    h = xxhash.xxh3_128()
    for name, dtype, shape, dig in sorted(entries):
        h.update(f"{name}\0{dtype}\0{','.join(map(str, shape))}\0".encode())
        h.update(dig)
    return h.hexdigest()


def state_digest(state) -> str:
    """One hex digest for a whole state dict: names, dtypes, shapes and raw bits."""
    return combine_digest((n, dtype_name(t.dtype), tuple(t.shape), tensor_digest(t)) for n, t in state.items())
