"""`llmgw server store copy`: every table of one store into another, verified.

The leader lease is not copied (the target starts with no leader), but its term is carried up:
agents refuse commands of a term older than one they have seen. The engine-key secret travels with the rest: engines started before the move hold keys derived
from it, and a new secret would lock the gateway out of each of them at the moment of the move.
Verification reads both stores back, table by table: the same count, and the same checksum of
the rows (order-independent, since the backends may sort text differently).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import attrs

from llmgw.server.store.base import Store, StoreError
from llmgw.server.store.rows import TABLES, Table

# Rows per read and per write transaction (Table.page_rows): a big usage table moves in short
# transactions, the adapters' chunks a few megabytes at a time.
PAGE_ROWS = 5_000
_MOD = 1 << 256


class TargetNotEmpty(StoreError):
    """The target already holds rows (and --force was not given)."""


class CopyMismatch(StoreError):
    """The target does not hold what the source does, once copied."""


@attrs.frozen
class TableCopied:
    table: str
    rows: int
    checksum: str  # hex


Progress = Callable[[str, int, int], None]  # (table, rows done, rows in all)


def row_digest(row: tuple) -> int:
    """One row's hash, the same from either backend (floats, ints, text, bytes and NULL only)."""
    parts = []
    for value in row:
        if isinstance(value, bool | int):
            parts.append(f"i{int(value)}")
        elif isinstance(value, float):
            parts.append(f"f{value!r}")
        elif isinstance(value, bytes | bytearray | memoryview):
            parts.append(f"b{bytes(value).hex()}")
        elif value is None:
            parts.append("n")
        else:
            parts.append(f"s{value}")
    return int.from_bytes(hashlib.sha256("\x00".join(parts).encode()).digest(), "big")


async def _pages(store: Store, table: Table):
    after = None
    while True:
        rows = await store.export_rows(table.name, after, min(PAGE_ROWS, table.page_rows))
        if not rows:
            return
        yield rows
        index = [table.columns.index(c) for c in table.key]
        after = tuple(rows[-1][i] for i in index)


async def table_summary(store: Store, table: Table) -> TableCopied:
    count, total = 0, 0
    async for rows in _pages(store, table):
        count += len(rows)
        total = (total + sum(row_digest(row) for row in rows)) % _MOD
    return TableCopied(table.name, count, f"{total:064x}")


async def copy_store(
    source: Store, target: Store, *, force: bool = False, progress: Progress | None = None
) -> list[TableCopied]:
    """Copies every table; returns what was verified. Refuses a target with rows unless ``force``
    (then empties it first)."""
    held = {t.name: await target.count_rows(t.name) for t in TABLES}
    if any(held.values()) and not force:
        tables = ", ".join(f"{name} ({n} rows)" for name, n in held.items() if n)
        raise TargetNotEmpty(f"{target.where} already holds rows: {tables}; give --force to replace them")
    for table in reversed(TABLES):  # children before parents: api_keys before tenants
        if held[table.name]:
            await target.delete_rows(table.name)
    for table in TABLES:
        total = await source.count_rows(table.name)
        done = 0
        async for rows in _pages(source, table):
            await target.import_rows(table.name, rows)
            done += len(rows)
            if progress is not None:
                progress(table.name, done, total)
    copied = []
    for table in TABLES:
        want, got = await table_summary(source, table), await table_summary(target, table)
        if want != got:
            raise CopyMismatch(
                f"{table.name}: the source has {want.rows} rows (checksum {want.checksum[:16]}), the target "
                f"{got.rows} ({got.checksum[:16]}); did the source change during the copy? Stop the "
                "server and copy again with --force"
            )
        copied.append(want)
    # Not a table to copy (a new store starts with no leader), but its term must not go back:
    # agents remember the newest term they have seen and would refuse every smaller one.
    await target.raise_lease_term(await source.lease_term())
    return copied
