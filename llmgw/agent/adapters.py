"""The node's copies of stored adapters: received from the server in pieces, found by shards.

A profile may name an adapter the server keeps (``source``). Before such a shard starts, the
server asks (PutAdapter) whether this node holds exactly the files the engine needs; if not, it
sends them in pieces (AdapterPiece) and ends with AdapterDone. A copy lives in
``<work_dir>/adapters/<name>-<sha12>/``, where sha12 is a digest of the file list (names, sizes,
sha256): an adapter re-made under the same name, or the other engine's files of it, is another
directory, so a copy is never half one version and half another.

Nothing half-written is ever served: pieces go to ``adapters/.incoming/<dir>/`` (0700, files
0600), each checked by :class:`llmgw.core.reassembly.Reassembly`, and only a copy whose every
file verified is renamed into place, in one rename. A bad piece drops the whole incoming copy.

Who may read a copy: the engines' user, which must load it, and nobody else. The directory and
its files stay root's (when the agent is root and switches user) with the engines' group:
directory 0750, files 0640. An engine, which runs code from the internet, can then read the
adapter but not change it under the next replica that loads it; other local users see nothing.
Without a user switch the engine is the agent's own user, and the copy is 0700/0600.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import attrs
import trio

from llmgw.agent import runas
from llmgw.core import engines
from llmgw.core.reassembly import Reassembly, ReassemblyError
from llmgw.core.shard import ShardSpec
from llmgw.core.training import ADAPTER_NAME, FileDigest
from llmgw.wire.messages import AdapterPiece, JobPiece

log = logging.getLogger(__name__)

ADAPTERS_DIR = "adapters"
INCOMING_DIR = ".incoming"
# Hex digits of the file list's digest in a copy's directory name: enough to never collide
# between the versions of one adapter, short enough to read.
MANIFEST_DIGITS = 12


class NotDelivered(Exception):
    """A shard names a stored adapter of which this node holds no complete copy."""


def manifest_digest(files: tuple[FileDigest, ...]) -> str:
    """A short digest of the file list (order does not matter)."""
    lines = sorted(f"{f.name}\0{f.size}\0{f.sha256}\n" for f in files)
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:MANIFEST_DIGITS]


def copy_name(name: str, files: tuple[FileDigest, ...]) -> str:
    return f"{name}-{manifest_digest(files)}"


def engine_path(engine: str, directory: Path, files: tuple[FileDigest, ...]) -> str:
    """What the engine is given of the copy (its descriptor says): a file of it, or the directory."""
    known = engines.ENGINES.get(engine)
    if known is None:  # the shard's validation refuses it, naming the engine
        return str(directory)
    return known.adapter_path(str(directory), files)


@attrs.define(eq=False)
class _Incoming:
    name: str
    files: tuple[FileDigest, ...]
    directory: Path  # under .incoming
    reassembly: Reassembly
    error: str = ""  # set at the first bad piece; the copy is then dropped


class AdapterCache:
    """This node's adapter copies. One incoming copy per adapter name at a time: the server sends
    one adapter to a node at a time, and a new PutAdapter replaces an incoming copy left behind."""

    def __init__(self, work_dir: Path, run_as: str | None = "llmgw-engine") -> None:
        self._work_dir = work_dir
        self._run_as = run_as
        self.root = work_dir / ADAPTERS_DIR
        self.incoming_root = self.root / INCOMING_DIR
        self._incoming: dict[str, _Incoming] = {}

    def directory(self, name: str, files: tuple[FileDigest, ...]) -> Path:
        return self.root / copy_name(name, files)

    # --- receiving (the link) ----------------------------------------------------------------

    async def put(self, name: str, files: tuple[FileDigest, ...]) -> tuple[bool, str]:
        """PutAdapter: (True, "present <where the copy is>") or (True, "send"); (False, why) for
        a manifest that cannot be received."""
        problems = [] if ADAPTER_NAME.fullmatch(name) else [f"name: {name!r} is not an adapter name"]
        try:
            reassembly = Reassembly(files)
        except ReassemblyError as e:
            problems.append(str(e))
        if problems:
            return False, "; ".join(problems)
        await self._drop(name)
        target = self.directory(name, files)
        if await trio.to_thread.run_sync(_holds, target, files):
            return True, f"present {target}"
        incoming = _Incoming(
            name=name, files=files, directory=self.incoming_root / target.name, reassembly=reassembly
        )
        try:
            await trio.to_thread.run_sync(self._start_incoming, incoming.directory)
        except OSError as e:
            return False, f"cannot make {incoming.directory}: {e.strerror or e}"
        self._incoming[name] = incoming
        log.info("adapter %s: receiving %s", name, ", ".join(f"{f.name} {f.size} B" for f in files))
        return True, "send"

    async def piece(self, piece: AdapterPiece) -> None:
        """AdapterPiece: checked and appended to its file. A bad one is remembered (AdapterDone
        answers with it) and the incoming copy is dropped; later pieces of it are ignored."""
        incoming = self._incoming.get(piece.name)
        if incoming is None or incoming.error:
            return
        try:
            data = incoming.reassembly.accept(_as_job_piece(piece))
            await trio.to_thread.run_sync(_append, incoming.directory / piece.file, data)
        except ReassemblyError as e:
            incoming.error = str(e)
        except OSError as e:
            incoming.error = f"cannot write {piece.file}: {e.strerror or e}"
        if incoming.error:
            log.warning("adapter %s: %s; dropping what was received", piece.name, incoming.error)
            await trio.to_thread.run_sync(_remove, incoming.directory)

    async def done(self, name: str) -> tuple[bool, str]:
        """AdapterDone: (True, where the copy is) once every file verified and the copy was
        renamed into place; (False, why) otherwise, with nothing of it kept."""
        incoming = self._incoming.pop(name, None)
        if incoming is None:
            return False, f"no adapter {name!r} is being received (PutAdapter first)"
        if not incoming.error and not incoming.reassembly.done:
            received, total = incoming.reassembly.received_bytes, incoming.reassembly.total_bytes
            incoming.error = f"incomplete: {received} of {total} bytes arrived"
        if incoming.error:
            await trio.to_thread.run_sync(_remove, incoming.directory)
            return False, incoming.error
        target = self.directory(name, incoming.files)
        try:
            user = await trio.to_thread.run_sync(self._engine_user)
            await trio.to_thread.run_sync(_place, incoming.directory, target, user)
        except OSError as e:
            await trio.to_thread.run_sync(_remove, incoming.directory)
            return False, f"cannot put the copy in place: {e}"
        log.info("adapter %s: copy complete in %s", name, target)
        return True, str(target)

    async def abandon(self) -> None:
        """The session ended: what was being received will be sent again from the start."""
        for name in list(self._incoming):
            await self._drop(name)

    # --- serving (the supervisor) ---------------------------------------------------------------

    def resolve(self, spec: ShardSpec) -> ShardSpec:
        """``spec`` with each stored adapter's path on this node filled in; raises NotDelivered
        when a copy is missing or incomplete. Blocking: it looks at the files."""
        adapters = []
        for adapter in spec.adapters:
            if adapter.source:
                target = self.directory(adapter.source, adapter.files)
                if not adapter.files or not _holds(target, adapter.files):
                    raise NotDelivered(
                        f"adapter {adapter.name} not delivered: no complete copy of stored adapter "
                        f"{adapter.source!r} in {target}"
                    )
                adapter = attrs.evolve(adapter, path=engine_path(spec.engine, target, adapter.files))
            adapters.append(adapter)
        return attrs.evolve(spec, adapters=tuple(adapters))

    def clear_incoming(self) -> None:
        """At the agent's start: whatever an earlier agent was receiving is incomplete. Blocking."""
        _remove(self.incoming_root)

    # --- inside -------------------------------------------------------------------------------

    def _engine_user(self) -> runas.EngineUser:
        user, _note = runas.resolve(self._run_as, self._work_dir)  # the supervisor logs the note
        return user

    def _start_incoming(self, directory: Path) -> None:
        # Others may cross the adapters directory to reach a copy (by its full path), not list it.
        for path, mode in ((self.root, 0o711), (self.incoming_root, 0o700)):
            path.mkdir(mode=mode, parents=True, exist_ok=True)
            os.chmod(path, mode)
        _remove(directory)
        directory.mkdir(mode=0o700)

    async def _drop(self, name: str) -> None:
        incoming = self._incoming.pop(name, None)
        if incoming is not None:
            await trio.to_thread.run_sync(_remove, incoming.directory)


