"""The embedded backend: SQLite through apsw, at ``<data_dir>/llmgw.db`` (the default store).

The only module that imports apsw. One writer connection and one read-only connection beside it
(WAL lets the reader see the last commit while a write runs), each used by at most one worker
thread at a time. The schema version is kept in ``PRAGMA user_version``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import apsw
import trio

from llmgw.server.store.base import ConstraintViolation, SqlStore, StoreError
from llmgw.server.store.schema import MIGRATIONS, SCHEMA_VERSION, SQLITE, render

DB_FILENAME = "llmgw.db"

# Waits for a lock held by another connection (ours, or an operator's sqlite3 shell) instead of
# failing at once; our transactions are a few statements long, so 5 s means something is stuck.
BUSY_TIMEOUT_MS = 5_000


class _Tx:
    dialect = SQLITE

    def __init__(self, conn: apsw.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence = ()) -> list[tuple]:
        return [tuple(row) for row in self._conn.execute(sql, tuple(params))]

    def executemany(self, sql: str, rows: Sequence[Sequence]) -> None:
        if rows:
            self._conn.executemany(sql, [tuple(row) for row in rows])

    def changes(self) -> int:
        return self._conn.changes()


class SqliteStore(SqlStore):
    def __init__(self, writer: apsw.Connection, reader: apsw.Connection, path: Path) -> None:
        self._writer = writer
        self._reader = reader
        self.path = path
        self.where = str(path)
        self._write_limiter = trio.CapacityLimiter(1)
        self._read_limiter = trio.CapacityLimiter(1)

    @classmethod
    async def open(cls, data_dir: Path) -> SqliteStore:
        """Opens (creating and migrating as needed) the database in ``data_dir``."""
        path = data_dir / DB_FILENAME
        writer = await trio.to_thread.run_sync(open_writer, data_dir)
        try:
            reader = await trio.to_thread.run_sync(_connect, path, apsw.SQLITE_OPEN_READONLY)
        except BaseException:
            writer.close()
            raise
        return cls(writer, reader, path)

    async def _write(self, fn: Callable[..., Any], *args: Any) -> Any:
        # Not abandoned on cancel (to_thread's default): a write that has started runs to its
        # commit or rollback, so the connection is never left mid-transaction.
        return await trio.to_thread.run_sync(self._run, self._writer, fn, args, limiter=self._write_limiter)

    async def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(self._run, self._reader, fn, args, limiter=self._read_limiter)

    def _run(self, conn: apsw.Connection, fn: Callable[..., Any], args: tuple) -> Any:
        try:
            with conn:
                return fn(_Tx(conn), *args)
        except apsw.ConstraintError as e:
            raise ConstraintViolation(f"{self.path}: {e}") from e
        except apsw.Error as e:
            raise StoreError(f"{self.path}: {e}") from e

    async def aclose(self) -> None:
        # Shielded cleanup: wait for any running statement, then close. The reader closes first
        # so the writer is the last connection and checkpoints the WAL into the database file.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._reader.close, limiter=self._read_limiter)
            await trio.to_thread.run_sync(self._writer.close, limiter=self._write_limiter)


def open_writer(data_dir: Path) -> apsw.Connection:
    """The writer connection, after the files are prepared and migrations applied."""
    path = data_dir / DB_FILENAME
    _prepare_files(data_dir, path)
    conn = _connect(path, apsw.SQLITE_OPEN_READWRITE)
    try:
        # A committed write must survive kill -9 and power loss. WAL with synchronous=NORMAL
        # already survives a process crash; FULL also fsyncs the WAL at every commit so it
        # survives power loss, and our write rate is low enough not to notice the cost.
        conn.pragma("synchronous", "FULL")
        conn.pragma("foreign_keys", True)
        # IMMEDIATE takes the write lock at BEGIN, so a read-then-write transaction
        # (ensure_secret, a migration) cannot fail halfway with SQLITE_BUSY.
        conn.transaction_mode = "IMMEDIATE"
        mode = _set_wal(conn)
        if mode != "wal":
            raise StoreError(f"{path}: SQLite refused WAL mode (journal_mode is {mode!r})")
        _migrate(conn, path)
    except BaseException as e:
        conn.close()
        if isinstance(e, apsw.Error):
            raise StoreError(f"{path} is not a usable llmgw database: {e}") from e
        raise
    return conn


def _set_wal(conn: apsw.Connection) -> str:
    """journal_mode=WAL, waiting out another connection that holds the file: changing the
    journal mode can answer SQLITE_BUSY at once, without the busy handler's wait (two servers
    opening one new database file together)."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            return conn.pragma("journal_mode", "wal")
        except apsw.BusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _prepare_files(data_dir: Path, path: Path) -> None:
    """Create the data dir 0700 and the database file 0600 before SQLite touches them.

    SQLite would create the file with 0644 less the umask; it creates -wal and -shm with the
    database file's own mode, so getting the main file right covers all three. chmod rather than
    umask because umask is process-wide and other threads may be creating files meanwhile.
    """
    try:
        try:
            data_dir.mkdir(parents=True, mode=0o700)
            os.chmod(data_dir, 0o700)  # mkdir's mode is filtered through the umask
        except FileExistsError:
            pass  # an operator-made directory keeps the mode they gave it
        # O_RDWR also refuses a directory standing where the file should be.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(path, 0o600)
    except OSError as e:
        raise StoreError(f"{path}: cannot prepare the database file: {e}") from e


def _connect(path: Path, flags: int) -> apsw.Connection:
    try:
        conn = apsw.Connection(str(path), flags=flags)
    except apsw.Error as e:
        raise StoreError(f"{path}: cannot open the database: {e}") from e
    conn.set_busy_timeout(BUSY_TIMEOUT_MS)
    return conn


def _migrate(conn: apsw.Connection, path: Path) -> None:
    found = conn.pragma("user_version")
    if found > SCHEMA_VERSION:
        raise StoreError(
            f"{path} was written by a newer llmgw (schema version {found}; this llmgw knows up to "
            f"{SCHEMA_VERSION}). Upgrade llmgw, or point data_dir at another directory."
        )
    for version, sql in MIGRATIONS:
        with conn:
            # Read again under the write lock: another process may have migrated meanwhile.
            if conn.pragma("user_version") >= version:
                continue
            conn.execute(render(sql, SQLITE))
            conn.pragma("user_version", version)
