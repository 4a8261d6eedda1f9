"""The newest leader term this agent has seen (core/fencing.py decides with it), kept on disk.

A restarted agent must still refuse a leader older than one it obeyed before: the file is read at
start and written (atomically, 0600) each time the term grows, which is once per change of
leader — rare enough to write in the event loop's thread.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from llmgw.core import fencing

log = logging.getLogger(__name__)

TERM_FILE = "leader-term"


class TermBook:
    def __init__(self, path: Path | None = None) -> None:
        """``path`` None: kept in memory only (tests of the link alone)."""
        self._path = path
        self.newest = _read(path) if path is not None else 0

    def heard(self, term: int) -> None:
        """A server said the lease is at ``term`` (Registered, a heartbeat, an admitted command)."""
        newest = fencing.seen(self.newest, term)
        if newest != self.newest:
            log.info("leader term %d (was %d)", newest, self.newest)
            self.newest = newest
            if self._path is not None:
                _write(self._path, newest)

    def admit(self, term: int) -> fencing.Verdict:
        verdict = fencing.admit(self.newest, term)
        if verdict.ok:
            self.heard(term)
        return verdict


def _read(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except FileNotFoundError:
        return 0
    except (OSError, ValueError) as exc:
        # Refusing to start would leave the node unmanaged; 0 admits any leader, as a new agent does.
        log.warning("cannot read %s (%s); starting from term 0", path, exc)
        return 0


def _write(path: Path, term: int) -> None:
    temporary = path.with_name(path.name + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, f"{term}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
