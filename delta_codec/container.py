"""The binary container shared by deltas and keyframes: prefix, signed msgpack header, records,
checksums and the optional signature.

    prefix  "ADLT" | u16 format | u8 kind | u8 flags | u32 header length      (little endian)
    header  zstd(msgpack {meta..., codec, tensors: [[name, dtype, shape]], heads, sums,
                          delta: base, new | keyframe: digests})
    u64     xxh3-64 of prefix + header
    records one body per tensor, in header order (record.py; lengths follow from the heads)
    [sig]   ed25519 over everything before it, when flags & SIGNED

The header is a msgpack map: the caller's fields (versions, `extra`) plus codec and the tensors,
column by column: `tensors` (name, dtype, shape), `heads` (every tensor's chunk-record head,
concatenated: record.py), `sums` (a u32 checksum per record body). A delta carries the two
state digests, `base` and `new` (16 bytes each: bits.combine_digest over name, dtype, shape and
each tensor's digest, in name order: the values the bus announces and checkpoints record); a
keyframe carries each tensor's digest (`digests`, 16 bytes each), so a damaged keyframe names
its tensor. All of it is checksummed and signed with the records.

Format 5 cut a delta's fixed cost per tensor, which dominates the position bytes of small
updates (a few hundred changes per tensor; figures in docs/benchmarks.md "## delta"): two
16-byte digests per tensor became two per state (apply hashes each result tensor and combines,
apply.py); each record's own u32-framed head moved into the zstd'd header, where the heads'
shared structure compresses; a record's length is no longer stored (its head gives it); the
record checksum is 32 bits, not 64 (see _SUM). Every tensor's name travels in the checksummed
header, so a damaged record is reported by the name of the tensor it belongs to.
"""

from __future__ import annotations

import struct

import msgpack
import xxhash
import zstandard

from . import signing
from .bits import dtype_from_name
from .errors import DeltaError
from .record import TensorRecord, body_checksum, split_heads

MAGIC = b"ADLT"
FORMAT = 5  # 3: positions coded in the context of the base (codec.py CLASSED chunks); 4: a CLASSED
# chunk's class streams in one zstd frame, byte-field lengths in 1-8 bytes (record.py),
# the header zstd'd; 5: state digests instead of tensor digests in deltas, record
# heads in the header, 32-bit record checksums
KIND_DELTA, KIND_KEYFRAME = 1, 2
SIGNED = 1
CODEC = "ctx-rice-zigzag-zstd/5"
_PREFIX = struct.Struct("<4sHBBI")
_KINDS = {KIND_DELTA: "delta", KIND_KEYFRAME: "keyframe"}
_HEADER_LEVEL = 3  # (the header is small: a real match search pays, unlike on the payload streams)
_HEADER_MAX_RATIO = 256  # a header decompresses to at most this many times its size (no zip bombs)
# The per-record checksum is 32 bits: it is there to catch accidental damage (storage, a
# transport bug) early and to name the tensor, not to stop an attacker (that is the ed25519
# signature over the whole blob, which no checksum width replaces). A random corruption passes
# 32 bits with probability 2^-32, and then still has to pass the decoders' validation and the
# 128-bit state digest of the applied result (deltas) or the tensor's digest (keyframes), which
# cover every byte that reaches the weights. (The 4 bytes saved per tensor are measurable on a
# small update: docs/benchmarks.md "## delta".)
_SUM = struct.Struct("<I")
_DIGEST = 16  # bytes of a tensor or state digest (xxh3-128)


def header_bytes(meta: dict) -> bytes:
    """The header as it travels: zstd(msgpack(meta))."""
    return zstandard.ZstdCompressor(level=_HEADER_LEVEL).compress(msgpack.packb(meta, use_bin_type=True))


def extra_fields(extra) -> dict:
    """A Delta's/Keyframe's optional extra header fields (msgpack-able values, str keys): they
    travel in the header map under "extra", so they are checksummed and signed with the blob."""
    if extra is None:
        return {}
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise DeltaError(f"extra header fields must be a dict with str keys, got {type(extra).__name__}")
    return dict(extra)


def with_extra(meta: dict, extra: dict) -> dict:
    return dict(meta, extra=extra) if extra else meta


def blob_head(kind: int, meta: dict, recs: list[TensorRecord], signed: bool) -> bytes:
    """Prefix, header and the header's checksum: everything before the records. meta: the
    caller's fields; a delta's also holds `base` and `new` (its state digests, 16 bytes each)."""
    meta = dict(
        meta,
        codec=CODEC,
        tensors=[[r.name, r.dtype, list(r.shape)] for r in recs],
        heads=b"".join(r.head for r in recs),
        sums=b"".join(_SUM.pack(r.checksum) for r in recs),
    )
    if kind == KIND_KEYFRAME:
        meta["digests"] = b"".join(r.digest_a for r in recs)
    header = header_bytes(meta)
    head = _PREFIX.pack(MAGIC, FORMAT, kind, SIGNED if signed else 0, len(header)) + header
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def pack_blob(kind: int, meta: dict, recs: list[TensorRecord], signing_key) -> bytes:
    head = blob_head(kind, meta, recs, signing_key is not None)
    blob = b"".join([head, *(p for r in recs for p in r.parts)])
    return blob + signing.sign(signing_key, blob) if signing_key is not None else blob


