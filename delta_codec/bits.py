"""Raw-bit views of tensors: integer views, zig-zag, digests, byte planes.

Everything here is lossless by construction: a tensor is handled as the integer that has its
bits, so NaN payloads, -0, Inf and subnormals round-trip exactly.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from .errors import DeltaError

SIGNED_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
UNSIGNED_INT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# dtype names on the wire; a receiver refuses a name it does not know rather than guessing.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}
for _name in (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "uint16",
    "uint32",
    "uint64",
):
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
    return v.numpy().view(SIGNED_INT[v.element_size()])


# mantissa bits of float dtypes: the exponent (bits >> mantissa) is the value-grouping context
MANTISSA = {
    "bfloat16": 7,
    "float16": 10,
    "float32": 23,
    "float64": 52,
    "float8_e4m3fn": 3,
    "float8_e5m2": 2,
    "float8_e4m3fnuz": 3,
    "float8_e5m2fnuz": 2,
}


def exponent_shift(dtype: torch.dtype) -> int | None:
    return MANTISSA.get(str(dtype).removeprefix("torch."))


def fresh(_key: str, n: int, dtype) -> np.ndarray:
    """The allocator signature of Scratch, allocating anew (for results that outlive a chunk)."""
    return np.empty(n, dtype)


class Scratch:
    """Reusable per-worker buffers for a chunk's temporaries, by name: `scratch(key, n, dtype)`
    -> an n-element view, valid until the same key is asked for again. Freshly allocated
    arrays of a few MB are handed back to the OS on free and page-faulted in again (measured:
    up to half of the encode time at 18 % changed); reused buffers are not."""

    MAX_BYTES = 1 << 26  # larger requests (huge chunks) are allocated anew, not kept

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def __call__(self, key: str, n: int, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = n * dtype.itemsize
        if nbytes > self.MAX_BYTES:
            return np.empty(n, dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = self._bufs[key] = np.empty(max(nbytes, 1 << 16), np.uint8)
        return buf[:nbytes].view(dtype)


def zigzag(d: np.ndarray, alloc=fresh) -> np.ndarray:
    """Signed -> unsigned with small magnitudes first: 0,-1,1,-2,... -> 0,1,2,3,..."""
    z = np.left_shift(d, 1, out=alloc("zz", d.size, d.dtype))
    z ^= np.right_shift(d, d.itemsize * 8 - 1, out=alloc("zz.sign", d.size, d.dtype))
    return z.view(UNSIGNED_INT[d.itemsize])


def unzigzag(z: np.ndarray, alloc=fresh) -> np.ndarray:
    s = np.bitwise_and(z, 1, out=alloc("uz.sign", z.size, z.dtype))
    np.negative(s, out=s)  # 0 or all ones (unsigned negation wraps)
    out = np.right_shift(z, 1, out=alloc("uz", z.size, z.dtype))
    out ^= s
    return out.view(SIGNED_INT[z.itemsize])


def unzigzag_small(lo: np.ndarray, itemsize: int, alloc=fresh) -> np.ndarray:
    """unzigzag of zig-zag codes < 256 (uint8), widened to signed `itemsize` bytes: byte-wide
    arithmetic, then one sign-extending cast (faster than a 256-entry table lookup)."""
    d8 = unzigzag(lo, alloc)
    if itemsize == 1:
        return d8
    out = alloc("uz.wide", lo.size, SIGNED_INT[itemsize])
    out[...] = d8
    return out


def planes(z: np.ndarray, alloc=fresh) -> np.ndarray:
    """Byte planes (all low bytes, then all next bytes...) as one uint8 array: the high planes of
    small values are long zero runs that zstd removes almost for free. Truncating assignment
    into one buffer: one pass per plane, no joins."""
    if z.itemsize == 1:
        return z.view(np.uint8)
    m = z.size
    out = alloc("planes", z.itemsize * m, np.uint8)
    out[:m] = z
    if z.itemsize > 1:
        t = alloc("planes.shift", m, z.dtype)
        for i in range(1, z.itemsize):
            out[i * m : (i + 1) * m] = np.right_shift(z, 8 * i, out=t)
    return out


def from_planes(buf, itemsize: int, count: int) -> np.ndarray:
    a = np.frombuffer(buf, dtype=np.uint8)
    if a.size != itemsize * count:
        raise DeltaError(f"value stream has {a.size} bytes, expected {itemsize * count}")
    ut = UNSIGNED_INT[itemsize]
    z = a[:count].astype(ut)
    for i in range(1, itemsize):
        z |= a[i * count : (i + 1) * count].astype(ut) << ut(8 * i)
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
        h.update(v[i : i + step].cpu().numpy())
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
    return combine_digest(
        (n, dtype_name(t.dtype), tuple(t.shape), tensor_digest(t)) for n, t in state.items()
    )
