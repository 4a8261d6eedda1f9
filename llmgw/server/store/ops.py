"""The store's operations, written once for both backends.

Each function takes a :class:`Tx` (one open transaction of either backend) and runs plain SQL
that SQLite and PostgreSQL both accept: ``?`` placeholders (the PostgreSQL transaction turns
them into its own), ``INSERT ... ON CONFLICT``. Lists are sorted here rather than by ``ORDER
BY``, so both backends give the same order whatever collation a PostgreSQL database was made with.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs

from llmgw.core import leadership
from llmgw.core.leadership import Decision, LeaseRow
from llmgw.server.store.rows import (
    TABLES_BY_NAME,
    USAGE_GROUPS,
    AdapterRow,
    ApiKeyRow,
    CatalogRow,
    JobRow,
    NodeRow,
    Table,
    TenantRow,
    UsageRecord,
)
from llmgw.server.store.schema import POSTGRES, SQLITE


class Tx(Protocol):
    """One transaction: it commits when the operation returns and rolls back when it raises."""

    dialect: str

    def execute(self, sql: str, params: Sequence = ()) -> list[tuple]:
        """Runs one statement; its rows (none for a statement that returns none)."""

    def executemany(self, sql: str, rows: Sequence[Sequence]) -> None: ...

    def changes(self) -> int:
        """Rows the last execute changed."""


def _cols(cls: type) -> str:
    return ", ".join(attrs.fields_dict(cls))


def _marks(n: int) -> str:
    return ", ".join("?" * n)


def _upsert(table: str, cls: type, key: tuple[str, ...]) -> str:
    names = list(attrs.fields_dict(cls))
    updates = ", ".join(f"{name} = excluded.{name}" for name in names if name not in key)
    return (
        f"INSERT INTO {table} ({', '.join(names)}) VALUES ({_marks(len(names))}) "
        f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET {updates}"
    )


_SAVE_NODE = _upsert("nodes", NodeRow, ("name",))
_SAVE_CATALOG = _upsert("catalog", CatalogRow, ("kind", "name"))
_SAVE_JOB = _upsert("jobs", JobRow, ("id",))
_ADD_USAGE = f"INSERT INTO usage ({_cols(UsageRecord)}) VALUES ({_marks(len(attrs.fields(UsageRecord)))})"

# A day as 'YYYY-MM-DD', UTC.
_DAY = {
    SQLITE: "date(time, 'unixepoch')",
    POSTGRES: "to_char(to_timestamp(time) AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
}


# --- nodes ------------------------------------------------------------------------------------


def save_nodes(tx: Tx, rows: Sequence[NodeRow]) -> None:
    tx.executemany(_SAVE_NODE, [attrs.astuple(row) for row in rows])


def list_nodes(tx: Tx) -> list[NodeRow]:
    rows = [NodeRow(*row) for row in tx.execute(f"SELECT {_cols(NodeRow)} FROM nodes")]
    return sorted(rows, key=lambda row: row.name)


def get_node(tx: Tx, name: str) -> NodeRow | None:
    rows = tx.execute(f"SELECT {_cols(NodeRow)} FROM nodes WHERE name = ?", (name,))
    return NodeRow(*rows[0]) if rows else None


def delete_node(tx: Tx, name: str) -> bool:
    tx.execute("DELETE FROM nodes WHERE name = ?", (name,))
    return tx.changes() == 1


# --- catalog ----------------------------------------------------------------------------------


def list_catalog(tx: Tx) -> list[CatalogRow]:
    rows = [CatalogRow(*row) for row in tx.execute(f"SELECT {_cols(CatalogRow)} FROM catalog")]
    return sorted(rows, key=lambda row: (row.kind, row.name))


def save_catalog_entries(tx: Tx, rows: Sequence[CatalogRow]) -> None:
    tx.executemany(_SAVE_CATALOG, [attrs.astuple(row) for row in rows])


def delete_catalog_entry(tx: Tx, kind: str, name: str) -> bool:
    tx.execute("DELETE FROM catalog WHERE kind = ? AND name = ?", (kind, name))
    return tx.changes() == 1


def replace_config_entries(tx: Tx, rows: Sequence[CatalogRow], keep: Sequence[tuple[str, str]]) -> None:
    tx.executemany(
        "UPDATE catalog SET source = 'api' WHERE kind = ? AND name = ? AND source = 'config'", list(keep)
    )
    tx.execute("DELETE FROM catalog WHERE source = 'config'")
    save_catalog_entries(tx, rows)


# --- secrets ----------------------------------------------------------------------------------


def get_secret(tx: Tx, name: str) -> bytes | None:
    rows = tx.execute("SELECT value FROM secrets WHERE name = ?", (name,))
    return bytes(rows[0][0]) if rows else None


def put_secret(tx: Tx, name: str, value: bytes, now: float) -> None:
    tx.execute(
        "INSERT INTO secrets (name, value, created) VALUES (?, ?, ?) "
        "ON CONFLICT (name) DO UPDATE SET value = excluded.value, created = excluded.created",
        (name, value, now),
    )


def ensure_secret(tx: Tx, name: str, make: Callable[[], bytes], now: float) -> bytes:
    stored = get_secret(tx, name)
    if stored is not None:
        return stored
    # Another server sharing the store may insert first: its value wins, and is read back.
    tx.execute(
        "INSERT INTO secrets (name, value, created) VALUES (?, ?, ?) ON CONFLICT (name) DO NOTHING",
        (name, make(), now),
    )
    stored = get_secret(tx, name)
    assert stored is not None
    return stored


# --- tenants and api keys -----------------------------------------------------------------------


def list_tenants(tx: Tx) -> list[TenantRow]:
    rows = [TenantRow(*row) for row in tx.execute(f"SELECT {_cols(TenantRow)} FROM tenants")]
    return sorted(rows, key=lambda row: row.name)


def add_tenant(tx: Tx, row: TenantRow) -> None:
    tx.execute(f"INSERT INTO tenants ({_cols(TenantRow)}) VALUES ({_marks(3)})", attrs.astuple(row))


def set_tenant_limits(tx: Tx, name: str, limits: str) -> bool:
    tx.execute("UPDATE tenants SET limits = ? WHERE name = ?", (limits, name))
    return tx.changes() == 1


def delete_tenant(tx: Tx, name: str) -> bool:
    tx.execute("DELETE FROM api_keys WHERE tenant = ?", (name,))
    tx.execute("DELETE FROM tenants WHERE name = ?", (name,))
    return tx.changes() == 1


def list_api_keys(tx: Tx) -> list[ApiKeyRow]:
    rows = [
        ApiKeyRow(*row[:2], bytes(row[2]), *row[3:])
        for row in tx.execute(f"SELECT {_cols(ApiKeyRow)} FROM api_keys")
    ]
    return sorted(rows, key=lambda row: (row.tenant, row.created, row.id))


def add_api_key(tx: Tx, row: ApiKeyRow) -> None:
    tx.execute(f"INSERT INTO api_keys ({_cols(ApiKeyRow)}) VALUES ({_marks(8)})", attrs.astuple(row))


def revoke_api_key(tx: Tx, key_id: str, now: float) -> bool:
    tx.execute("UPDATE api_keys SET revoked = ? WHERE id = ? AND revoked IS NULL", (now, key_id))
    return tx.changes() == 1


# --- training jobs and adapters -------------------------------------------------------------------


def save_jobs(tx: Tx, rows: Sequence[JobRow]) -> None:
    tx.executemany(_SAVE_JOB, [attrs.astuple(row) for row in rows])


def list_jobs(tx: Tx) -> list[JobRow]:
    rows = [JobRow(*row) for row in tx.execute(f"SELECT {_cols(JobRow)} FROM jobs")]
    return sorted(rows, key=lambda row: (row.created, row.id))


def list_adapters(tx: Tx) -> list[AdapterRow]:
    rows = [AdapterRow(*row) for row in tx.execute(f"SELECT {_cols(AdapterRow)} FROM adapters")]
    return sorted(rows, key=lambda row: row.name)


def finish_job(tx: Tx, job: JobRow, adapter: AdapterRow, staged: str = "") -> None:
    tx.execute(f"INSERT INTO adapters ({_cols(AdapterRow)}) VALUES ({_marks(6)})", attrs.astuple(adapter))
    if staged:
        adopt_chunks(tx, staged, adapter.name)
    save_jobs(tx, [job])


def put_chunks(tx: Tx, adapter: str, file: str, first_seq: int, chunks: Sequence[bytes]) -> None:
    tx.executemany(
        "INSERT INTO adapter_chunks (adapter, file, seq, data) VALUES (?, ?, ?, ?)",
        [(adapter, file, first_seq + i, bytes(data)) for i, data in enumerate(chunks)],
    )


def read_chunks(tx: Tx, adapter: str, file: str, first_seq: int, limit: int) -> list[tuple[int, bytes]]:
    rows = tx.execute(
        "SELECT seq, data FROM adapter_chunks WHERE adapter = ? AND file = ? AND seq >= ? "
        "ORDER BY seq LIMIT ?",
        (adapter, file, first_seq, limit),
    )
    return [(int(seq), bytes(data)) for seq, data in rows]


def stored_file_sizes(tx: Tx) -> dict[tuple[str, str], tuple[int, int]]:
    """(adapter, file) -> (chunks, bytes) of every file the store holds bytes of."""
    rows = tx.execute(
        "SELECT adapter, file, count(*), sum(length(data)) FROM adapter_chunks GROUP BY adapter, file"
    )
    return {(adapter, file): (int(n), int(size)) for adapter, file, n, size in rows}


def adopt_chunks(tx: Tx, staged: str, adapter: str) -> None:
    """The chunks staged under ``staged`` become ``adapter``'s, replacing any it had."""
    tx.execute("DELETE FROM adapter_chunks WHERE adapter = ?", (adapter,))
    tx.execute("UPDATE adapter_chunks SET adapter = ? WHERE adapter = ?", (adapter, staged))


