"""The endpoint's bearer tokens ([worker.harness] endpoint_token_file): who may call it.

load_tokens(path)   the tokens in `path` (one a line, `#` comments), a file this uid owns that no
                    one else may read or write; a path that does not exist yet is created (0600)
                    holding a fresh token. ValueError with the reason otherwise.
fresh_token()       256 random bits, URL-safe (a launched harness's token when no file is set)
owner_of(token)     a short, stable, non-reversible name of a token: the episodes a caller
                    claimed are open to that token only
"""

from __future__ import annotations

import hashlib
import os
import secrets

MIN_TOKEN_CHARS = 16


def fresh_token() -> str:
    return secrets.token_urlsafe(32)


def owner_of(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def load_tokens(path: str) -> list[str]:
    where = f"[worker.harness] endpoint_token_file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        token = fresh_token()
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        try:
            os.link(tmp, path)  # whole or not at all, and never over another worker's token
        except FileExistsError:  # another worker made it first: read theirs
            return load_tokens(path)
        finally:
            os.unlink(tmp)
        return [token]
    except OSError as e:
        raise ValueError(f"{where}: {e.strerror or e}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid():
            raise ValueError(f"{where}: owned by uid {st.st_uid}, not this process's uid {os.geteuid()}")
        if st.st_mode & 0o077:
            raise ValueError(
                f"{where}: mode {st.st_mode & 0o777:o} lets other users read or change it (chmod 600)"
            )
        text = f.read(1 << 16)
    tokens = [x.strip() for x in text.splitlines() if x.strip() and not x.strip().startswith("#")]
    if not tokens:
        raise ValueError(f"{where}: holds no token (one a line)")
    short = [i + 1 for i, t in enumerate(tokens) if len(t) < MIN_TOKEN_CHARS or not t.isprintable()]
    if short:
        raise ValueError(
            f"{where}: token(s) on line(s) {short} are shorter than {MIN_TOKEN_CHARS} characters "
            "or not printable"
        )
    return tokens
