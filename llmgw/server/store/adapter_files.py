"""The adapters' files, kept in the store as well as in ``<data_dir>/adapters/<name>/``.

The store is where an adapter lives: its row and its files' bytes (table ``adapter_chunks``), so
`llmgw server store copy` moves both, verified like every table, and a server whose data_dir
lacks the files (a new machine, another server on a shared store) rebuilds them from the store
before it delivers them. The directory stays the copy that deliveries and downloads read, written
only from bytes whose size and sha256 match the adapter's manifest.

At start (and before a copy) the two are brought together, per adapter:

- bytes in the store, files on disk: nothing to do;
- bytes in the store only: the files are written from them (verified against the manifest);
- files on disk only (an adapter kept before the store held bytes): the files, verified, go
  into the store under a staging name that one transaction renames to the adapter's;
- neither: reported; the adapter stays listed, and its deliveries fail saying why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path

import trio

from llmgw.core.training import FileDigest
from llmgw.server.store.base import Store, StoreError

log = logging.getLogger(__name__)

# One chunk is one row; a write transaction holds CHUNKS_PER_WRITE of them (8 MiB).
CHUNK_BYTES = 1 << 20
CHUNKS_PER_WRITE = 8


class AdapterFilesError(StoreError):
    """An adapter's bytes are not what its manifest says (or are nowhere)."""


def job_staging(job_id: str) -> str:
    """Where a job's files wait in the store until finish_job names them after the adapter."""
    return f".incoming/{job_id}"


def _backfill_staging(name: str) -> str:
    # A token of its own: two servers sharing a store may backfill the same adapter at once.
    return f".backfill/{name}/{secrets.token_hex(4)}"


def files_present(directory: Path, files: Sequence[FileDigest]) -> bool:
    """Each file there with its manifest's size (what a delivery checks before it sends)."""
    for digest in files:
        try:
            if (directory / digest.name).stat().st_size != digest.size:
                return False
        except OSError:
            return False
    return True


def stored(sizes: dict[tuple[str, str], tuple[int, int]], name: str, files: Sequence[FileDigest]) -> bool:
    """Whether the store holds as many bytes of each file as the manifest says (the sha256 is
    checked when they are read back)."""
    return all(sizes.get((name, f.name), (0, 0))[1] == f.size for f in files)


async def put_files(store: Store, staged: str, directory: Path, files: Sequence[FileDigest]) -> None:
    """Writes ``directory``'s files into the store under ``staged``, a few chunks per
    transaction; raises AdapterFilesError when a file does not match its manifest (then nothing
    staged is left behind)."""
    try:
        for digest in files:
            await _put_file(store, staged, directory / digest.name, digest)
    except BaseException:
        with trio.CancelScope(shield=True):
            await store.delete_chunks(staged)
        raise


async def _put_file(store: Store, staged: str, path: Path, digest: FileDigest) -> None:
    try:
        fileobj = await trio.to_thread.run_sync(open, path, "rb")
    except OSError as e:
        raise AdapterFilesError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        sha, size, seq = hashlib.sha256(), 0, 0
        while True:
            batch = await trio.to_thread.run_sync(_read_chunks, fileobj, sha)
            if not batch:
                break
            await store.put_chunks(staged, digest.name, seq, batch)
            seq += len(batch)
            size += sum(len(chunk) for chunk in batch)
    finally:
        fileobj.close()
    if (size, sha.hexdigest()) != (digest.size, digest.sha256):
        raise AdapterFilesError(
            f"{path} is {size} bytes of sha256 {sha.hexdigest()[:16]}, its manifest says "
            f"{digest.size} bytes of {digest.sha256[:16]}"
        )


def _read_chunks(fileobj, sha) -> list[bytes]:
    batch = []
    while len(batch) < CHUNKS_PER_WRITE and (chunk := fileobj.read(CHUNK_BYTES)):
        sha.update(chunk)
        batch.append(chunk)
    return batch


async def materialize(
    store: Store, name: str, files: Sequence[FileDigest], target: Path, scratch: Path
) -> None:
    """Writes adapter ``name``'s files from the store into ``target`` (created; replaced if it
    was there), by way of ``scratch`` (a fresh directory on the same file system, renamed into
    place once every file matched its manifest's size and sha256)."""
    await trio.to_thread.run_sync(_fresh_dir, scratch)
    try:
        for digest in files:
            await _write_file(store, name, digest, scratch / digest.name)
        await trio.to_thread.run_sync(_replace, scratch, target)
    except BaseException:
        await trio.to_thread.run_sync(shutil.rmtree, scratch, True)
        raise


async def _write_file(store: Store, name: str, digest: FileDigest, path: Path) -> None:
    sha, size, seq = hashlib.sha256(), 0, 0
    fd = await trio.to_thread.run_sync(lambda: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    with os.fdopen(fd, "wb") as out:
        while True:
            rows = await store.read_chunks(name, digest.name, seq, CHUNKS_PER_WRITE)
            if not rows:
                break
            for got, data in rows:
                if got != seq:
                    raise AdapterFilesError(
                        f"adapter {name}: {digest.name}: chunk {seq} is missing from the store"
                    )
                sha.update(data)
                size += len(data)
                seq += 1
            await trio.to_thread.run_sync(out.writelines, [data for _, data in rows])
        await trio.to_thread.run_sync(out.flush)
        await trio.to_thread.run_sync(os.fsync, out.fileno())
    if (size, sha.hexdigest()) != (digest.size, digest.sha256):
        raise AdapterFilesError(
            f"adapter {name}: the store holds {size} bytes of {digest.name} of sha256 "
            f"{sha.hexdigest()[:16]}, its manifest says {digest.size} bytes of {digest.sha256[:16]}"
        )


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700, parents=True)


def _replace(source: Path, target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)  # an incomplete copy: the store's bytes win
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.rename(source, target)


async def reconcile(
    store: Store,
    adapters_dir: Path,
    adapters: Sequence[tuple[str, Sequence[FileDigest]]],
    *,
    write_files: bool = True,
) -> list[str]:
    """Brings each adapter's bytes in the store and its files in ``adapters_dir`` together (see
    the module's notes); ``write_files`` False only fills the store (a copy's source). Returns
    a problem per adapter that could not be made whole; the others are whole."""
    sizes = await store.stored_file_sizes()
    problems = []
    for name, files in adapters:
        directory = adapters_dir / name
        in_store = stored(sizes, name, files)
        on_disk = await trio.to_thread.run_sync(files_present, directory, files)
        try:
            if on_disk and not in_store:
                staged = _backfill_staging(name)
                await put_files(store, staged, directory, files)
                await store.adopt_chunks(staged, name)
                log.info("adapter %s: its files are now kept in the store too", name)
            elif in_store and not on_disk and write_files:
                scratch = adapters_dir / ".incoming" / f"store-{name}"
                await materialize(store, name, files, directory, scratch)
                log.info("adapter %s: its files were written from the store into %s", name, directory)
            elif not in_store and not on_disk:
                raise AdapterFilesError(
                    f"its files are neither in the store nor complete in {directory}; it cannot be delivered"
                )
        except (AdapterFilesError, OSError) as e:
            problem = str(e) if str(e).startswith(f"adapter {name}:") else f"adapter {name}: {e}"
            log.error("%s", problem)
            problems.append(problem)
    return problems
