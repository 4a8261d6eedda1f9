"""The store's one interface (:class:`Store`), what both backends share, and their errors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from llmgw.core.leadership import Decision
from llmgw.server.store import ops
from llmgw.server.store.rows import (
    AdapterRow,
    ApiKeyRow,
    CatalogRow,
    JobRow,
    NodeRow,
    TenantRow,
    UsageRecord,
)


class StoreError(Exception):
    """The store cannot be opened or used; the message names the database (a file, or a
    PostgreSQL URL without its password)."""


class ConstraintViolation(StoreError):
    """A write broke a constraint (a name taken, a key without its tenant, a value not allowed);
    the transaction was rolled back whole."""


class Store(Protocol):
    """What the server's shells need of a store: named operations, each one transaction.

    ``where`` names the database for messages (never with a password in it).
    """

    where: str

    async def save_nodes(self, rows: Sequence[NodeRow]) -> None:
        """Writes these nodes' rows as given: the registry is the authority on a node's times and
        state, and one transaction for a batch is one fsync for a fleet reconnecting at once."""

    async def list_nodes(self) -> list[NodeRow]: ...
    async def get_node(self, name: str) -> NodeRow | None: ...
    async def delete_node(self, name: str) -> bool: ...

    async def list_catalog(self) -> list[CatalogRow]:
        """By kind, then name."""

    async def save_catalog_entries(self, rows: Sequence[CatalogRow]) -> None:
        """An apply of many entries lands whole or not at all."""

    async def save_catalog_entry(self, kind: str, name: str, spec: str, source: str, now: float) -> None: ...
    async def delete_catalog_entry(self, kind: str, name: str) -> bool: ...

    async def replace_config_entries(
        self, rows: Sequence[CatalogRow], keep: Sequence[tuple[str, str]] = ()
    ) -> None:
        """Makes ``rows`` (all of source 'config') the config's entries. Config entries not among
        them are deleted, except those named in ``keep`` (kind, name), which become API entries;
        a row here replaces an API entry of the same name."""

    async def get_secret(self, name: str) -> bytes | None: ...
    async def put_secret(self, name: str, value: bytes, now: float) -> None: ...

    async def ensure_secret(self, name: str, make: Callable[[], bytes], now: float) -> bytes:
        """The stored secret, first storing ``make()`` if there is none; racing callers (two
        servers on one PostgreSQL) all get the value stored first."""

    async def list_tenants(self) -> list[TenantRow]: ...
    async def add_tenant(self, row: TenantRow) -> None: ...
    async def set_tenant_limits(self, name: str, limits: str) -> bool: ...

    async def delete_tenant(self, name: str) -> bool:
        """The tenant and its keys, in one transaction; refusing while a key works is the caller's."""

    async def list_api_keys(self) -> list[ApiKeyRow]:
        """By tenant, created, id."""

    async def add_api_key(self, row: ApiKeyRow) -> None: ...

    async def revoke_api_key(self, key_id: str, now: float) -> bool:
        """False when there is no working key of that id."""

    async def save_jobs(self, rows: Sequence[JobRow]) -> None: ...
    async def list_jobs(self) -> list[JobRow]: ...
    async def list_adapters(self) -> list[AdapterRow]: ...

    async def finish_job(self, job: JobRow, adapter: AdapterRow, staged: str = "") -> None:
        """The job's row and its adapter's, in one transaction; a name taken fails both
        (ConstraintViolation). ``staged``: the chunks put under that name become the adapter's."""

    async def put_chunks(self, adapter: str, file: str, first_seq: int, chunks: Sequence[bytes]) -> None:
        """Adds chunks of one file of an adapter (or of a staging name), in one transaction."""

    async def read_chunks(
        self, adapter: str, file: str, first_seq: int, limit: int
    ) -> list[tuple[int, bytes]]:
        """Up to ``limit`` (seq, data) of one file, from ``first_seq`` on, in order."""

    async def stored_file_sizes(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(adapter, file) -> (chunks, bytes) of every file whose bytes the store holds."""

    async def adopt_chunks(self, staged: str, adapter: str) -> None: ...
    async def delete_chunks(self, adapter: str) -> None: ...
    async def delete_unlisted_chunks(self) -> int: ...

    async def add_usage(self, records: Sequence[UsageRecord]) -> None:
        """Appends these records in one transaction: one fsync for a whole batch."""

    async def ship_journal(self, file: str, records: Sequence[UsageRecord], offset: int) -> None:
        """Appends records read from a worker's journal segment ``file`` and records that it has
        been shipped up to byte ``offset``, in one transaction: both land, or neither."""

    async def forget_journal(self, file: str) -> None:
        """Drops a finished (deleted) segment's offset."""

    async def journal_offsets(self) -> dict[str, int]:
        """How far each segment has been shipped: its name → bytes."""

    async def summarise_usage(
        self, group_by: Sequence[str], since: float | None, until: float | None
    ) -> list[dict]:
        """Totals per group (``group_by`` from USAGE_GROUPS, in that order) of the records with
        ``since <= time < until``; either bound may be None. One dict per group, ordered by it:
        the group's values, then requests, prompt_tokens, completion_tokens, total_tokens,
        errors (status not 2xx or 3xx) and avg_latency_ms."""

    async def claim_leadership(
        self, me: str, address: str, lease: float, force: bool = False, load: str = "{}"
    ) -> tuple[Decision, dict[str, str]]:
        """Acquire, renew or follow the leader lease (core.leadership.decide, by the store's
        clock) in one compare-and-set transaction; ``me`` is recorded live with its gateway's
        ``load`` (JSON, core.shared_load). Returns the decision and the live servers (seen within
        ``lease``, ``me`` included): id → load, by id."""

    async def release_leadership(self, me: str) -> bool:
        """Frees the lease if ``me`` holds it, so a follower need not wait it out."""

    async def lease_term(self) -> int: ...

    async def raise_lease_term(self, term: int) -> None:
        """The lease's term, at least ``term`` from now on (a store copied to)."""

    async def count_rows(self, table: str) -> int: ...

    async def export_rows(self, table: str, after: tuple | None, limit: int) -> list[tuple]:
        """A page of a table's rows in key order, after the key ``after`` (for copies)."""

    async def import_rows(self, table: str, rows: Sequence[tuple]) -> None: ...
    async def delete_rows(self, table: str) -> None: ...
    async def aclose(self) -> None: ...


class SqlStore:
    """The named operations of :class:`Store`, each one of :mod:`ops` in one transaction; a
    backend supplies ``_write`` and ``_read`` (run ``fn(tx, *args)`` in a transaction that
    commits, or in a read-only one) and ``aclose``."""

    where: str

    async def _write(self, fn: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError

    async def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError

    async def save_nodes(self, rows: Sequence[NodeRow]) -> None:
        await self._write(ops.save_nodes, list(rows))

    async def list_nodes(self) -> list[NodeRow]:
        return await self._read(ops.list_nodes)

    async def get_node(self, name: str) -> NodeRow | None:
        return await self._read(ops.get_node, name)

    async def delete_node(self, name: str) -> bool:
        return await self._write(ops.delete_node, name)

    async def list_catalog(self) -> list[CatalogRow]:
        return await self._read(ops.list_catalog)

    async def save_catalog_entries(self, rows: Sequence[CatalogRow]) -> None:
        await self._write(ops.save_catalog_entries, list(rows))

    async def save_catalog_entry(self, kind: str, name: str, spec: str, source: str, now: float) -> None:
        await self._write(ops.save_catalog_entries, [CatalogRow(kind, name, spec, source, now)])

    async def delete_catalog_entry(self, kind: str, name: str) -> bool:
        return await self._write(ops.delete_catalog_entry, kind, name)

    async def replace_config_entries(
        self, rows: Sequence[CatalogRow], keep: Sequence[tuple[str, str]] = ()
    ) -> None:
        await self._write(ops.replace_config_entries, list(rows), list(keep))

    async def get_secret(self, name: str) -> bytes | None:
        return await self._read(ops.get_secret, name)

    async def put_secret(self, name: str, value: bytes, now: float) -> None:
        await self._write(ops.put_secret, name, value, now)

    async def ensure_secret(self, name: str, make: Callable[[], bytes], now: float) -> bytes:
        return await self._write(ops.ensure_secret, name, make, now)

    async def list_tenants(self) -> list[TenantRow]:
        return await self._read(ops.list_tenants)

    async def add_tenant(self, row: TenantRow) -> None:
        await self._write(ops.add_tenant, row)

    async def set_tenant_limits(self, name: str, limits: str) -> bool:
        return await self._write(ops.set_tenant_limits, name, limits)

    async def delete_tenant(self, name: str) -> bool:
        return await self._write(ops.delete_tenant, name)

    async def list_api_keys(self) -> list[ApiKeyRow]:
        return await self._read(ops.list_api_keys)

    async def add_api_key(self, row: ApiKeyRow) -> None:
        await self._write(ops.add_api_key, row)

    async def revoke_api_key(self, key_id: str, now: float) -> bool:
        return await self._write(ops.revoke_api_key, key_id, now)

    async def save_jobs(self, rows: Sequence[JobRow]) -> None:
        await self._write(ops.save_jobs, list(rows))

    async def list_jobs(self) -> list[JobRow]:
        return await self._read(ops.list_jobs)

    async def list_adapters(self) -> list[AdapterRow]:
        return await self._read(ops.list_adapters)

    async def finish_job(self, job: JobRow, adapter: AdapterRow, staged: str = "") -> None:
        await self._write(ops.finish_job, job, adapter, staged)

    async def put_chunks(self, adapter: str, file: str, first_seq: int, chunks: Sequence[bytes]) -> None:
        await self._write(ops.put_chunks, adapter, file, first_seq, list(chunks))

    async def read_chunks(
        self, adapter: str, file: str, first_seq: int, limit: int
    ) -> list[tuple[int, bytes]]:
        return await self._read(ops.read_chunks, adapter, file, first_seq, limit)

    async def stored_file_sizes(self) -> dict[tuple[str, str], tuple[int, int]]:
        return await self._read(ops.stored_file_sizes)

    async def adopt_chunks(self, staged: str, adapter: str) -> None:
        await self._write(ops.adopt_chunks, staged, adapter)

    async def delete_chunks(self, adapter: str) -> None:
        await self._write(ops.delete_chunks, adapter)

    async def delete_unlisted_chunks(self) -> int:
        return await self._write(ops.delete_unlisted_chunks)

    async def add_usage(self, records: Sequence[UsageRecord]) -> None:
        await self._write(ops.add_usage, list(records))

    async def ship_journal(self, file: str, records: Sequence[UsageRecord], offset: int) -> None:
        await self._write(ops.ship_journal, file, list(records), offset)

    async def forget_journal(self, file: str) -> None:
        await self._write(ops.forget_journal, file)

    async def journal_offsets(self) -> dict[str, int]:
        return await self._read(ops.journal_offsets)

    async def summarise_usage(
        self, group_by: Sequence[str], since: float | None, until: float | None
    ) -> list[dict]:
        return await self._read(ops.summarise_usage, list(group_by), since, until)

    async def claim_leadership(
        self, me: str, address: str, lease: float, force: bool = False, load: str = "{}"
    ) -> tuple[Decision, dict[str, str]]:
        return await self._write(ops.claim_leadership, me, address, lease, force, load)

    async def release_leadership(self, me: str) -> bool:
        return await self._write(ops.release_leadership, me)

    async def lease_term(self) -> int:
        return await self._read(ops.lease_term)

    async def raise_lease_term(self, term: int) -> None:
        await self._write(ops.raise_lease_term, term)

    async def count_rows(self, table: str) -> int:
        return await self._read(ops.count_rows, table)

    async def export_rows(self, table: str, after: tuple | None, limit: int) -> list[tuple]:
        return await self._read(ops.export_rows, table, after, limit)

    async def import_rows(self, table: str, rows: Sequence[tuple]) -> None:
        await self._write(ops.import_rows, table, list(rows))

    async def delete_rows(self, table: str) -> None:
        await self._write(ops.delete_rows, table)
