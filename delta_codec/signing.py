"""ed25519 signatures over whole blobs: engines accept weights only from the trainer's key.

Keys are raw 32-byte values (or hex strings of them, handy in TOML/env), or the
`cryptography` key objects themselves.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import DeltaError

SIGNATURE_BYTES = 64


def _raw(key) -> bytes:
    return bytes.fromhex(key) if isinstance(key, str) else bytes(key)


def private_key(key) -> Ed25519PrivateKey:
    if isinstance(key, Ed25519PrivateKey):
        return key
    try:
        return Ed25519PrivateKey.from_private_bytes(_raw(key))
    except ValueError as e:
        raise DeltaError(f"bad ed25519 private key: {e}") from None


class KeyRing:
    """Several accepted public keys (key rotation: old and new during a window); verifies with any."""

    def __init__(self, keys: list[Ed25519PublicKey]):
        if not keys:
            raise DeltaError("empty public key list")
        self.keys = keys

    def verify(self, signature: bytes, data: bytes) -> None:
        for k in self.keys:
            try:
                return k.verify(signature, data)
            except InvalidSignature:
                continue
        raise InvalidSignature()


def public_key(key) -> Ed25519PublicKey | KeyRing:
    """One key (object, raw bytes, hex) or several: a list, or hex keys separated by commas or
    whitespace (a key file with one key per line) -> a KeyRing accepting any of them."""
    if isinstance(key, (Ed25519PublicKey, KeyRing)):
        return key
    if isinstance(key, str) and len(key.replace(",", " ").split()) > 1:
        key = key.replace(",", " ").split()
    if isinstance(key, (list, tuple)):
        return KeyRing([public_key(k) for k in key])
    try:
        return Ed25519PublicKey.from_public_bytes(_raw(key))
    except ValueError as e:
        raise DeltaError(f"bad ed25519 public key: {e}") from None


def generate_keypair() -> tuple[bytes, bytes]:
    """-> (private, public), both raw 32 bytes."""
    sk = Ed25519PrivateKey.generate()
    raw = serialization.Encoding.Raw
    return (
        sk.private_bytes(raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()),
        sk.public_key().public_bytes(raw, serialization.PublicFormat.Raw),
    )


def sign(key, data) -> bytes:
    return private_key(key).sign(bytes(data))


def verify(key, data, signature: bytes) -> None:
    """Raises DeltaError unless `signature` is `key`'s signature of `data`."""
    try:
        public_key(key).verify(bytes(signature), bytes(data))
    except InvalidSignature:
        raise DeltaError(
            "signature does not verify with the given public key (wrong key or altered payload)"
        ) from None
