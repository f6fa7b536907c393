"""The trainer's ed25519 signing key, from config (hex or a key file)."""

from __future__ import annotations

from pathlib import Path


def load_signing_key(spec: str):
    """ed25519 private key: raw hex, or a file holding hex or a PEM (PKCS8) key; "" = unsigned."""
    if not spec:
        return None
    from delta_codec import signing

    text = Path(spec).read_text().strip() if Path(spec).is_file() else spec.strip()
    if text.startswith("-----BEGIN"):
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        return signing.private_key(load_pem_private_key(text.encode(), password=None))
    return signing.private_key(text)  # a clear DeltaError on a malformed key