def delete_chunks(tx: Tx, adapter: str) -> None:
    tx.execute("DELETE FROM adapter_chunks WHERE adapter = ?", (adapter,))


def delete_unlisted_chunks(tx: Tx) -> int:
    """Removes chunks no adapter row names (staged by a job that never finished); how many."""
    rows = tx.execute(
        "DELETE FROM adapter_chunks WHERE adapter NOT IN (SELECT name FROM adapters) RETURNING seq"
    )
    return len(rows)


# --- usage ------------------------------------------------------------------------------------


def add_usage(tx: Tx, records: Sequence[UsageRecord]) -> None:
    tx.executemany(_ADD_USAGE, [attrs.astuple(record) for record in records])


def ship_journal(tx: Tx, file: str, records: Sequence[UsageRecord], offset: int) -> None:
    add_usage(tx, records)
    tx.execute(
        'INSERT INTO journal_offsets (file, "offset") VALUES (?, ?) '
        'ON CONFLICT (file) DO UPDATE SET "offset" = excluded."offset"',
        (file, offset),
    )


def forget_journal(tx: Tx, file: str) -> None:
    tx.execute("DELETE FROM journal_offsets WHERE file = ?", (file,))


def journal_offsets(tx: Tx) -> dict[str, int]:
    return {file: int(offset) for file, offset in tx.execute('SELECT file, "offset" FROM journal_offsets')}


