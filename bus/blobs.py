"""Blob transfer through the JetStream object store `rl-blobs` (payloads over the message size).

put: chunked by the object store; we record our own sha256 in the object's headers.
get: chunks are written into one preallocated buffer (ObjectStore.get without `writeinto`
concatenates bytes: quadratic), then both the store's digest and ours are checked.
"""
from __future__ import annotations

import hashlib
import io

import nats.js.errors as jse
from nats.js import api

CHUNK = 512 * 1024        # under the server's default 1 MiB max_payload, big enough to amortise acks
SHA_HEADER = "Rl-Sha256"


class _Into(io.RawIOBase):
    """A write target over a preallocated bytearray (no re-allocation while chunks arrive)."""

    def __init__(self, size: int):
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = len(b)
        if self.pos + n > len(self.buf):
            from bus.client import BlobError
            raise BlobError(f"blob longer than its recorded size {len(self.buf)}")
        self.view[self.pos:self.pos + n] = b
        self.pos += n
        return n


async def put_blob(bus, name: str, data) -> str:
    obs = await bus._blobs()
    digest = hashlib.sha256(data).hexdigest()
    meta = api.ObjectMeta(name=name, headers={SHA_HEADER: digest},
                          options=api.ObjectMetaOptions(max_chunk_size=CHUNK))
    await obs.put(name, io.BytesIO(data) if not isinstance(data, io.IOBase) else data, meta=meta)
    return digest


async def get_blob(bus, name: str) -> bytes:
    from bus.client import BlobError
    obs = await bus._blobs()
    try:
        info = await obs.get_info(name)
    except jse.NotFoundError:
        raise BlobError(f"blob {name!r} not found in {obs._name}") from None
    into = _Into(info.size)
    try:
        await obs.get(name, writeinto=into)
    except jse.DigestMismatchError:
        raise BlobError(f"blob {name!r}: object-store digest mismatch (corrupt or truncated)") from None
    if into.pos != info.size:
        raise BlobError(f"blob {name!r}: got {into.pos} bytes, expected {info.size}")
    want = (info.headers or {}).get(SHA_HEADER)
    if want:
        got = hashlib.sha256(into.view).hexdigest()
        if got != want:
            raise BlobError(f"blob {name!r}: sha256 {got} != recorded {want}")
    into.view.release()
    return bytes(into.buf)
