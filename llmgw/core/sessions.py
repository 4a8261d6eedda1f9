"""Status-page sessions: which session digests are open, until when.

The browser holds a random session id in an HttpOnly cookie; the server keeps only its SHA-256,
so a memory dump of the server holds no cookie that works. Every decision takes ``now`` (wall
seconds), so the book is a plain value for tests and the shell owns the clock.
"""

from __future__ import annotations

import hashlib

import attrs

# An operator's working day: long enough not to log them out mid-incident, short enough that a
# cookie left on a shared machine stops working by the next shift.
SESSION_LIFETIME = 12 * 3600.0
# Logins are an operator's, a handful a day; past this many open sessions the oldest is dropped,
# so repeated logins cannot grow the server's memory without bound.
MAX_SESSIONS = 256


def session_digest(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode()).digest()


@attrs.define
class SessionBook:
    lifetime: float = SESSION_LIFETIME
    max_sessions: int = MAX_SESSIONS
    # digest -> wall-clock expiry; dicts keep insertion order, so the first is the oldest.
    _expiry: dict[bytes, float] = attrs.field(factory=dict, alias="_expiry")

    def __attrs_post_init__(self) -> None:
        if self.lifetime <= 0:
            raise ValueError(f"lifetime: expected seconds > 0, got {self.lifetime!r}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions: expected at least 1, got {self.max_sessions!r}")

    def open(self, digest: bytes, now: float) -> float:
        """Opens a session; returns when it expires."""
        self.prune(now)
        self._expiry.pop(digest, None)
        while len(self._expiry) >= self.max_sessions:
            del self._expiry[next(iter(self._expiry))]
        expires = now + self.lifetime
        self._expiry[digest] = expires
        return expires

    def valid(self, digest: bytes | None, now: float) -> bool:
        if digest is None:
            return False
        expires = self._expiry.get(digest)
        if expires is None:
            return False
        if now >= expires:
            del self._expiry[digest]
            return False
        return True

    def close(self, digest: bytes) -> None:
        self._expiry.pop(digest, None)

    def prune(self, now: float) -> None:
        for digest in [d for d, expires in self._expiry.items() if now >= expires]:
            del self._expiry[digest]

    def __len__(self) -> int:
        return len(self._expiry)
