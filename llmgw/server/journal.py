"""Usage journals: each gateway worker appends its usage records to a file of its own, and the
control plane ships them into the store.

**Why a journal.** A record waiting in memory for the next batch is lost when its process is
killed. A worker writes each record to its journal with one ``write`` as the request ends — no
fsync: the page cache survives a killed process, and only a crash of the machine itself can lose
what the kernel holds — so a kill -9 of a worker or of the server loses no record.

**Exactly once.** The shipper reads each journal from where the store says it got to, takes the
whole lines only (a worker killed mid-write leaves a partial last line, completed by nobody and
never shipped: it is the one record that was not yet written), and stores those records and the
new offset in one transaction. A server killed between two shipments ships the rest next time.

**Segments.** A journal is a series of files ``<worker>.<seq>.journal``; a worker starts the next
when one passes :data:`SEGMENT_BYTES`, or when it starts again (it never appends to a file a
previous life of it may have left a partial line in). A segment that is shipped whole and has a
newer one beside it is finished: the shipper deletes it and forgets its offset.

Files are 0600 in a 0700 directory: records name tenants and keys.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

import attrs
import trio

from llmgw.server.store import Store, UsageRecord

log = logging.getLogger(__name__)

SEGMENT_BYTES = 64 * 1024 * 1024
# A shipment's most records: a store transaction stays short even after a long outage.
MAX_SHIP = 5000
SHIP_INTERVAL = 0.5
_SEGMENT = re.compile(r"^(?P<worker>[A-Za-z0-9_-]+)\.(?P<seq>\d{6,})\.journal$")


def segment_name(worker: str, seq: int) -> str:
    return f"{worker}.{seq:06d}.journal"


def parse_segment(name: str) -> tuple[str, int] | None:
    match = _SEGMENT.match(name)
    return None if match is None else (match["worker"], int(match["seq"]))


def whole_lines(data: bytes) -> tuple[list[bytes], int]:
    """The complete lines of ``data`` and how many bytes they take (a partial last line waits)."""
    end = data.rfind(b"\n") + 1
    return (data[:end].splitlines() if end else []), end


def encode(record: UsageRecord) -> bytes:
    return json.dumps(attrs.astuple(record), separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> UsageRecord:
    return UsageRecord(*json.loads(line))


def older_segments(names: Iterable[str]) -> set[str]:
    """The segments with a newer segment of the same worker beside them: nothing appends to
    those any more, so once their whole lines are shipped they are finished."""
    newest: dict[str, int] = {}
    parsed = [(name, parse_segment(name)) for name in names]
    for _, worker_seq in parsed:
        if worker_seq is not None:
            newest[worker_seq[0]] = max(newest.get(worker_seq[0], -1), worker_seq[1])
    return {name for name, ws in parsed if ws is not None and ws[1] < newest[ws[0]]}


class JournalWriter:
    """A worker's side: one ``write`` per record, a new segment past the size or at each start."""

    def __init__(self, directory: Path, worker: str) -> None:
        self._directory = directory
        self._worker = worker
        seqs = [s for _, s in filter(None, (parse_segment(p.name) for p in directory.glob(f"{worker}.*")))]
        self._seq = max(seqs, default=0)
        self._fd = -1
        self._size = 0
        self._next_segment()

    def record(self, record: UsageRecord) -> None:
        line = encode(record)
        if self._size + len(line) > SEGMENT_BYTES:
            self._next_segment()
        os.write(self._fd, line)  # O_APPEND: one write is one whole line, even beside a reader
        self._size += len(line)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _next_segment(self) -> None:
        self.close()
        self._seq += 1
        path = self._directory / segment_name(self._worker, self._seq)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self._size = 0


class JournalShipper:
    """The control plane's side: ships every worker's journal into the store, exactly once."""

    def __init__(self, store: Store, directory: Path, owner: str = "") -> None:
        """``owner``: this server's id where several servers share the store, whose workers'
        segments have the same names (w0.1.journal on each): the offsets are kept per server,
        as ``<owner>/<segment>``. '' on a store of its own (offsets named by segment alone)."""
        self._store = store
        self._directory = directory
        self._prefix = f"{owner}/" if owner else ""
        self.shipped = 0  # records, since this server started

    async def run(self) -> None:
        while True:
            await self.ship_once()
            await trio.sleep(SHIP_INTERVAL)

    async def ship_once(self) -> int:
        """Ships what the journals hold now; the number of records shipped."""
        offsets = await self._store.journal_offsets()
        names = sorted(p.name for p in self._directory.glob("*.journal") if parse_segment(p.name))
        older = older_segments(names)
        shipped = 0
        for name in names:
            path = self._directory / name
            offset = offsets.get(self._prefix + name, 0)
            while True:
                data = await trio.to_thread.run_sync(_read_from, path, offset)
                lines, _ = whole_lines(data)
                if not lines:
                    break
                lines = lines[:MAX_SHIP]
                offset += sum(len(line) + 1 for line in lines)
                records = [r for r in map(self._decode, lines) if r is not None]
                await self._store.ship_journal(self._prefix + name, records, offset)
                shipped += len(records)
            if name in older:
                if data:
                    log.warning(
                        "journal %s ends in %d bytes of a record never written whole", name, len(data)
                    )
                path.unlink(missing_ok=True)
                await self._store.forget_journal(self._prefix + name)
        self.shipped += shipped
        return shipped

    @staticmethod
    def _decode(line: bytes) -> UsageRecord | None:
        try:
            return decode(line)
        except (ValueError, TypeError) as exc:
            # Not one of ours, or damaged on disk: kept out of the account, and said.
            log.warning("skipping a usage journal line that is not a record: %s", exc)
            return None


def _read_from(path: Path, offset: int, most: int = 8 * 1024 * 1024) -> bytes:
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            return file.read(most)
    except FileNotFoundError:
        return b""
