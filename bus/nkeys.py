"""NATS user nkeys (ed25519) through nats-io's `nkeys` package: what a leaf node logs in with.

    seed, public = user_nkey()              # "SU...", "U..."; user_nkey(raw32) is deterministic
A region's leaf remote signs the hub's challenge with the seed (`nkey: <seed>` in its remote), the
hub admits the public key (`{ nkey: <public> }` in accounts.conf): no password travels in the leaf
URL or over the WAN.
"""

from __future__ import annotations

import base64
import os

import nkeys


def user_nkey(raw_seed: bytes | None = None) -> tuple[str, str]:
    """-> (seed, public key) of a user nkey; a fresh random one unless `raw_seed` (32 bytes) is given."""
    raw_seed = os.urandom(32) if raw_seed is None else raw_seed
    if len(raw_seed) != 32:
        raise ValueError(f"an nkey seed is 32 bytes, got {len(raw_seed)}")
    seed = nkeys.encode_seed(raw_seed, nkeys.PREFIX_BYTE_USER)
    return seed.decode(), nkeys.from_seed(seed).public_key.decode()


def public_of(seed: str) -> str:
    """The public key of a user nkey seed ("SU..."); ValueError on anything else."""
    try:
        b = seed.encode("ascii")
        prefix, raw = nkeys.decode_seed(b)
        body = base64.b32decode(b + b"=" * (-len(b) % 8))
    except (ValueError, nkeys.NkeysError):
        raise ValueError("not an nkey seed (base32, seed prefix)") from None
    # decode_seed checks neither the checksum nor the length, nor that the key is a user's
    if prefix != nkeys.PREFIX_BYTE_USER or len(raw) != 32 or nkeys.crc16_checksum(body[:-2]) != body[-2:]:
        raise ValueError("not a user nkey seed (prefix, length or checksum)")
    return nkeys.from_seed(b).public_key.decode()
