"""The server's embedded store: SQLite through apsw, at ``<data_dir>/llmgw.db``.

This is the only module that imports apsw. :class:`Store` is synchronous and owns one connection;
:class:`AsyncStore` is how trio code reaches it: one writer connection and one read-only
connection, each used by at most one worker thread at a time.

The schema is a numbered list of migrations in code; the database records how far it has come in
``PRAGMA user_version``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar, TypeVarTuple

import apsw
import attrs
import trio

DB_FILENAME = "llmgw.db"

# Waits for a lock held by another connection (ours, or an operator's sqlite3 shell) instead of
# failing at once; our transactions are a few statements long, so 5 s means something is stuck.
BUSY_TIMEOUT_MS = 5_000

# (version, SQL), applied in order, each in its own transaction. Never edit a released entry: add
# a new one. Tables are STRICT so a wrong Python type fails at the write instead of being stored.
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (
        1,
        """
        CREATE TABLE nodes (
            name TEXT PRIMARY KEY,
            agent_version TEXT NOT NULL,
            inventory TEXT NOT NULL,  -- JSON, as the agent reported it
            state TEXT NOT NULL,
            first_seen REAL NOT NULL,  -- unix wall-clock seconds, like every time below
            last_seen REAL NOT NULL,
            state_since REAL NOT NULL
        ) STRICT;
        CREATE TABLE secrets (
            name TEXT PRIMARY KEY,
            value BLOB NOT NULL,
            created REAL NOT NULL
        ) STRICT;
        """,
    ),
    (
        2,
        """
        CREATE TABLE catalog (
            kind TEXT NOT NULL CHECK (kind IN ('model', 'profile')),
            name TEXT NOT NULL,
            spec TEXT NOT NULL,  -- JSON: the entry's options, as under its name in server.yaml
            source TEXT NOT NULL CHECK (source IN ('config', 'api')),
            updated REAL NOT NULL,
            PRIMARY KEY (kind, name)
        ) STRICT;
        """,
    ),
    (
        3,
        """
        CREATE TABLE tenants (
            name TEXT PRIMARY KEY,
            limits TEXT NOT NULL,  -- JSON: {"rpm": n, "tpm": n, "tpd": n}, null for unlimited
            created REAL NOT NULL
        ) STRICT;
        CREATE TABLE api_keys (
            id TEXT PRIMARY KEY,  -- public ("k-3f9a2c1d"), and also the secret's middle part
            tenant TEXT NOT NULL REFERENCES tenants (name),
            digest BLOB NOT NULL,  -- SHA-256 of the secret; the secret itself is never stored
            models TEXT NOT NULL,  -- JSON list of the model names it may use; [] for every model
            band INTEGER NOT NULL,  -- priority band of its requests
            limits TEXT,  -- JSON like tenants.limits, or NULL: only the tenant's limits apply
            created REAL NOT NULL,
            revoked REAL  -- NULL while the key works
        ) STRICT;
        CREATE INDEX api_keys_tenant ON api_keys (tenant);
        -- No foreign keys: the account outlives the tenants and keys it names.
        CREATE TABLE usage (
            id INTEGER PRIMARY KEY,
            time REAL NOT NULL,
            tenant TEXT NOT NULL,
            key_id TEXT NOT NULL,
            model TEXT NOT NULL,
            replica TEXT NOT NULL,  -- '' when the request reached no replica
            prompt_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            latency_ms REAL NOT NULL,
            status INTEGER NOT NULL  -- the HTTP status the client was given
        ) STRICT;
        CREATE INDEX usage_time ON usage (time);
        CREATE INDEX usage_tenant_time ON usage (tenant, time);
        """,
    ),
    (
        4,
        """
        -- Training jobs. The columns are what queries need; the record (JSON) is the whole job,
        -- its pairs included, so a Pending job can still be sent after a restart.
        CREATE TABLE jobs (
            id TEXT PRIMARY KEY,
            node TEXT NOT NULL,
            state TEXT NOT NULL,
            created REAL NOT NULL,
            record TEXT NOT NULL
        ) STRICT;
        CREATE INDEX jobs_created ON jobs (created);
        -- Adapters kept by the server; a row exists only once its files are complete on disk.
        CREATE TABLE adapters (
            name TEXT PRIMARY KEY,
            model TEXT NOT NULL,
            job_id TEXT NOT NULL,
            created REAL NOT NULL,
            files TEXT NOT NULL,  -- JSON list of {"name", "size", "sha256"}
            gguf INTEGER NOT NULL  -- 1 when adapter.gguf is among the files
        ) STRICT;
        """,
    ),
    (
        5,
        """
        -- How far each gateway worker's usage journal file has been shipped into usage: the
        -- records and this offset are written in one transaction, so each is shipped once.
        CREATE TABLE journal_offsets (
            file TEXT PRIMARY KEY,  -- the journal file's name, unique per worker and segment
            offset INTEGER NOT NULL  -- bytes of whole records already in usage
        ) STRICT;
        """,
    ),
)

SCHEMA_VERSION = MIGRATIONS[-1][0]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class StoreError(Exception):
    """The store cannot be opened or used; the message names the database file."""


@attrs.frozen
class NodeRow:
    name: str
    agent_version: str
    inventory: str  # JSON text; decoding it is the caller's business
    state: str
    first_seen: float
    last_seen: float
    state_since: float


_NODE_COLUMNS = "name, agent_version, inventory, state, first_seen, last_seen, state_since"

CATALOG_KINDS = ("model", "profile")
# Who owns a catalog entry: server.yaml (re-applied at every start) or the admin API.
CATALOG_SOURCES = ("config", "api")


@attrs.frozen
class CatalogRow:
    kind: str  # one of CATALOG_KINDS
    name: str
    spec: str  # JSON text; decoding it is the caller's business
    source: str  # one of CATALOG_SOURCES
    updated: float


_CATALOG_COLUMNS = "kind, name, spec, source, updated"


@attrs.frozen
class TenantRow:
    name: str
    limits: str  # JSON text
    created: float


_TENANT_COLUMNS = "name, limits, created"


@attrs.frozen
class ApiKeyRow:
    id: str
    tenant: str
    digest: bytes
    models: str  # JSON text: a list of names
    band: int
    limits: str | None  # JSON text, or None for none of its own
    created: float
    revoked: float | None


_API_KEY_COLUMNS = "id, tenant, digest, models, band, limits, created, revoked"


@attrs.frozen
class UsageRecord:
    """One request's entry in the usage account."""

    time: float  # wall-clock unix seconds when the request arrived
    tenant: str
    key_id: str
    model: str
    replica: str  # '' when the request reached no replica
    prompt_tokens: int
    completion_tokens: int
    latency_ms: float
    status: int  # the HTTP status the client was given