def unpack_blob(blob, kind: int):
    """-> (meta, records, signed region, signature or None). Validates structure and checksums."""
    mv = memoryview(blob).cast("B") if not isinstance(blob, memoryview) else blob.cast("B")
    what = _KINDS[kind]
    if len(mv) < _PREFIX.size + 8:
        raise DeltaError(f"{what} truncated: {len(mv)} bytes is shorter than the fixed prefix")
    magic, fmt, k, flags, hlen = _PREFIX.unpack_from(mv)
    if magic != MAGIC:
        raise DeltaError(f"not a delta_codec blob (magic {bytes(magic)!r})")
    if fmt != FORMAT:
        raise DeltaError(
            f"unsupported {what} format version {fmt} ({'older' if fmt < FORMAT else 'newer'} than "
            f"this build's {FORMAT}: encode with a matching build, or resync from a keyframe)"
        )
    if k != kind:
        raise DeltaError(f"expected a {what}, got a {_KINDS.get(k, f'kind {k}')}")
    end = _PREFIX.size + hlen
    if len(mv) < end + 8:
        raise DeltaError(f"{what} truncated inside its header ({len(mv)} < {end + 8} bytes)")
    if xxhash.xxh3_64_intdigest(mv[:end]) != struct.unpack_from("<Q", mv, end)[0]:
        raise DeltaError(f"{what} header checksum mismatch (corrupted header)")
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            mv[_PREFIX.size : end], max_output_size=_HEADER_MAX_RATIO * hlen
        )
        meta = msgpack.unpackb(raw, raw=False)
        tensors, heads, sums = meta["tensors"], meta["heads"], meta["sums"]
        digests = meta["digests"] if kind == KIND_KEYFRAME else b""
        if not isinstance(tensors, list) or not all(isinstance(b, bytes) for b in (heads, sums, digests)):
            raise TypeError("tensors is not a list, or heads, sums or digests are not bytes")
        digests = digests if kind == KIND_KEYFRAME else None
    except Exception as e:  # a checksummed header that does not parse is a producer bug
        raise DeltaError(f"{what} header does not parse: {e}") from None
    if flags & ~SIGNED:
        raise DeltaError(f"{what} has unknown flags {flags:#x}")
    entries = []
    for entry in tensors:
        try:
            name, dt, shape = entry
            if not isinstance(name, str):
                raise TypeError("name is not a string")
            shape = tuple(int(s) for s in shape)
            if any(s < 0 for s in shape):
                raise ValueError("negative size")
            if not isinstance(dt, str):
                raise TypeError("dtype is not a string")
        except (TypeError, ValueError) as e:
            raise DeltaError(f"{what} header has a malformed tensor entry {str(entry)[:80]}: {e}") from None
        dtype_from_name(dt)
        entries.append((name, dt, shape))
    if (
        len(sums) != _SUM.size * len(entries)
        or digests is not None
        and len(digests) != _DIGEST * len(entries)
    ):
        raise DeltaError(f"{what} header's checksums or digests do not match its {len(entries)} tensors")
    sig_len = signing.SIGNATURE_BYTES if flags & SIGNED else 0
    body_end = len(mv) - sig_len
    off, recs = end + 8, []
    for i, ((name, dt, shape), (head, n)) in enumerate(
        zip(entries, split_heads(heads, [e[0] for e in entries]))
    ):
        if off + n > body_end:
            raise DeltaError(
                f"{what} truncated: tensor {name!r} needs {n} bytes at offset {off}, "
                f"only {max(body_end - off, 0)} remain"
            )
        body = mv[off : off + n]
        if body_checksum([body]) != _SUM.unpack_from(sums, _SUM.size * i)[0]:
            raise DeltaError(f"tensor {name!r}: record checksum mismatch (corrupted payload)")
        dig = digests[_DIGEST * i : _DIGEST * (i + 1)] if digests is not None else None
        recs.append(TensorRecord(name, dt, shape, dig, dig, head, body))
        off += n
    if off != body_end:
        raise DeltaError(
            f"{what} has {body_end - off} unexpected trailing bytes (truncated signature or garbage)"
        )
    sig = bytes(mv[body_end:]) if sig_len else None
    return meta, recs, mv[:body_end], sig


class SignedBlob:
    """A Delta or Keyframe: parsed from a blob, it keeps the signed region and the signature."""

    signature: bytes | None = None
    _signed_region = None

    def verify_signature(self, public_key) -> None:
        """Raises DeltaError unless this object was parsed from a blob signed by `public_key`."""
        if self.signature is None or self._signed_region is None:
            raise DeltaError(f"{type(self).__name__.lower()} is unsigned, but a signature is required")
        signing.verify(public_key, self._signed_region, self.signature)


def blob_kind(blob) -> int:
    """The kind (KIND_DELTA or KIND_KEYFRAME) a blob says it is, from its prefix alone."""
    mv = memoryview(blob).cast("B")
    if len(mv) < _PREFIX.size or mv[:4] != MAGIC:
        raise DeltaError("not a delta_codec blob")
    kind = _PREFIX.unpack_from(mv)[2]
    if kind not in _KINDS:
        raise DeltaError(f"unknown blob kind {kind}")
    return kind
