"""Checking a job's files as they arrive in pieces over the agent link.

The agent announces the files (name, size, sha256) with its Uploading status, then sends each
file's pieces in order. Every piece is checked here before the shell writes it: the right file,
the next index, a count that stays the same, the piece's own digest, and never more bytes than
the manifest says. A file is complete when its last piece brings its size and running digest to
the manifest's. Any violation is one error string: the job fails and nothing it sent is kept.

An empty file still comes as one piece (with no data), so every file's end is a piece the agent
sent on purpose. Pure: no I/O; the shell writes what :meth:`Reassembly.accept` returns.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re

from llmgw.core.reports import JobPiece
from llmgw.core.training import FileDigest

# A piece's data, decoded. Link messages are bounded at 8 MiB and base64 grows data by 4/3; a
# quarter of the bound leaves room for that and bounds what one piece makes the server buffer.
MAX_PIECE_BYTES = 2 * 1024 * 1024
# An adapter is a fraction of its model: a rank-64 adapter of a 70B model is about 1 GiB. Above
# this a manifest is a mistake or an attack on the server's disk.
MAX_TOTAL_BYTES = 8 * 1024 * 1024 * 1024
MAX_FILES = 8
# A bare file name: it becomes a path under the adapter's directory.
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class ReassemblyError(Exception):
    """A piece or a manifest that cannot be accepted; the message says which and why."""


def manifest_problems(files: tuple[FileDigest, ...]) -> list[str]:
    """What is wrong with an announced list of files (empty when it can be received)."""
    problems = []
    if not files:
        problems.append("files: the upload lists no files")
    if len(files) > MAX_FILES:
        problems.append(f"files: {len(files)} files, at most {MAX_FILES}")
    seen: set[str] = set()
    for f in files:
        if not FILE_NAME.fullmatch(f.name) or f.name in (".", ".."):
            problems.append(f"files: {f.name!r} is not a bare file name")
        if f.name in seen:
            problems.append(f"files: {f.name} listed twice")
        seen.add(f.name)
        if f.size < 0:
            problems.append(f"files: {f.name} has a negative size {f.size}")
        if not SHA256_HEX.fullmatch(f.sha256):
            problems.append(f"files: {f.name} has no hex sha256 ({f.sha256[:80]!r})")
    total = sum(max(0, f.size) for f in files)
    if total > MAX_TOTAL_BYTES:
        problems.append(f"files: {total} bytes in all, at most {MAX_TOTAL_BYTES}")
    return problems


class Reassembly:
    """The state of one job's upload: which file and piece come next, and each file's digest."""

    def __init__(self, files: tuple[FileDigest, ...]) -> None:
        problems = manifest_problems(files)
        if problems:
            raise ReassemblyError("; ".join(problems))
        self.files = files
        self._current = 0  # index into files of the file being received
        self._next_index = 0
        self._count: int | None = None  # the current file's piece count, from its first piece
        self._received = 0  # bytes of the current file so far
        self._digest = hashlib.sha256()

    @property
    def done(self) -> bool:
        return self._current == len(self.files)

    @property
    def received_bytes(self) -> int:
        return sum(f.size for f in self.files[: self._current]) + self._received

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def accept(self, piece: JobPiece) -> bytes:
        """The piece's bytes, to append to ``piece.file``; raises ReassemblyError when the piece
        does not fit. After the last piece of the last file, ``done`` is true."""
        if self.done:
            raise ReassemblyError(f"piece {piece.index} of {piece.file} after every file was complete")
        expected = self.files[self._current]
        where = f"piece {piece.index} of {piece.file}"
        if piece.file != expected.name:
            raise ReassemblyError(f"{where}: expected a piece of {expected.name}")
        if piece.index != self._next_index:
            raise ReassemblyError(f"{where}: expected piece {self._next_index}")
        if piece.count < 1 or piece.index >= piece.count:
            raise ReassemblyError(f"{where}: count {piece.count} does not hold index {piece.index}")
        if self._count is not None and piece.count != self._count:
            raise ReassemblyError(f"{where}: count changed from {self._count} to {piece.count}")
        too_big = f"{where}: larger than {MAX_PIECE_BYTES} bytes"
        if len(piece.data) > 4 * -(-MAX_PIECE_BYTES // 3):
            raise ReassemblyError(too_big)  # before decoding it
        try:
            data = base64.b64decode(piece.data, validate=True)
        except (binascii.Error, ValueError):
            raise ReassemblyError(f"{where}: data is not base64") from None
        if len(data) > MAX_PIECE_BYTES:
            raise ReassemblyError(too_big)
        if hashlib.sha256(data).hexdigest() != piece.sha256:
            raise ReassemblyError(f"{where}: sha256 of the piece does not match")
        if self._received + len(data) > expected.size:
            raise ReassemblyError(
                f"{where}: {self._received + len(data)} bytes, more than the announced {expected.size}"
            )
        self._count = piece.count
        self._received += len(data)
        self._digest.update(data)
        self._next_index += 1
        if self._next_index == piece.count:
            self._finish_file(expected)
        return data

    def _finish_file(self, expected: FileDigest) -> None:
        if self._received != expected.size:
            raise ReassemblyError(
                f"{expected.name}: ended at {self._received} bytes, announced {expected.size}"
            )
        if self._digest.hexdigest() != expected.sha256:
            raise ReassemblyError(f"{expected.name}: sha256 of the file does not match the announced one")
        self._current += 1
        self._next_index = 0
        self._count = None
        self._received = 0
        self._digest = hashlib.sha256()