_USAGE_COLUMNS = "time, tenant, key_id, model, replica, prompt_tokens, completion_tokens, latency_ms, status"


@attrs.frozen
class JobRow:
    id: str
    node: str
    state: str
    created: float
    record: str  # JSON text; decoding it is the caller's business


_JOB_COLUMNS = "id, node, state, created, record"


@attrs.frozen
class AdapterRow:
    name: str
    model: str
    job_id: str
    created: float
    files: str  # JSON text
    gguf: int  # 0 or 1


_ADAPTER_COLUMNS = "name, model, job_id, created, files, gguf"

# What usage can be summarised by, as SQL. Only these reach the query text; days are UTC.
USAGE_GROUPS = {"tenant": "tenant", "model": "model", "day": "date(time, 'unixepoch')"}


class Store:
    """One apsw connection to the database. Not thread-safe: use it from one thread at a time."""

    def __init__(self, conn: apsw.Connection, path: Path) -> None:
        self._conn = conn
        self.path = path

    @classmethod
    def open(cls, data_dir: Path) -> Store:
        """Open the database for writing, creating it and applying migrations as needed."""
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
            mode = conn.pragma("journal_mode", "wal")
            if mode != "wal":
                raise StoreError(f"{path}: SQLite refused WAL mode (journal_mode is {mode!r})")
            _migrate(conn, path)
        except BaseException as e:
            conn.close()
            if isinstance(e, apsw.Error):
                raise StoreError(f"{path} is not a usable llmgw database: {e}") from e
            raise
        return cls(conn, path)

    @classmethod
    def open_reader(cls, data_dir: Path) -> Store:
        """Open a read-only connection to a database that :meth:`open` has already prepared."""
        path = data_dir / DB_FILENAME
        return cls(_connect(path, apsw.SQLITE_OPEN_READONLY), path)

    def close(self) -> None:
        self._conn.close()

    # --- nodes --------------------------------------------------------------------------------

    def save_nodes(self, rows: Sequence[NodeRow]) -> None:
        """Writes these nodes' rows as given, in one transaction. The server's registry is the
        authority on a node's times and state; the store keeps what it was told, and one
        transaction for a batch means one fsync for a whole fleet reconnecting at once."""
        with self._conn:
            self._conn.executemany(
                f"INSERT OR REPLACE INTO nodes ({_NODE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [attrs.astuple(row) for row in rows],
            )

    def list_nodes(self) -> list[NodeRow]:
        rows = self._conn.execute(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY name")
        return [NodeRow(*row) for row in rows]

    def get_node(self, name: str) -> NodeRow | None:
        row = self._conn.execute(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE name = ?", (name,)).fetchone()
        return None if row is None else NodeRow(*row)

    def delete_node(self, name: str) -> bool:
        with self._conn:
            self._conn.execute("DELETE FROM nodes WHERE name = ?", (name,))
            return self._conn.changes() == 1

    # --- catalog ------------------------------------------------------------------------------

    def list_catalog(self) -> list[CatalogRow]:
        rows = self._conn.execute(f"SELECT {_CATALOG_COLUMNS} FROM catalog ORDER BY kind, name")
        return [CatalogRow(*row) for row in rows]

    def save_catalog_entries(self, rows: Sequence[CatalogRow]) -> None:
        """Writes these entries as given, in one transaction: an apply of many entries lands
        whole or not at all."""
        with self._conn:
            self._conn.executemany(
                f"INSERT OR REPLACE INTO catalog ({_CATALOG_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                [attrs.astuple(row) for row in rows],
            )

    def save_catalog_entry(self, kind: str, name: str, spec: str, source: str, now: float) -> None:
        self.save_catalog_entries([CatalogRow(kind, name, spec, source, now)])

    def delete_catalog_entry(self, kind: str, name: str) -> bool:
        with self._conn:
            self._conn.execute("DELETE FROM catalog WHERE kind = ? AND name = ?", (kind, name))
            return self._conn.changes() == 1

    def replace_config_entries(
        self, rows: Sequence[CatalogRow], keep: Sequence[tuple[str, str]] = ()
    ) -> None:
        """Makes ``rows`` (all of source 'config') the config's entries, in one transaction.

        Config entries not among them are deleted, except those named in ``keep`` (kind, name),
        which become API entries; a row here replaces an API entry of the same name. API entries
        otherwise stay as they are.
        """
        with self._conn:
            self._conn.executemany(
                "UPDATE catalog SET source = 'api' WHERE kind = ? AND name = ? AND source = 'config'", keep
            )
            self._conn.execute("DELETE FROM catalog WHERE source = 'config'")
            self.save_catalog_entries(rows)

    # --- secrets ------------------------------------------------------------------------------

    def get_secret(self, name: str) -> bytes | None:
        row = self._conn.execute("SELECT value FROM secrets WHERE name = ?", (name,)).fetchone()
        return None if row is None else row[0]

    def put_secret(self, name: str, value: bytes, now: float) -> None:
        with self._conn:
            self._conn.execute(
                "INSERT OR REPLACE INTO secrets (name, value, created) VALUES (?, ?, ?)", (name, value, now)
            )

    def ensure_secret(self, name: str, make: Callable[[], bytes], now: float) -> bytes:
        """Return the stored secret, first storing ``make()`` if there is none. Two callers racing
        both get the value that was stored first."""
        with self._conn:
            stored = self.get_secret(name)
            if stored is None:
                stored = make()
                self._conn.execute(
                    "INSERT INTO secrets (name, value, created) VALUES (?, ?, ?)", (name, stored, now)
                )
            return stored

    # --- tenants and api keys -----------------------------------------------------------------

    def list_tenants(self) -> list[TenantRow]:
        rows = self._conn.execute(f"SELECT {_TENANT_COLUMNS} FROM tenants ORDER BY name")
        return [TenantRow(*row) for row in rows]

    def add_tenant(self, row: TenantRow) -> None:
        with self._conn:
            self._conn.execute(
                f"INSERT INTO tenants ({_TENANT_COLUMNS}) VALUES (?, ?, ?)", attrs.astuple(row)
            )

    def set_tenant_limits(self, name: str, limits: str) -> bool:
        with self._conn:
            self._conn.execute("UPDATE tenants SET limits = ? WHERE name = ?", (limits, name))
            return self._conn.changes() == 1

    def delete_tenant(self, name: str) -> bool:
        """Deletes the tenant and its keys in one transaction. Refusing while a key still works
        is the caller's decision; revoked keys only record what was."""
        with self._conn:
            self._conn.execute("DELETE FROM api_keys WHERE tenant = ?", (name,))
            self._conn.execute("DELETE FROM tenants WHERE name = ?", (name,))
            return self._conn.changes() == 1

    def list_api_keys(self) -> list[ApiKeyRow]:
        rows = self._conn.execute(f"SELECT {_API_KEY_COLUMNS} FROM api_keys ORDER BY tenant, created, id")
        return [ApiKeyRow(*row) for row in rows]

    def add_api_key(self, row: ApiKeyRow) -> None:
        with self._conn:
            self._conn.execute(
                f"INSERT INTO api_keys ({_API_KEY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                attrs.astuple(row),
            )

    def revoke_api_key(self, key_id: str, now: float) -> bool:
        """Marks a working key revoked; False when there is none of that id or it already was."""
        with self._conn:
            self._conn.execute(
                "UPDATE api_keys SET revoked = ? WHERE id = ? AND revoked IS NULL", (now, key_id)
            )
            return self._conn.changes() == 1

    # --- training jobs and adapters -----------------------------------------------------------

    def save_jobs(self, rows: Sequence[JobRow]) -> None:
        """Writes these jobs' rows as given, in one transaction (the job manager is the authority)."""
        with self._conn:
            self._conn.executemany(
                f"INSERT OR REPLACE INTO jobs ({_JOB_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                [attrs.astuple(row) for row in rows],
            )

    def list_jobs(self) -> list[JobRow]:
        rows = self._conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs ORDER BY created, id")
        return [JobRow(*row) for row in rows]

    def list_adapters(self) -> list[AdapterRow]:
        rows = self._conn.execute(f"SELECT {_ADAPTER_COLUMNS} FROM adapters ORDER BY name")
        return [AdapterRow(*row) for row in rows]

    def finish_job(self, job: JobRow, adapter: AdapterRow) -> None:
        """A job succeeded: its row and its adapter's, in one transaction, so an adapter is never
        listed without its job saying Succeeded, nor the other way round. A name already taken
        fails the whole transaction (apsw.ConstraintError, as StoreError through AsyncStore)."""
        with self._conn:
            self._conn.execute(
                f"INSERT INTO adapters ({_ADAPTER_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)", attrs.astuple(adapter)
            )
            self._conn.execute(
                f"INSERT OR REPLACE INTO jobs ({_JOB_COLUMNS}) VALUES (?, ?, ?, ?, ?)", attrs.astuple(job)
            )

    # --- usage --------------------------------------------------------------------------------

    def add_usage(self, records: Sequence[UsageRecord]) -> None:
        """Appends these records in one transaction: one fsync for a whole batch."""
        with self._conn:
            self._conn.executemany(
                f"INSERT INTO usage ({_USAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [attrs.astuple(record) for record in records],
            )

    def ship_journal(self, file: str, records: Sequence[UsageRecord], offset: int) -> None:
        """Appends a journal's records and how far that journal has now been shipped, at once."""
        with self._conn:
            self._conn.executemany(
                f"INSERT INTO usage ({_USAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [attrs.astuple(record) for record in records],
            )
            self._conn.execute(
                "INSERT INTO journal_offsets (file, offset) VALUES (?, ?)"
                " ON CONFLICT (file) DO UPDATE SET offset = excluded.offset",
                (file, offset),
            )

    def journal_offsets(self) -> dict[str, int]:
        return dict(self._conn.execute("SELECT file, offset FROM journal_offsets"))

    def forget_journal(self, file: str) -> None:
        """A journal file shipped whole and removed: its offset is no longer needed."""
        with self._conn:
            self._conn.execute("DELETE FROM journal_offsets WHERE file = ?", (file,))

    def summarise_usage(
        self, group_by: Sequence[str], since: float | None, until: float | None
    ) -> list[dict]:
        """Totals per group (``group_by`` from USAGE_GROUPS, in that order) of the records with
        ``since <= time < until``; either bound may be None. One dict per group, ordered by it:
        the group's values, then requests, prompt_tokens, completion_tokens, total_tokens,
        errors (status not 2xx or 3xx) and avg_latency_ms."""
        unknown = [name for name in group_by if name not in USAGE_GROUPS]
        if unknown:
            raise ValueError(f"cannot group usage by {', '.join(unknown)}")
        groups = [f"{USAGE_GROUPS[name]} AS {name}" for name in group_by]
        totals = [
            "count(*)",
            "total(prompt_tokens)",
            "total(completion_tokens)",
            "count(*) FILTER (WHERE status NOT BETWEEN 200 AND 399)",
            "avg(latency_ms)",
        ]
        sql = f"SELECT {', '.join(groups + totals)} FROM usage WHERE time >= ? AND time < ?"
        if group_by:
            order = ", ".join(str(i + 1) for i in range(len(group_by)))
            sql += f" GROUP BY {order} ORDER BY {order}"
        else:
            sql += " HAVING count(*) > 0"  # no records: no row, as for an empty group
        bounds = (-math.inf if since is None else since, math.inf if until is None else until)
        result = []
        for row in self._conn.execute(sql, bounds):
            requests, prompt, completion, errors, latency = row[len(group_by) :]
            result.append(
                {
                    **dict(zip(group_by, row, strict=False)),
                    "requests": requests,
                    "prompt_tokens": int(prompt),
                    "completion_tokens": int(completion),
                    "total_tokens": int(prompt + completion),
                    "errors": errors,
                    "avg_latency_ms": latency,
                }
            )
        return result


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
            conn.execute(sql)
            conn.pragma("user_version", version)


class AsyncStore:
    """Trio access to the store: one writer connection, one read-only connection beside it.

    WAL lets the reader see the last committed state while a write is in progress. Each connection
    has a CapacityLimiter(1), so only one worker thread uses it at a time. apsw errors leave here
    as StoreError so the rest of the server never needs to know about apsw.
    """

    def __init__(self, writer: Store, reader: Store) -> None:
        self._writer = writer
        self._reader = reader
        self._write_limiter = trio.CapacityLimiter(1)
        self._read_limiter = trio.CapacityLimiter(1)

    @classmethod
    async def open(cls, data_dir: Path) -> AsyncStore:
        writer = await trio.to_thread.run_sync(Store.open, data_dir)
        try:
            reader = await trio.to_thread.run_sync(Store.open_reader, data_dir)
        except BaseException:
            writer.close()
            raise
        return cls(writer, reader)

    async def write(self, fn: Callable[[Store, *Ts], T], *args: *Ts) -> T:
        """Run ``fn(store, *args)`` on the writer connection.

        Not abandoned on cancel (to_thread's default): a write that has started runs to its
        commit or rollback, and the caller sees Cancelled only after that, so the connection is
        never left mid-transaction and the limiter is released only when it is free again.
        """
        return await trio.to_thread.run_sync(
            _translate_errors, fn, self._writer, *args, limiter=self._write_limiter
        )

    async def read(self, fn: Callable[[Store, *Ts], T], *args: *Ts) -> T:
        """Run ``fn(store, *args)`` on the read-only connection; writes there fail."""
        return await trio.to_thread.run_sync(
            _translate_errors, fn, self._reader, *args, limiter=self._read_limiter
        )

    async def aclose(self) -> None:
        # Shielded cleanup: wait for any running statement, then close. The reader closes first
        # so the writer is the last connection and checkpoints the WAL into the database file.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._reader.close, limiter=self._read_limiter)
            await trio.to_thread.run_sync(self._writer.close, limiter=self._write_limiter)


def _translate_errors(fn: Callable[[Store, *Ts], T], store: Store, *args: *Ts) -> T:
    try:
        return fn(store, *args)
    except apsw.Error as e:
        raise StoreError(f"{store.path}: {e}") from e
