"""One tensor's record inside a container: its entry (name, dtype, shape, digests) and the
framing of its chunk records, split in two:

    head    msgpack list of chunk records (codec.py) whose byte fields are ext(1, length)
            placeholders (little endian in 1, 2, 4 or 8 bytes: msgpack's fixext sizes, the
            smallest that holds it). It travels in the container's zstd'd header, next to the
            other tensors' heads (format 5: a few dozen bytes of near-identical structure per
            tensor, a fifth of a sparse delta's position bytes when each tensor framed its own)
    body    those fields' bytes, in order: the tensor's record in the blob. Its length follows
            from the head's placeholders (parsed as memoryviews of the blob: no copies, no
            GIL-held unpacking of payload)
"""

from __future__ import annotations

import msgpack
import numpy as np
import xxhash

from .codec import chunk_header
from .errors import DeltaError


class TensorRecord:
    """One tensor's entry: name, dtype, shape, digests (a delta built by encode_delta: the
    tensor's base and result digests, from which the state digests are combined; a parsed
    delta: None, only the state digests travel; a keyframe: the tensor's, twice), the head
    (msgpack of its chunk records, byte fields as placeholders) and the body (those fields;
    the encoder hands them over as a list of parts, joined only into the blob: one copy, not
    two)."""

    def __init__(
        self,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        digest_a: bytes | None,
        digest_b: bytes | None,
        head: bytes,
        body: bytes | memoryview | list,
        changed: int = -1,
    ):
        self.name, self.dtype, self.shape, self.digest_a, self.digest_b = (
            name,
            dtype,
            tuple(shape),
            digest_a,
            digest_b,
        )
        self.head = bytes(head)
        self._parts = body if isinstance(body, list) else [body]
        self._joined = None if isinstance(body, list) else body
        self.nbytes = sum(len(p) for p in self._parts)
        self._checksum: int | None = None
        self.changed = changed  # known at encode time; -1 after parsing (counted on demand)

    @property
    def body(self) -> bytes | memoryview:
        if self._joined is None:
            self._joined = b"".join(self._parts)
            self._parts = [self._joined]
        return self._joined

    @property
    def parts(self) -> list:
        return self._parts

    @property
    def checksum(self) -> int:
        """32 bits of the body's xxh3-64: what the container stores per record (see container.py
        for why 32 bits are enough)."""
        if self._checksum is None:
            self._checksum = body_checksum(self._parts)
        return self._checksum

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def body_checksum(parts) -> int:
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest() & 0xFFFFFFFF


_FIELD = 1  # msgpack ext code: a byte field, stored in the record's payload


def hollow(rec) -> tuple[bytes, list]:
    """A chunk record -> (msgpack of it with byte fields as placeholders, those fields)."""
    fields = []

    def sub(x):
        if isinstance(x, (bytes, bytearray, memoryview)):
            fields.append(x)
            n = len(x)
            return msgpack.ExtType(
                _FIELD, n.to_bytes(next(w for w in (1, 2, 4, 8) if n < 1 << 8 * w), "little")
            )
        return [sub(y) for y in x] if isinstance(x, list) else x

    return msgpack.packb(sub(rec), use_bin_type=True), fields


def record_parts(hollowed: list[tuple[bytes, list]]) -> tuple[bytes, list]:
    """Hollowed chunk records -> (head, body parts)."""
    head = msgpack.Packer().pack_array_header(len(hollowed)) + b"".join(h for h, _ in hollowed)
    return head, [f for _, fields in hollowed for f in fields]


def pack_record(chunks: list) -> tuple[bytes, list]:
    """Chunk records -> a tensor record's (head, body parts)."""
    return record_parts([hollow(c) for c in chunks])


def _field_length(code: int, data: bytes) -> int:
    if code != _FIELD or len(data) not in (1, 2, 4, 8):
        raise ValueError(f"unknown field type {code}")
    return int.from_bytes(data, "little")


def split_heads(buf, names: list[str]) -> list[tuple[bytes, int]]:
    """The container's concatenated heads (one msgpack object per tensor, in entry order) ->
    [(head, body length)]. Every placeholder is checked here, so a body's length is known
    before its bytes are read."""
    lengths: list[int] = []
    unpacker = msgpack.Unpacker(
        raw=False,
        ext_hook=lambda code, data: lengths.append(_field_length(code, data)),
        max_buffer_size=max(len(buf), 1),
    )
    unpacker.feed(buf)
    out, at = [], 0
    for name in names:
        lengths.clear()
        try:
            unpacker.unpack()
        except msgpack.OutOfData:
            if at < len(buf):
                raise DeltaError(
                    f"tensor {name!r}: record does not parse (its chunk records end early)"
                ) from None
            raise DeltaError(f"header has chunk records for {len(out)} of {len(names)} tensors") from None
        except Exception as e:
            raise DeltaError(f"tensor {name!r}: record does not parse ({e})") from None
        end = unpacker.tell()
        out.append((bytes(buf[at:end]), sum(lengths)))
        at = end
    if at != len(buf):
        raise DeltaError(f"header has {len(buf) - at} bytes of chunk records beyond its {len(names)} tensors")
    return out


def chunks_of(r: TensorRecord, fields: int = 3) -> list:
    """A tensor record's chunk records, byte fields as memoryviews of its body."""
    payload, used = memoryview(r.body).cast("B"), 0

    def field(code: int, data: bytes):
        nonlocal used
        n = _field_length(code, data)
        if used + n > len(payload):
            raise ValueError(f"field of {n} bytes beyond the record")
        used += n
        return payload[used - n : used]

    try:
        chunks = msgpack.unpackb(r.head, raw=False, ext_hook=field)
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