def _as_job_piece(piece: AdapterPiece) -> JobPiece:
    # Reassembly checks pieces of one upload; the adapter's name stands where a job's id does.
    return JobPiece(
        job_id=piece.name,
        file=piece.file,
        index=piece.index,
        count=piece.count,
        data=piece.data,
        sha256=piece.sha256,
    )


def _holds(directory: Path, files: tuple[FileDigest, ...]) -> bool:
    """Whether ``directory`` holds exactly these files at these sizes. Their sha256 was checked
    as they arrived; sizes now catch a copy truncated or swapped since."""
    try:
        entries = {entry.name: entry.stat(follow_symlinks=False) for entry in os.scandir(directory)}
    except OSError:
        return False
    if set(entries) != {f.name for f in files}:
        return False
    return all(
        entries[f.name].st_size == f.size and (entries[f.name].st_mode & 0o170000) == 0o100000 for f in files
    )


def _place(source: Path, target: Path, user: runas.EngineUser) -> None:
    """Makes the verified copy readable by the engines' user only, then renames it into place."""
    switch = user.switch and os.geteuid() == 0
    dir_mode, file_mode = (0o750, 0o640) if switch else (0o700, 0o600)
    for child in source.iterdir():
        if switch:
            os.chown(child, 0, user.gid)
        os.chmod(child, file_mode)
    if switch:
        os.chown(source, 0, user.gid)
    os.chmod(source, dir_mode)
    # An existing target is not a complete copy (PutAdapter would have said "present"): replace it.
    _remove(target)
    os.rename(source, target)


def _append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
