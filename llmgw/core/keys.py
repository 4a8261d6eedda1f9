"""Engine keys: each replica's engine accepts only requests carrying its own key.

A replica's key is HMAC-SHA256(secret, replica id). The secret is made once and kept in the store,
so any server process sharing that store can compute the key of a replica it never started (one it
adopted after a restart, or one another control plane placed) without a table of keys to keep in
step; and a key taken from one node opens that one replica only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

SECRET_BYTES = 32
SECRET_NAME = "engine_key_secret"  # its name in the store's secrets table


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def engine_key(secret: bytes, replica_id: str) -> str:
    return hmac.new(secret, replica_id.encode(), hashlib.sha256).hexdigest()
