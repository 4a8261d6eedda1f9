"""Versioned state files: what a restarted agent reads to find what an earlier one left running.

A shard and a training job each keep one ``state.json`` (0600, root's) in their own directory:
a frozen attrs record, with a version number in front. Writes are atomic (temporary file, fsync,
rename, fsync of the directory): an agent killed mid-write leaves the old file or the new one,
never half of one. A file that is missing, of another version or not of the expected shape reads
as ValueError, saying which.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TypeVar

import cattrs

STATE_FILE = "state.json"
# An id becomes a directory name: nothing that could leave its parent directory.
_SAFE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")

_converter = cattrs.Converter(forbid_extra_keys=False)
T = TypeVar("T")


def id_problem(kind: str, value: str) -> str:
    """Why ``value`` cannot name a directory of this ``kind`` ("shard id", "job id"); "" when it can."""
    if _SAFE_ID.fullmatch(value):
        return ""
    return f"{kind} {value!r} must be 1-128 letters, digits, '.', '_' or '-', not starting with '.' or '-'"


def write(directory: Path, version: int, record: object) -> None:
    text = json.dumps({"version": version, **_converter.unstructure(record)}, indent=1)
    temporary = directory / (STATE_FILE + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temporary, directory / STATE_FILE)
    # The rename is durable once the directory is.
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read(directory: Path, version: int, cls: type[T], what: str) -> T:
    """The record of ``cls`` in ``directory``; ValueError naming the file when there is none.
    ``what`` says what the file should describe ("a shard", "a job")."""
    path = directory / STATE_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("version") != version:
        raise ValueError(f"{path} is not a version {version} state file")
    try:
        return _converter.structure(data, cls)
    except (cattrs.BaseValidationError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} does not describe {what}: {exc}") from None
