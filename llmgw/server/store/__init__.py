"""The server's store: one interface (:class:`Store`), two backends.

- SQLite (``sqlite.py``, the only apsw importer): embedded in ``<data_dir>/llmgw.db``, the
  default, so the quickstart stays one command.
- PostgreSQL (``postgres.py``, the only psycopg importer): ``store: postgresql://...`` in
  server.yaml, for control planes that share one database.

Both run the same operations (``ops.py``) on the same schema (``schema.py``, one numbered list of
migrations); the rows are in ``rows.py``. Backends are imported only when opened, so a server on
SQLite never loads psycopg.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.server.store.base import ConstraintViolation, SqlStore, Store, StoreError
from llmgw.server.store.rows import (
    CATALOG_KINDS,
    CATALOG_SOURCES,
    TABLES,
    USAGE_GROUPS,
    AdapterChunk,
    AdapterRow,
    ApiKeyRow,
    CatalogRow,
    JobRow,
    JournalOffset,
    NodeRow,
    TenantRow,
    UsageRecord,
)

# Where a PostgreSQL password comes from when server.yaml names no store_password_file.
PASSWORD_ENV = "LLMGW_STORE_PASSWORD"


def read_password(password_file: Path | None, env: str = PASSWORD_ENV) -> str | None:
    """The password from ``password_file`` (its first line), else from ``$env``, else None (libpq's
    own ~/.pgpass or PGPASSWORD may still supply one)."""
    if password_file is not None:
        try:
            return password_file.read_text().splitlines()[0] if password_file.stat().st_size else ""
        except OSError as e:
            raise StoreError(f"store password file {password_file}: {e.strerror}") from None
    return os.environ.get(env)


async def open_store(data_dir: Path, url: str | None = None, password: str | None = None) -> Store:
    """SQLite in ``data_dir`` when ``url`` is None, else the PostgreSQL database it names."""
    if url is None:
        from llmgw.server.store.sqlite import SqliteStore

        return await SqliteStore.open(data_dir)
    from llmgw.server.store.postgres import PostgresStore

    return await PostgresStore.open(url, password)


__all__ = [
    "CATALOG_KINDS",
    "CATALOG_SOURCES",
    "PASSWORD_ENV",
    "TABLES",
    "USAGE_GROUPS",
    "AdapterChunk",
    "AdapterRow",
    "ApiKeyRow",
    "CatalogRow",
    "ConstraintViolation",
    "JobRow",
    "JournalOffset",
    "NodeRow",
    "SqlStore",
    "Store",
    "StoreError",
    "TenantRow",
    "UsageRecord",
    "open_store",
    "read_password",
]