def summarise_usage(tx: Tx, group_by: Sequence[str], since: float | None, until: float | None) -> list[dict]:
    unknown = [name for name in group_by if name not in USAGE_GROUPS]
    if unknown:
        raise ValueError(f"cannot group usage by {', '.join(unknown)}")
    expressions = {"tenant": "tenant", "model": "model", "adapter": "adapter", "day": _DAY[tx.dialect]}
    groups = [expressions[name] for name in group_by]
    totals = [
        "count(*)",
        "coalesce(sum(prompt_tokens), 0)",
        "coalesce(sum(completion_tokens), 0)",
        "count(*) FILTER (WHERE status NOT BETWEEN 200 AND 399)",
        "avg(latency_ms)",
    ]
    sql = f"SELECT {', '.join(groups + totals)} FROM usage WHERE time >= ? AND time < ?"
    if group_by:
        sql += f" GROUP BY {', '.join(str(i + 1) for i in range(len(group_by)))}"
    else:
        sql += " HAVING count(*) > 0"  # no records: no row, as for an empty group
    bounds = (-math.inf if since is None else since, math.inf if until is None else until)
    result = []
    for row in tx.execute(sql, bounds):
        requests, prompt, completion, errors, latency = row[len(group_by) :]
        result.append(
            {
                **dict(zip(group_by, row, strict=False)),
                "requests": int(requests),
                "prompt_tokens": int(prompt),
                "completion_tokens": int(completion),
                "total_tokens": int(prompt + completion),
                "errors": int(errors),
                "avg_latency_ms": float(latency),
            }
        )
    return sorted(result, key=lambda entry: [entry[name] for name in group_by])


# --- the leader lease -------------------------------------------------------------------------

# The store's clock, so that servers whose clocks disagree still agree on when a lease ends.
_NOW = {
    SQLITE: "SELECT (julianday('now') - 2440587.5) * 86400.0",
    POSTGRES: "SELECT extract(epoch FROM clock_timestamp())::float8",
}
# Holding the row for the rest of the transaction makes a claim a compare-and-set: a second
# server's claim waits, then reads what the first wrote. (SQLite's write transaction is
# IMMEDIATE: it holds the whole database already.)
_LOCK = {SQLITE: "", POSTGRES: " FOR UPDATE"}
# A server not seen for this long is dropped from the servers table (it is long since not live).
_FORGET_SERVER_AFTER = 24 * 3600.0


