import sqlite3
import stat
from pathlib import Path

import apsw
import attrs
import pytest
import trio

from llmgw.server.store import (
    DB_FILENAME,
    MIGRATIONS,
    SCHEMA_VERSION,
    AdapterRow,
    ApiKeyRow,
    AsyncStore,
    CatalogRow,
    JobRow,
    NodeRow,
    Store,
    StoreError,
    TenantRow,
    UsageRecord,
)
from tests.helpers import TESTS, kill_9_after

CHILD = TESTS / "store_writer_child.py"


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def store(data_dir: Path):
    s = Store.open(data_dir)
    yield s
    s.close()


def user_version(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        return conn.execute("PRAGMA user_version").fetchone()[0]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- opening and migrations -------------------------------------------------------------------


def test_migrations_are_numbered_one_to_n():
    assert [version for version, _ in MIGRATIONS] == list(range(1, len(MIGRATIONS) + 1))
    assert SCHEMA_VERSION == len(MIGRATIONS)


def test_fresh_dir_is_migrated_and_reopening_keeps_data(data_dir: Path):
    store = Store.open(data_dir)
    store.save_nodes([NodeRow("n1", "0.1.0", "{}", "online", 100.0, 100.0, 100.0)])
    store.put_secret("join-token", b"hash", 100.0)
    store.close()
    assert user_version(data_dir / DB_FILENAME) == SCHEMA_VERSION

    store = Store.open(data_dir)
    try:
        assert [n.name for n in store.list_nodes()] == ["n1"]
        assert store.get_secret("join-token") == b"hash"
    finally:
        store.close()
    assert user_version(data_dir / DB_FILENAME) == SCHEMA_VERSION


def test_newer_database_is_refused(data_dir: Path):
    Store.open(data_dir).close()
    path = data_dir / DB_FILENAME
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")

    with pytest.raises(StoreError) as info:
        Store.open(data_dir)
    message = str(info.value)
    assert str(path) in message
    assert f"schema version {SCHEMA_VERSION + 5}" in message
    assert f"knows up to {SCHEMA_VERSION}" in message
    assert user_version(path) == SCHEMA_VERSION + 5  # left as it was


def test_garbage_file_is_refused_naming_the_path(data_dir: Path):
    data_dir.mkdir()
    path = data_dir / DB_FILENAME
    path.write_bytes(b"this is not a database, it is a shopping list\n" * 100)

    with pytest.raises(StoreError, match=str(path)):
        Store.open(data_dir)


def test_files_are_private(data_dir: Path, store: Store):
    store.save_nodes([NodeRow("n1", "0.1.0", "{}", "online", 1.0, 1.0, 1.0)])  # makes sure -wal exists
    assert mode(data_dir) == 0o700
    db = data_dir / DB_FILENAME
    assert mode(db) == 0o600
    sidecars = [db.with_name(db.name + suffix) for suffix in ("-wal", "-shm")]
    assert all(p.exists() for p in sidecars)
    for p in sidecars:
        assert mode(p) == 0o600, p


def test_existing_loose_db_file_is_tightened(data_dir: Path):
    Store.open(data_dir).close()
    db = data_dir / DB_FILENAME
    db.chmod(0o644)
    Store.open(data_dir).close()
    assert mode(db) == 0o600


def test_a_version_1_database_is_migrated_and_keeps_its_data(data_dir: Path):
    # A database as the first release left it: migration 1 only.
    data_dir.mkdir()
    path = data_dir / DB_FILENAME
    with sqlite3.connect(path) as conn:
        conn.executescript(MIGRATIONS[0][1])
        conn.execute("INSERT INTO nodes VALUES ('n1', '0.1.0', '{}', 'online', 1.0, 2.0, 1.0)")
        conn.execute("INSERT INTO secrets VALUES ('engine-key', x'00ff', 1.0)")
        conn.execute("PRAGMA user_version = 1")
    conn.close()

    store = Store.open(data_dir)
    try:
        assert user_version(path) == SCHEMA_VERSION
        assert [n.name for n in store.list_nodes()] == ["n1"]
        assert store.get_secret("engine-key") == b"\x00\xff"
        assert store.list_catalog() == []
        store.save_catalog_entry("model", "m", '{"path": "m.gguf", "format": "gguf"}', "api", 3.0)
        assert store.list_catalog() == [
            CatalogRow("model", "m", '{"path": "m.gguf", "format": "gguf"}', "api", 3.0)
        ]
    finally:
        store.close()


def test_a_version_2_database_gains_tenants_keys_and_usage(data_dir: Path):
    data_dir.mkdir()
    path = data_dir / DB_FILENAME
    with sqlite3.connect(path) as conn:
        conn.executescript(MIGRATIONS[0][1] + MIGRATIONS[1][1])
        conn.execute("INSERT INTO catalog VALUES ('model', 'm', '{}', 'api', 1.0)")
        conn.execute("PRAGMA user_version = 2")
    conn.close()

    store = Store.open(data_dir)
    try:
        assert user_version(path) == SCHEMA_VERSION
        assert store.list_catalog() == [CatalogRow("model", "m", "{}", "api", 1.0)]
        assert store.list_tenants() == [] and store.list_api_keys() == []
        store.add_tenant(TenantRow("acme", '{"rpm":1}', 2.0))
        key = ApiKeyRow("k-00000001", "acme", b"digest", "[]", 0, None, 3.0, None)
        store.add_api_key(key)
        assert store.list_api_keys() == [key]
        store.add_usage([UsageRecord(4.0, "acme", "k-00000001", "m", "r", 1, 2, 3.0, 200)])
        assert store.summarise_usage(["tenant"], None, None)[0]["requests"] == 1
    finally:
        store.close()
    with sqlite3.connect(path) as conn:
        indexes = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    conn.close()
    assert {"usage_time", "usage_tenant_time"} <= indexes


# --- tenants, api keys and usage ----------------------------------------------------------------


def test_a_key_needs_its_tenant_and_revoking_is_once(store: Store):
    with pytest.raises(apsw.ConstraintError):
        store.add_api_key(ApiKeyRow("k-1", "nobody", b"d", "[]", 0, None, 1.0, None))
    store.add_tenant(TenantRow("acme", "{}", 1.0))
    store.add_api_key(ApiKeyRow("k-1", "acme", b"d", "[]", 0, None, 1.0, None))
    assert store.revoke_api_key("k-1", 5.0)
    assert not store.revoke_api_key("k-1", 6.0)
    assert store.list_api_keys()[0].revoked == 5.0
    assert store.set_tenant_limits("acme", '{"tpm":5}')
    assert not store.set_tenant_limits("nobody", "{}")
    assert store.delete_tenant("acme")  # and its key with it
    assert store.list_api_keys() == []
    assert not store.delete_tenant("acme")


def test_usage_summaries_group_only_by_known_names(store: Store):
    with pytest.raises(ValueError, match="cannot group usage by replica"):
        store.summarise_usage(["replica"], None, None)


# --- nodes ------------------------------------------------------------------------------------


def test_save_nodes_writes_rows_as_given_and_replaces_them(store: Store):
    first = NodeRow("n1", "0.1.0", '{"gpus": 1}', "online", 100.0, 150.0, 100.0)
    store.save_nodes([first])
    assert store.get_node("n1") == first

    second = NodeRow("n1", "0.2.0", '{"gpus": 2}', "lost", 100.0, 200.0, 260.0)
    other = NodeRow("n2", "0.2.0", "{}", "online", 5.0, 6.0, 7.0)
    store.save_nodes([second, other])
    assert store.list_nodes() == [second, other]


def test_list_is_ordered_by_name_and_delete_reports_existence(store: Store):
    for name in ("n3", "n1", "n2"):
        store.save_nodes([NodeRow(name, "0.1.0", "{}", "online", 1.0, 1.0, 1.0)])
    assert [n.name for n in store.list_nodes()] == ["n1", "n2", "n3"]

    assert store.delete_node("n2")
    assert not store.delete_node("n2")
    assert [n.name for n in store.list_nodes()] == ["n1", "n3"]


# --- catalog ----------------------------------------------------------------------------------


def row(kind: str, name: str, source: str, spec: str = "{}", updated: float = 1.0) -> CatalogRow:
    return CatalogRow(kind, name, spec, source, updated)


def test_catalog_rows_are_listed_by_kind_then_name_and_deleted_by_both(store: Store):
    store.save_catalog_entries(
        [row("profile", "b", "api"), row("model", "b", "api"), row("model", "a", "config")]
    )
    assert [(r.kind, r.name) for r in store.list_catalog()] == [
        ("model", "a"),
        ("model", "b"),
        ("profile", "b"),
    ]

    store.save_catalog_entry("model", "b", '{"x": 1}', "api", 2.0)
    assert store.list_catalog()[1] == row("model", "b", "api", '{"x": 1}', 2.0)

    assert store.delete_catalog_entry("model", "b")
    assert not store.delete_catalog_entry("model", "b")
    assert [(r.kind, r.name) for r in store.list_catalog()] == [("model", "a"), ("profile", "b")]


def test_catalog_rows_are_checked(store: Store):
    with pytest.raises(apsw.ConstraintError):
        store.save_catalog_entry("adapter", "x", "{}", "api", 1.0)
    with pytest.raises(apsw.ConstraintError):
        store.save_catalog_entry("model", "x", "{}", "yaml", 1.0)


def test_replace_config_entries(store: Store):
    store.save_catalog_entries(
        [
            row("model", "old", "config"),
            row("model", "used", "config"),
            row("profile", "mine", "api"),
            row("profile", "taken", "api"),
        ]
    )
    store.replace_config_entries(
        [row("model", "new", "config"), row("profile", "taken", "config", '{"band": 1}')],
        keep=[("model", "used")],
    )
    assert store.list_catalog() == [
        row("model", "new", "config"),
        row("model", "used", "api"),  # dropped from the config, kept for its users
        row("profile", "mine", "api"),
        row("profile", "taken", "config", '{"band": 1}'),  # the config took the name over
    ]


def test_replace_config_entries_is_one_transaction(store: Store):
    store.save_catalog_entries([row("model", "old", "config")])
    with pytest.raises(apsw.ConstraintError):
        store.replace_config_entries([row("model", "new", "config"), row("model", "bad", "nobody")])
    assert store.list_catalog() == [row("model", "old", "config")]


# --- secrets ----------------------------------------------------------------------------------


def test_secrets_put_replaces_and_ensure_keeps_the_first(store: Store):
    assert store.get_secret("admin-token") is None
    store.put_secret("admin-token", b"one", 1.0)
    store.put_secret("admin-token", b"two", 2.0)
    assert store.get_secret("admin-token") == b"two"

    assert store.ensure_secret("engine-key", lambda: b"first", 1.0) == b"first"
    assert store.ensure_secret("engine-key", lambda: b"second", 2.0) == b"first"
    assert store.get_secret("engine-key") == b"first"


def test_ensure_secret_does_not_call_make_when_present(store: Store):
    store.put_secret("engine-key", b"stored", 1.0)

    def make() -> bytes:
        raise AssertionError("make() called although a secret is stored")

    assert store.ensure_secret("engine-key", make, 2.0) == b"stored"


# --- trio access ------------------------------------------------------------------------------


async def test_concurrent_writes_all_land_and_reads_see_them(data_dir: Path):
    astore = await AsyncStore.open(data_dir)
    try:
        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(
                    astore.write,
                    Store.save_nodes,
                    [NodeRow(f"n{i:02}", "0.1.0", "{}", "online", 1.0, 1.0, 1.0)],
                )
                nursery.start_soon(astore.read, Store.list_nodes)

        nodes = await astore.read(Store.list_nodes)
        assert [n.name for n in nodes] == [f"n{i:02}" for i in range(50)]

        await astore.write(Store.save_nodes, [NodeRow("n07", "0.1.0", "{}", "lost", 1.0, 1.0, 2.0)])
        assert (await astore.read(Store.get_node, "n07")).state == "lost"
    finally:
        await astore.aclose()


async def test_reader_cannot_write_and_errors_are_store_errors(data_dir: Path):
    astore = await AsyncStore.open(data_dir)
    try:
        with pytest.raises(StoreError, match=str(data_dir / DB_FILENAME)):
            await astore.read(Store.put_secret, "x", b"y", 1.0)
        assert await astore.read(Store.get_secret, "x") is None
    finally:
        await astore.aclose()


# --- durability -------------------------------------------------------------------------------


@pytest.mark.slow
async def test_committed_write_survives_kill_9(data_dir: Path):
    await kill_9_after(CHILD, [str(data_dir)], b"committed\n")

    # The row must come back from the WAL the killed process left behind, not from a checkpoint.
    wal = data_dir / (DB_FILENAME + "-wal")
    assert wal.stat().st_size > 0
    store = Store.open(data_dir)
    try:
        node = store.get_node("node-killed")
    finally:
        store.close()
    assert node is not None
    assert node.state == "online"


def test_jobs_are_saved_and_a_finished_job_registers_its_adapter_in_one_transaction(store: Store):
    pending = JobRow("j-1", "n1", "Pending", 1.0, '{"id": "j-1"}')
    store.save_jobs([pending, JobRow("j-0", "n2", "Pending", 0.5, "{}")])
    store.save_jobs([JobRow("j-1", "n1", "Training", 1.0, '{"id": "j-1", "state": "Training"}')])
    assert [(j.id, j.state) for j in store.list_jobs()] == [("j-0", "Pending"), ("j-1", "Training")]

    adapter = AdapterRow("faq", "m", "j-1", 2.0, '[{"name": "a", "size": 1, "sha256": "00"}]', 1)
    store.finish_job(JobRow("j-1", "n1", "Succeeded", 1.0, "{}"), adapter)
    assert store.list_adapters() == [adapter]
    assert store.list_jobs()[1].state == "Succeeded"

    # A name taken fails the whole step: the other job's row is not written either.
    with pytest.raises(apsw.ConstraintError):
        store.finish_job(
            JobRow("j-0", "n2", "Succeeded", 0.5, "{}"), AdapterRow("faq", "m", "j-0", 3.0, "[]", 0)
        )
    assert store.list_jobs()[0].state == "Pending"
    assert store.list_adapters() == [adapter]


def test_a_journal_is_shipped_with_its_offset_in_one_transaction(store: Store):
    records = [UsageRecord(float(i), "acme", "k-00000001", "m", "r", 1, 2, 3.0, 200) for i in range(3)]
    store.ship_journal("worker-0.000001.journal", records[:2], 200)
    store.ship_journal("worker-0.000001.journal", records[2:], 300)
    assert store.journal_offsets() == {"worker-0.000001.journal": 300}
    assert [row["requests"] for row in store.summarise_usage([], None, None)] == [3]
    with pytest.raises(apsw.ConstraintError):  # a failed insert leaves the offset where it was
        store.ship_journal("worker-0.000001.journal", [attrs.evolve(records[0], tenant=None)], 400)
    assert store.journal_offsets() == {"worker-0.000001.journal": 300}
    store.forget_journal("worker-0.000001.journal")
    assert store.journal_offsets() == {}
