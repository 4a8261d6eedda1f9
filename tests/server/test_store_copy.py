"""`llmgw server store copy`: SQLite into a real PostgreSQL (the session's throwaway cluster),
every table, verified; the engine keys of running replicas survive the move."""

from __future__ import annotations

import pytest

from llmgw.core import keys
from llmgw.server.store import (
    TABLES,
    AdapterRow,
    ApiKeyRow,
    CatalogRow,
    JobRow,
    NodeRow,
    TenantRow,
    UsageRecord,
    open_store,
)
from llmgw.server.store import copy as store_copy
from llmgw.server.store.copy import CopyMismatch, TargetNotEmpty, copy_store, table_summary

USAGE_ROWS = 12


async def fill(store) -> bytes:
    """A row or more in every table; the engine-key secret as a server's first start makes it."""
    secret = await store.ensure_secret(keys.SECRET_NAME, keys.new_secret, 1.0)
    await store.put_secret("admin_token_sha256", b"\x00\x01digest", 1.0)
    await store.save_nodes([NodeRow("gpu-1", "0.1.0", '{"gpus": 8}', "online", 1.0, 2.0, 1.5)])
    await store.save_catalog_entries(
        [
            CatalogRow("model", "Qwen", '{"path": "/m"}', "config", 1.0),
            CatalogRow("profile", "q", "{}", "api", 2.0),
        ]
    )
    await store.add_tenant(TenantRow("acme", '{"rpm": 60}', 1.0))
    await store.add_api_key(ApiKeyRow("k-00000001", "acme", b"\xffsha256", "[]", 1, None, 1.0, None))
    await store.add_api_key(
        ApiKeyRow("k-00000002", "acme", b"\x00sha", '["Qwen"]', 0, '{"tpm": 5}', 2.0, 3.5)
    )
    await store.add_usage(
        [
            UsageRecord(1000.0 + i, "acme", "k-00000001", "Qwen", "r-1", i, 2 * i, 0.25 * i, 200)
            for i in range(USAGE_ROWS)
        ]
    )
    await store.save_jobs([JobRow("j-1", "gpu-1", "Training", 1.0, '{"id": "j-1"}')])
    await store.put_chunks(".incoming/j-1", "adapter.gguf", 0, [b"\x00" * 10, b"\x01\x02"])
    await store.finish_job(
        JobRow("j-1", "gpu-1", "Succeeded", 1.0, "{}"),
        AdapterRow("faq", "Qwen", "j-1", 2.0, "[]", 1),
        ".incoming/j-1",
    )
    await store.ship_journal("w0.000001.journal", [], 4096)
    return secret


@pytest.fixture
async def stores(tmp_path, pg_cluster):
    source = await open_store(tmp_path / "data")
    url = pg_cluster.url(pg_cluster.create_database())
    target = await open_store(tmp_path / "data", url, pg_cluster.password)
    yield source, target
    await target.aclose()
    await source.aclose()


async def listings(store) -> list:
    return [
        await store.list_nodes(),
        await store.list_catalog(),
        await store.list_tenants(),
        await store.list_api_keys(),
        await store.list_jobs(),
        await store.list_adapters(),
        await store.journal_offsets(),
        await store.summarise_usage(["tenant", "model", "day"], None, None),
        await store.get_secret("admin_token_sha256"),
        await store.stored_file_sizes(),
        await store.read_chunks("faq", "adapter.gguf", 0, 10),
    ]


async def test_every_table_moves_and_a_replicas_engine_key_is_unchanged(stores, monkeypatch):
    source, target = stores
    monkeypatch.setattr(store_copy, "PAGE_ROWS", 5)  # usage goes in three pages
    secret = await fill(source)
    seen = []

    copied = await copy_store(
        source, target, progress=lambda table, done, total: seen.append((table, done, total))
    )

    assert [t.table for t in copied] == [t.name for t in TABLES]
    counts = {t.table: t.rows for t in copied}
    assert counts["usage"] == USAGE_ROWS and counts["api_keys"] == 2 and counts["secrets"] == 2
    assert all(counts.values())  # nothing left behind
    assert [s for s in seen if s[0] == "usage"] == [("usage", 5, 12), ("usage", 10, 12), ("usage", 12, 12)]
    assert await listings(target) == await listings(source)

    # The gateway derives each replica's key from the store's secret: the same after the move,
    # and a server starting on the new store keeps it rather than making another.
    moved = await target.ensure_secret(keys.SECRET_NAME, keys.new_secret, 9.0)
    assert moved == secret
    for replica in ("r-1", "Qwen-q-7f3a"):
        assert keys.engine_key(moved, replica) == keys.engine_key(secret, replica)

    # Usage ids continue after the copied ones: the next record does not collide.
    await target.add_usage([UsageRecord(5000.0, "acme", "k-00000001", "Qwen", "", 1, 1, 1.0, 200)])
    assert (await target.summarise_usage([], None, None))[0]["requests"] == USAGE_ROWS + 1


async def test_a_target_with_rows_is_refused_without_force_and_replaced_with_it(stores):
    source, target = stores
    await fill(source)
    await target.add_tenant(TenantRow("stale", "{}", 1.0))
    await target.put_secret(keys.SECRET_NAME, b"a different secret", 1.0)

    with pytest.raises(TargetNotEmpty, match=r"secrets \(1 rows\), tenants \(1 rows\); give --force"):
        await copy_store(source, target)
    assert [t.name for t in await target.list_tenants()] == ["stale"]  # untouched

    await copy_store(source, target, force=True)
    assert [t.name for t in await target.list_tenants()] == ["acme"]
    assert await target.get_secret(keys.SECRET_NAME) == await source.get_secret(keys.SECRET_NAME)


async def test_the_checksum_sees_one_changed_value(stores):
    source, target = stores
    await fill(source)
    await copy_store(source, target)
    usage = next(t for t in TABLES if t.name == "usage")
    before = await table_summary(target, usage)
    assert before == await table_summary(source, usage)

    await target.add_usage([UsageRecord(1.0, "acme", "k", "m", "", 0, 0, 0.0, 200)])
    await source.add_usage([UsageRecord(1.0, "acme", "k", "m", "", 0, 0, 0.5, 200)])  # latency differs
    changed, original = await table_summary(target, usage), await table_summary(source, usage)
    assert changed.rows == original.rows and changed.checksum != original.checksum


async def test_a_source_that_changes_during_the_copy_fails_the_verification(stores):
    source, target = stores
    await fill(source)
    with pytest.raises(CopyMismatch, match="usage: the source has 13 rows .* the target 12 .*--force"):
        await copy_store(_late_writer(source), target)


def _late_writer(source):
    """A source that gains a usage record once the copy has read every page of it."""

    class Late:
        def __init__(self):
            self.where = source.where
            self.pages = 0

        def __getattr__(self, name):
            return getattr(source, name)

        async def export_rows(self, table, after, limit):
            rows = await source.export_rows(table, after, limit)
            if table == "usage" and not rows:
                self.pages += 1
                if self.pages == 1:  # the copy's last read: the verification reads again later
                    await source.add_usage([UsageRecord(9.0, "acme", "k", "m", "", 1, 1, 1.0, 200)])
            return rows

    return Late()
