"""NATS user nkeys (ed25519), made without the `nkeys` package: what a leaf node logs in with.

    seed, public = user_nkey()              # "SU...", "U..."; user_nkey(raw32) is deterministic
A region's leaf remote signs the hub's challenge with the seed (`nkey: <seed>` in its remote), the
hub admits the public key (`{ nkey: <public> }` in accounts.conf): no password travels in the leaf
URL or over the WAN. Encoding (nats-io/nkeys): base32 without padding of prefix bytes + key +
CRC-16/XMODEM (little-endian).
"""

from __future__ import annotations

import base64
import os

_PREFIX_SEED = 18 << 3  # 'S'
_PREFIX_USER = 20 << 3  # 'U'


def _crc16(data: bytes) -> int:
    crc = 0
    for b in data:  # a few dozen bytes per key: no table needed
        crc ^= b << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def _encode(raw: bytes) -> str:
    return base64.b32encode(raw + _crc16(raw).to_bytes(2, "little")).decode().rstrip("=")


def user_nkey(raw_seed: bytes | None = None) -> tuple[str, str]:
    """-> (seed, public key) of a user nkey; a fresh random one unless `raw_seed` (32 bytes) is given."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    raw_seed = os.urandom(32) if raw_seed is None else raw_seed
    if len(raw_seed) != 32:
        raise ValueError(f"an nkey seed is 32 bytes, got {len(raw_seed)}")
    pub = (
        Ed25519PrivateKey.from_private_bytes(raw_seed)
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )
    seed = _encode(bytes([_PREFIX_SEED | (_PREFIX_USER >> 5), (_PREFIX_USER & 31) << 3]) + raw_seed)
    return seed, _encode(bytes([_PREFIX_USER]) + pub)


def public_of(seed: str) -> str:
    """The public key of a user nkey seed ("SU..."); ValueError on anything else."""
    try:
        raw = base64.b32decode(seed + "=" * (-len(seed) % 8))
    except ValueError:
        raise ValueError("not an nkey seed (base32)") from None
    body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
    if (
        len(body) != 34
        or _crc16(body) != crc
        or body[:2] != bytes([_PREFIX_SEED | (_PREFIX_USER >> 5), (_PREFIX_USER & 31) << 3])
    ):
        raise ValueError("not a user nkey seed (prefix, length or checksum)")
    return user_nkey(body[2:])[1]
