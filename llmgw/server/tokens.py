"""Join and admin tokens: made on first start, handed out as files, held by the server as hashes.

The plain token lives only in a 0600 file that the operator copies to where it is needed (an
agent's ``join_token_file``, ctl's context). The server keeps its SHA-256 in the store and in
memory and compares digests in constant time, so neither a copy of the database nor a memory dump
of the server gives a token that works.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

TOKEN_BYTES = 32


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def matches(token: str, expected_digest: bytes) -> bool:
    return hmac.compare_digest(digest(token), expected_digest)


def read_token_file(path: Path) -> str:
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{path} is empty")
    return token


def ensure_token_file(path: Path) -> str:
    """The token in ``path``, after writing a new random one (0600) if the file does not exist."""
    try:
        return read_token_file(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(TOKEN_BYTES)
    # O_EXCL: two servers starting at once on one data dir must not hand out different tokens.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token_file(path)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
