"""One tensor's record inside a container: its entry (name, dtype, shape, digests) and the
framing of its chunk records.

    record  u32 length of its header | msgpack list of chunk records (codec.py) whose byte
            fields are ext(1, length) placeholders (little endian in 1, 2, 4 or 8 bytes: msgpack's
            fixext sizes, the smallest that holds it) | those fields' bytes, in order
            (parsed as memoryviews of the blob: no copies, no GIL-held unpacking of payload)
"""
from __future__ import annotations

import struct

import msgpack
import numpy as np
import xxhash

from .codec import chunk_header
from .errors import DeltaError

class TensorRecord:
    """One tensor's entry: name, dtype, shape, digests (delta: base and result; keyframe: the
    tensor's, twice) and its record (chunk records, see the module doc). The encoder hands
    the record over as a list of parts, joined only into the blob (one copy, not two)."""

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], digest_a: bytes, digest_b: bytes,
                 record: bytes | memoryview | list, changed: int = -1):
        self.name, self.dtype, self.shape, self.digest_a, self.digest_b = name, dtype, tuple(shape), digest_a, digest_b
        self._parts = record if isinstance(record, list) else [record]
        self._joined = None if isinstance(record, list) else record
        self.nbytes = sum(len(p) for p in self._parts)
        self._checksum: int | None = None
        self.changed = changed  # known at encode time; -1 after parsing (counted on demand)

    @property
    def record(self) -> bytes | memoryview:
        if self._joined is None:
            self._joined = b"".join(self._parts)
            self._parts = [self._joined]
        return self._joined

    @property
    def parts(self) -> list:
        return self._parts

    @property
    def checksum(self) -> int:
        if self._checksum is None:
            h = xxhash.xxh3_64()
            for p in self._parts:
                h.update(p)
            self._checksum = h.intdigest()
        return self._checksum

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))



_FIELD = 1  # msgpack ext code: a byte field, stored in the record's payload


def hollow(rec) -> tuple[bytes, list]:
    """A chunk record -> (msgpack of it with byte fields as placeholders, those fields)."""
    fields = []

    def sub(x):
        if isinstance(x, (bytes, bytearray, memoryview)):
            fields.append(x)
            n = len(x)
            return msgpack.ExtType(_FIELD, n.to_bytes(next(w for w in (1, 2, 4, 8) if n < 1 << 8 * w), "little"))
        return [sub(y) for y in x] if isinstance(x, list) else x

    return msgpack.packb(sub(rec), use_bin_type=True), fields


def record_parts(hollowed: list[tuple[bytes, list]]) -> list:
    header = msgpack.Packer().pack_array_header(len(hollowed)) + b"".join(h for h, _ in hollowed)
    return [struct.pack("<I", len(header)), header, *(f for _, fields in hollowed for f in fields)]


def pack_record(chunks: list) -> list:
    """Chunk records -> a tensor record (as parts)."""
    return record_parts([hollow(c) for c in chunks])


def chunks_of(r: TensorRecord, fields: int = 3) -> list:
    """A tensor record's chunk records, byte fields as memoryviews of the record."""
    mv = memoryview(r.record).cast("B")
    hl = struct.unpack_from("<I", mv)[0] if len(mv) >= 4 else -1
    if not 0 <= hl <= len(mv) - 4:
        raise DeltaError(f"tensor {r.name!r}: record does not parse (header of {hl} bytes in {len(mv)})")
    payload, used = mv[4 + hl:], 0

    def field(code: int, data: bytes):
        nonlocal used
        if code != _FIELD or len(data) not in (1, 2, 4, 8):
            raise ValueError(f"unknown field type {code}")
        n = int.from_bytes(data, "little")
        if used + n > len(payload):
            raise ValueError(f"field of {n} bytes beyond the record")
        used += n
        return payload[used - n:used]

    try:
        chunks = msgpack.unpackb(mv[4:4 + hl], raw=False, ext_hook=field)
    except Exception as e:
        raise DeltaError(f"tensor {r.name!r}: record does not parse ({e})") from None
    if used != len(payload):
        raise DeltaError(f"tensor {r.name!r}: record has {len(payload) - used} bytes beyond its fields")
    if not isinstance(chunks, list) or not all(isinstance(c, list) and len(c) >= fields for c in chunks):
        raise DeltaError(f"tensor {r.name!r}: record is not a list of chunks")
    return chunks


def chunk_starts(r: TensorRecord, chunks: list) -> list[int]:
    starts, start = [], 0
    for i, c in enumerate(chunks):
        starts.append(start)
        start += chunk_header(c, f"tensor {r.name!r} chunk {i}")[1]
    if start != r.numel:
        raise DeltaError(f"tensor {r.name!r}: chunks cover {start} elements, tensor has {r.numel}")
    return starts