def _lease_row(tx: Tx) -> LeaseRow | None:
    rows = tx.execute(
        f"SELECT holder, term, expires, address FROM leader_lease WHERE id = 1{_LOCK[tx.dialect]}"
    )
    return LeaseRow(rows[0][0], int(rows[0][1]), float(rows[0][2]), rows[0][3]) if rows else None


def _write_lease(tx: Tx, row: LeaseRow) -> None:
    tx.execute(
        "UPDATE leader_lease SET holder = ?, term = ?, expires = ?, address = ? WHERE id = 1",
        (row.holder, row.term, row.expires, row.address),
    )


def claim_leadership(
    tx: Tx, me: str, address: str, lease: float, force: bool, load: str = "{}"
) -> tuple[Decision, dict[str, str]]:
    """Acquire, renew or follow (core.leadership.decide) in one transaction holding the lease's
    row; also records that ``me`` is live, with its gateway's ``load`` (JSON). Returns the
    decision and the live servers (seen within one lease, ``me`` included): id → load, by id."""
    now = float(tx.execute(_NOW[tx.dialect])[0][0])
    decision = leadership.decide(_lease_row(tx), now=now, me=me, address=address, lease=lease, force=force)
    if decision.write is not None:
        _write_lease(tx, decision.write)
    tx.execute(
        "INSERT INTO servers (id, address, seen, load) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (id) DO UPDATE SET address = excluded.address, seen = excluded.seen, load = excluded.load",
        (me, address, now, load),
    )
    tx.execute("DELETE FROM servers WHERE seen < ?", (now - _FORGET_SERVER_AFTER,))
    live = tx.execute("SELECT id, load FROM servers WHERE seen > ?", (now - lease,))
    return decision, dict(sorted((row[0], row[1]) for row in live))


def release_leadership(tx: Tx, me: str) -> bool:
    """Gives the lease up if ``me`` holds it (a clean stop), and leaves the live servers."""
    now = float(tx.execute(_NOW[tx.dialect])[0][0])
    freed = leadership.release(_lease_row(tx), now=now, me=me)
    if freed is not None:
        _write_lease(tx, freed)
    tx.execute("DELETE FROM servers WHERE id = ?", (me,))
    return freed is not None


def lease_term(tx: Tx) -> int:
    rows = tx.execute("SELECT term FROM leader_lease WHERE id = 1")
    return int(rows[0][0]) if rows else 0


def raise_lease_term(tx: Tx, term: int) -> None:
    """Makes the lease's term at least ``term`` (a store moved to: the agents remember the old
    store's terms, and would refuse every command of a smaller one)."""
    tx.execute("UPDATE leader_lease SET term = ? WHERE id = 1 AND term < ?", (term, term))


# --- whole tables, for `llmgw server store copy` ----------------------------------------------


def _table(name: str) -> Table:
    try:
        return TABLES_BY_NAME[name]
    except KeyError:
        raise ValueError(f"no table {name!r} in the store") from None


def count_rows(tx: Tx, table: str) -> int:
    return int(tx.execute(f"SELECT count(*) FROM {_table(table).name}")[0][0])


def export_rows(tx: Tx, table: str, after: tuple | None, limit: int) -> list[tuple]:
    """Up to ``limit`` rows of ``table`` whose key comes after ``after`` (None: from the start),
    in key order: pages a copy can read without holding one transaction for the whole table."""
    t = _table(table)
    columns = ", ".join(f'"{c}"' for c in t.columns)
    key = ", ".join(f'"{c}"' for c in t.key)
    where, params = "", ()
    if after is not None:
        where, params = f" WHERE ({key}) > ({_marks(len(t.key))})", tuple(after)
    rows = tx.execute(f"SELECT {columns} FROM {t.name}{where} ORDER BY {key} LIMIT ?", (*params, limit))
    return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in row) for row in rows]


def import_rows(tx: Tx, table: str, rows: Sequence[tuple]) -> None:
    t = _table(table)
    columns = ", ".join(f'"{c}"' for c in t.columns)
    tx.executemany(f"INSERT INTO {t.name} ({columns}) VALUES ({_marks(len(t.columns))})", list(rows))
    if tx.dialect == POSTGRES and t.name == "usage":
        # Ids were copied as they were: the identity must continue after the largest.
        tx.execute("SELECT setval(pg_get_serial_sequence('usage', 'id'), (SELECT max(id) FROM usage))")


def delete_rows(tx: Tx, table: str) -> None:
    tx.execute(f"DELETE FROM {_table(table).name}")
