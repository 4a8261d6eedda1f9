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

Writes are atomic (see :mod:`llmgw.agent.state_file`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import attrs

from llmgw.agent import state_file
from llmgw.agent.processes import ProcessRecord
from llmgw.core.shard import ShardSpec
from llmgw.wire.messages import Compute

VERSION = 1


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
    return state_file.id_problem("shard id", shard_id)


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
    state_file.write(directory, VERSION, record)


def read(directory: Path) -> ShardRecord:
    """Raises ValueError when the file is missing or cannot be understood."""
    return state_file.read(directory, VERSION, ShardRecord, "a shard")


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
