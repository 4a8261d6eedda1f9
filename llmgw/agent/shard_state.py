"""Shard state files: what lets a restarted agent find, adopt and describe its running shards.

One directory per shard, ``<work_dir>/shards/<shard_id>/`` (0700), holding ``state.json`` (0600)
and the processes' output files. The file is JSON:

    {"version": 1,
     "spec": {...ShardSpec...},
     "engine_key": "..." | null,
     "commands": ["ray-head", "engine"],     # the launch plan's commands, in order
     "health_port": 8000 | null,
     "processes": [{"name", "pid", "pgid", "argv", "cmdline", "start_time"}, ...],
     "compute": {"gpus": [{"index", "uuid", "used_mib"}, ...]} | null}

The engine key is kept here because an adopted engine must be health-checked (/v1/models wants
the key) before the agent is connected to a server that could tell it. It is no more exposed
than it already is: the engine's own environment (/proc/PID/environ, readable by root and the
engine user) holds it too, and this file is root's, 0600, in a 0700 directory.

Writes are atomic (temporary file, fsync, rename): an agent killed mid-write leaves the old file
or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import attrs
import cattrs

from llmgw.agent.processes import ProcessRecord
from llmgw.core.shard import ShardSpec
from llmgw.wire.messages import Compute

STATE_FILE = "state.json"
VERSION = 1
# A shard id becomes a directory name: nothing that could leave the shards directory.
_SAFE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")

_converter = cattrs.Converter(forbid_extra_keys=False)


@attrs.frozen(kw_only=True)
class ShardRecord:
    spec: ShardSpec
    engine_key: str | None = attrs.field(repr=False)
    commands: tuple[str, ...]
    health_port: int | None
    processes: tuple[ProcessRecord, ...] = ()
    compute: Compute | None = None


def id_problem(shard_id: str) -> str:
    """Why ``shard_id`` cannot name a shard directory; "" when it can."""
    if _SAFE_ID.fullmatch(shard_id):
        return ""
    return (
        f"shard id {shard_id!r} must be 1-128 letters, digits, '.', '_' or '-', not starting with '.' or '-'"
    )


def shard_dir(shards_dir: Path, shard_id: str) -> Path:
    return shards_dir / shard_id


def make_dirs(shards_dir: Path, shard_id: str) -> Path:
    """A fresh, empty directory for the shard (any leftover of an earlier run is removed)."""
    shards_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(shards_dir, 0o700)
    directory = shard_dir(shards_dir, shard_id)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(mode=0o700)
    return directory


def write(directory: Path, record: ShardRecord) -> None:
    data = {"version": VERSION, **_converter.unstructure(record)}
    text = json.dumps(data, indent=1)
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


def read(directory: Path) -> ShardRecord:
    """Raises ValueError when the file is missing or cannot be understood."""
    try:
        data = json.loads((directory / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {directory / STATE_FILE}: {exc}") from None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise ValueError(f"{directory / STATE_FILE} is not a version {VERSION} state file")
    try:
        return _converter.structure(data, ShardRecord)
    except (cattrs.BaseValidationError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{directory / STATE_FILE} does not describe a shard: {exc}") from None


def read_all(shards_dir: Path) -> list[tuple[Path, ShardRecord | ValueError]]:
    """Every shard directory, with its record or why it has none."""
    if not shards_dir.is_dir():
        return []
    found: list[tuple[Path, ShardRecord | ValueError]] = []
    for directory in sorted(shards_dir.iterdir()):
        if not directory.is_dir():
            continue
        try:
            found.append((directory, read(directory)))
        except ValueError as exc:
            found.append((directory, exc))
    return found


def remove(directory: Path) -> None:
    """The shard's state and output files go with it."""
    shutil.rmtree(directory, ignore_errors=True)
