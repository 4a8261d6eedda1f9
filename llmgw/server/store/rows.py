"""The store's rows, as both backends read and write them, and the tables they live in.

JSON columns stay text here: decoding them is the caller's business, so a row read from one
backend is byte-for-byte what the other stores.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class NodeRow:
    name: str
    agent_version: str
    inventory: str  # JSON text; decoding it is the caller's business
    state: str
    first_seen: float
    last_seen: float
    state_since: float


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


@attrs.frozen
class TenantRow:
    name: str
    limits: str  # JSON text
    created: float


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
    # The adapter the request named ('' for the base model); ``model`` is then its base. Last,
    # with a default: journal lines written before it existed still read.
    adapter: str = ""
    # 1 when the tokens are the gateway's estimate: the engine answered without its usage. An
    # int, not a bool: both backends store it as an integer column.
    estimated: int = 0


@attrs.frozen
class JobRow:
    id: str
    node: str
    state: str
    created: float
    record: str  # JSON text; decoding it is the caller's business


@attrs.frozen
class AdapterRow:
    name: str
    model: str
    job_id: str
    created: float
    files: str  # JSON text
    gguf: int  # 0 or 1


@attrs.frozen
class AdapterChunk:
    """One piece of a stored adapter's file: its bytes from ``seq`` times the chunk size on."""

    adapter: str  # the adapter's name, or '.incoming/<job>' while a job's files are staged
    file: str
    seq: int
    data: bytes


@attrs.frozen
class JournalOffset:
    """How far one segment file of a gateway worker's usage journal has been shipped."""

    file: str  # the segment's name, <worker>.<seq>.journal
    offset: int  # bytes of it whose records are in the usage table


# What usage can be summarised by. The SQL for each is the backend's (days are UTC).
USAGE_GROUPS = ("tenant", "model", "adapter", "day")


@attrs.frozen
class Table:
    name: str
    columns: tuple[str, ...]
    key: tuple[str, ...]  # the primary key: the order a copy reads and checksums rows in
    # Rows a copy reads and writes at a time: a page of adapter chunks is megabytes per row.
    page_rows: int = 5_000


# Every table, in an order that satisfies the foreign keys (tenants before api_keys): what
# `llmgw server store copy` moves and verifies.
TABLES: tuple[Table, ...] = (
    Table("nodes", tuple(attrs.fields_dict(NodeRow)), ("name",)),
    Table("secrets", ("name", "value", "created"), ("name",)),
    Table("catalog", tuple(attrs.fields_dict(CatalogRow)), ("kind", "name")),
    Table("tenants", tuple(attrs.fields_dict(TenantRow)), ("name",)),
    Table("api_keys", tuple(attrs.fields_dict(ApiKeyRow)), ("id",)),
    Table("usage", ("id", *attrs.fields_dict(UsageRecord)), ("id",)),
    Table("jobs", tuple(attrs.fields_dict(JobRow)), ("id",)),
    Table("adapters", tuple(attrs.fields_dict(AdapterRow)), ("name",)),
    Table("adapter_chunks", tuple(attrs.fields_dict(AdapterChunk)), ("adapter", "file", "seq"), page_rows=8),
    Table("journal_offsets", tuple(attrs.fields_dict(JournalOffset)), ("file",)),
)
TABLES_BY_NAME = {table.name: table for table in TABLES}
