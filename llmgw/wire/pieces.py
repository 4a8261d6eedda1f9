"""Files in pieces on the agent link: a job's output going to the server, an adapter going to a node.

A piece is one link message; the link caps a message at 8 MiB (MAX_MESSAGE_BYTES) and base64
grows data by 4/3, so a piece stays far below that. Smaller pieces also keep one upload from
holding the link's write lock long enough to delay a heartbeat. Each piece carries its own
sha256 and the file's FileDigest (sent before, with JobStatus Uploading) carries the whole
file's, so the server can tell a damaged piece from a damaged file.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from llmgw.core.reports import JobPiece
from llmgw.core.training import FileDigest

# 512 KiB of data is ~700 KiB of base64: a twelfth of a message's limit.
PIECE_BYTES = 512 * 1024
# How much of a file is read at once to hash it: the file is never in memory whole.
READ_BYTES = 1024 * 1024


class UploadInterrupted(Exception):
    """The link went down while a job's files were being sent; the server fails the job."""


def file_digest(path: Path) -> FileDigest:
    """Size and sha256 of the file, read in bounded chunks."""
    with open(path, "rb") as file:
        return fileobj_digest(path.name, file)


def fileobj_digest(name: str, fileobj: BinaryIO) -> FileDigest:
    """The same, of an open file from its start (the one the pieces are then read from, so a
    file swapped on its path in between cannot be announced as one and sent as another)."""
    digest = hashlib.sha256()
    size = 0
    fileobj.seek(0)
    while chunk := fileobj.read(READ_BYTES):
        digest.update(chunk)
        size += len(chunk)
    return FileDigest(name=name, size=size, sha256=digest.hexdigest())


def piece_count(size: int) -> int:
    """An empty file is still one (empty) piece, so that every announced file arrives."""
    return max(1, -(-size // PIECE_BYTES))


def iter_pieces(job_id: str, name: str, fileobj: BinaryIO) -> Iterator[JobPiece]:
    """The file's pieces in order, read one at a time from its current size."""
    fileobj.seek(0)
    size = os.fstat(fileobj.fileno()).st_size
    count = piece_count(size)
    for index in range(count):
        data = fileobj.read(PIECE_BYTES)
        yield JobPiece(
            job_id=job_id,
            file=name,
            index=index,
            count=count,
            data=base64.b64encode(data).decode("ascii"),
            sha256=hashlib.sha256(data).hexdigest(),
        )
