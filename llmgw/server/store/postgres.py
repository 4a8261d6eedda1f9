"""The shared backend: PostgreSQL through psycopg 3 and its pool, for control planes that share
one database.

The only module that imports psycopg. Every call runs in a worker thread with a connection from
the pool (psycopg's blocking API: trio has no driver of its own). The password never travels in
the URL this module is given to describe: it is passed beside it, and ``where`` (what messages
and logs name) is the URL without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import psycopg_pool
import trio
from psycopg import conninfo

from llmgw.server.store.base import ConstraintViolation, SqlStore, StoreError
from llmgw.server.store.schema import MIGRATIONS, POSTGRES, SCHEMA_VERSION, render

# Connections kept open: the server's writes are a few batches a second, its reads bursts of
# listings; four let a slow summary not hold up the usage recorder's commit.
POOL_SIZE = 4
# A database that does not answer a connect within this is down or unreachable, not slow.
CONNECT_TIMEOUT_S = 10
# Two servers starting together on one database migrate one at a time (an arbitrary constant
# that names this lock among the database's advisory locks).
MIGRATION_LOCK = 0x6C6D6777  # "lmgw"


def describe(url: str) -> str:
    """The URL as messages may show it: user, host, port and database, never a password."""
    try:
        parts = conninfo.conninfo_to_dict(url)
    except psycopg.Error:
        # The parser's message may quote the URL back, password and all.
        raise StoreError(
            "store: not a valid PostgreSQL URL (expected postgresql://user@host:port/db)"
        ) from None
    user = parts.get("user", "")
    host = parts.get("host", "")
    port = parts.get("port", "")
    return (
        f"postgresql://{user}{'@' if user else ''}{host}{':' if port else ''}{port}/{parts.get('dbname', '')}"
    )


def has_password(url: str) -> bool:
    return "password" in conninfo.conninfo_to_dict(url)


class _Tx:
    dialect = POSTGRES

    def __init__(self, cursor: psycopg.Cursor) -> None:
        self._cursor = cursor
        self._changes = 0

    def execute(self, sql: str, params: Sequence = ()) -> list[tuple]:
        self._cursor.execute(sql.replace("?", "%s"), tuple(params))
        self._changes = self._cursor.rowcount
        return self._cursor.fetchall() if self._cursor.description else []

    def executemany(self, sql: str, rows: Sequence[Sequence]) -> None:
        if rows:
            self._cursor.executemany(sql.replace("?", "%s"), [tuple(row) for row in rows])

    def changes(self) -> int:
        return self._changes


class PostgresStore(SqlStore):
    def __init__(self, pool: psycopg_pool.ConnectionPool, where: str) -> None:
        self._pool = pool
        self.where = where
        self._limiter = trio.CapacityLimiter(POOL_SIZE)

    @classmethod
    async def open(cls, url: str, password: str | None = None) -> PostgresStore:
        """Connects, applies migrations as needed, and opens the pool. ``password`` (from a file
        or the environment) goes beside the URL, so no message or log line can carry it."""
        where = describe(url)
        kwargs: dict[str, Any] = {
            "autocommit": True,  # transactions are explicit: conn.transaction()
            "connect_timeout": CONNECT_TIMEOUT_S,
            "application_name": "llmgw",
        }
        if password is not None:
            kwargs["password"] = password
        await trio.to_thread.run_sync(_prepare, url, kwargs, where)
        pool = psycopg_pool.ConnectionPool(
            url, kwargs=kwargs, min_size=1, max_size=POOL_SIZE, open=False, name="llmgw-store"
        )
        try:
            await trio.to_thread.run_sync(lambda: pool.open(wait=True, timeout=CONNECT_TIMEOUT_S))
        except psycopg_pool.PoolTimeout:
            await trio.to_thread.run_sync(pool.close)
            raise StoreError(f"{where}: no connection within {CONNECT_TIMEOUT_S} s") from None
        return cls(pool, where)

    async def _write(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(self._run, False, fn, args, limiter=self._limiter)

    async def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(self._run, True, fn, args, limiter=self._limiter)

    def _run(self, read_only: bool, fn: Callable[..., Any], args: tuple) -> Any:
        try:
            with self._pool.connection(timeout=CONNECT_TIMEOUT_S) as conn, conn.transaction():
                cursor = conn.cursor()
                if read_only:
                    cursor.execute("SET TRANSACTION READ ONLY")
                return fn(_Tx(cursor), *args)
        except psycopg.errors.IntegrityError as e:
            raise ConstraintViolation(f"{self.where}: {e}") from e
        except psycopg.Error as e:
            raise StoreError(f"{self.where}: {e}") from e
        except psycopg_pool.PoolTimeout:
            raise StoreError(f"{self.where}: no connection within {CONNECT_TIMEOUT_S} s") from None

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._pool.close)


def _prepare(url: str, kwargs: dict[str, Any], where: str) -> None:
    try:
        with psycopg.connect(url, **kwargs) as conn:
            _migrate(conn, where)
    except psycopg.Error as e:
        raise StoreError(f"{where}: cannot open the database: {e}") from e


def _migrate(conn: psycopg.Connection, where: str) -> None:
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS llmgw_schema (version INTEGER NOT NULL)")
        row = conn.execute("SELECT max(version) FROM llmgw_schema").fetchone()
        found = row[0] if row and row[0] is not None else 0
        if found > SCHEMA_VERSION:
            raise StoreError(
                f"{where} was written by a newer llmgw (schema version {found}; this llmgw knows up "
                f"to {SCHEMA_VERSION}). Upgrade llmgw, or point store at another database."
            )
        for version, sql in MIGRATIONS:
            if version > found:
                conn.execute(render(sql, POSTGRES))
        if found < SCHEMA_VERSION:
            conn.execute("DELETE FROM llmgw_schema")
            conn.execute("INSERT INTO llmgw_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
