"""The store, on both backends (the open_test_store fixture is parametrised: SQLite and a real
PostgreSQL the session starts itself), then what only SQLite's files have."""

import logging
import sqlite3
import stat
from pathlib import Path

import pytest
import trio

from llmgw.server.store import (
    AdapterRow,
    ApiKeyRow,
    CatalogRow,
    ConstraintViolation,
    JobRow,
    NodeRow,
    StoreError,
    TenantRow,
    UsageRecord,
    open_store,
)
from llmgw.server.store.schema import MIGRATIONS, POSTGRES, SCHEMA_VERSION, SQLITE, render
from llmgw.server.store.sqlite import DB_FILENAME
from tests.helpers import TESTS, kill_9_after

CHILD = TESTS / "store_writer_child.py"


@pytest.fixture
async def store(open_test_store):
    s = await open_test_store()
    yield s
    await s.aclose()


def user_version(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        return conn.execute("PRAGMA user_version").fetchone()[0]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def node(name: str, state: str = "online", t: float = 1.0) -> NodeRow:
    return NodeRow(name, "0.1.0", "{}", state, t, t, t)


# --- opening and migrations (both backends) ---------------------------------------------------


def test_migrations_are_numbered_one_to_n_and_render_for_both():
    assert [version for version, _ in MIGRATIONS] == list(range(1, len(MIGRATIONS) + 1))
    assert SCHEMA_VERSION == len(MIGRATIONS)
    for _, sql in MIGRATIONS:
        for dialect in (SQLITE, POSTGRES):
            assert "{real}" not in render(sql, dialect) and "{int}" not in render(sql, dialect)
    assert "STRICT" not in render(MIGRATIONS[0][1], POSTGRES)


async def test_reopening_keeps_data(open_test_store):
    store = await open_test_store()
    await store.save_nodes([node("n1")])
    await store.put_secret("join-token", b"hash", 100.0)
    await store.aclose()

    store = await open_test_store()  # migrations already applied: nothing to do, nothing lost
    try:
        assert [n.name for n in await store.list_nodes()] == ["n1"]
        assert await store.get_secret("join-token") == b"hash"
    finally:
        await store.aclose()


async def test_a_newer_schema_is_refused_naming_the_database(open_test_store, request):
    store = await open_test_store()
    where = store.where
    await store.aclose()
    if request.node.callspec.params["open_test_store"] == "sqlite":
        with sqlite3.connect(where) as conn:
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
        conn.close()
    else:
        import psycopg

        with psycopg.connect(open_test_store.url, password=open_test_store.password, autocommit=True) as conn:
            conn.execute("UPDATE llmgw_schema SET version = %s", (SCHEMA_VERSION + 5,))

    with pytest.raises(StoreError) as info:
        await open_test_store()
    message = str(info.value)
    assert where in message
    assert f"schema version {SCHEMA_VERSION + 5}" in message
    assert f"knows up to {SCHEMA_VERSION}" in message


# --- tenants, api keys and usage ----------------------------------------------------------------


async def test_a_key_needs_its_tenant_and_revoking_is_once(store):
    with pytest.raises(ConstraintViolation, match=store.where.split("/")[-1]):
        await store.add_api_key(ApiKeyRow("k-1", "nobody", b"d", "[]", 0, None, 1.0, None))
    await store.add_tenant(TenantRow("acme", "{}", 1.0))
    with pytest.raises(ConstraintViolation):
        await store.add_tenant(TenantRow("acme", "{}", 2.0))
    key = ApiKeyRow("k-1", "acme", b"\x00digest\xff", "[]", 0, None, 1.0, None)
    await store.add_api_key(key)
    assert await store.list_api_keys() == [key]
    assert await store.revoke_api_key("k-1", 5.0)
    assert not await store.revoke_api_key("k-1", 6.0)
    assert (await store.list_api_keys())[0].revoked == 5.0
    assert await store.set_tenant_limits("acme", '{"tpm":5}')
    assert not await store.set_tenant_limits("nobody", "{}")
    assert await store.list_tenants() == [TenantRow("acme", '{"tpm":5}', 1.0)]
    assert await store.delete_tenant("acme")  # and its key with it
    assert await store.list_api_keys() == []
    assert not await store.delete_tenant("acme")


async def test_keys_are_listed_by_tenant_created_and_id(store):
    for name in ("b", "a"):
        await store.add_tenant(TenantRow(name, "{}", 1.0))
    rows = [
        ApiKeyRow("k-3", "b", b"d", "[]", 0, None, 1.0, None),
        ApiKeyRow("k-2", "a", b"d", "[]", 1, '{"rpm": 1}', 2.0, None),
        ApiKeyRow("k-1", "a", b"d", '["m"]', 0, None, 2.0, None),
    ]
    for row in rows:
        await store.add_api_key(row)
    assert [k.id for k in await store.list_api_keys()] == ["k-1", "k-2", "k-3"]


async def test_usage_summaries_group_only_by_known_names(store):
    with pytest.raises(ValueError, match="cannot group usage by replica"):
        await store.summarise_usage(["replica"], None, None)


async def test_usage_is_summed_per_group_and_day_in_utc(store):
    day1, day2 = 1_793_534_400.0, 1_793_620_800.0  # 2026-11-01 and 2026-11-02, 12:00 UTC
    await store.add_usage(
        [
            UsageRecord(day1, "acme", "k-1", "m", "r", 10, 5, 100.0, 200),
            UsageRecord(day1 + 1, "acme", "k-1", "m", "r", 1, 2, 300.0, 500),
            UsageRecord(day2, "beta", "k-2", "m", "", 3, 0, 50.0, 429),
        ]
    )
    assert await store.summarise_usage(["day", "tenant"], None, None) == [
        {
            "day": "2026-11-01",
            "tenant": "acme",
            "requests": 2,
            "prompt_tokens": 11,
            "completion_tokens": 7,
            "total_tokens": 18,
            "errors": 1,
            "avg_latency_ms": 200.0,
        },
        {
            "day": "2026-11-02",
            "tenant": "beta",
            "requests": 1,
            "prompt_tokens": 3,
            "completion_tokens": 0,
            "total_tokens": 3,
            "errors": 1,
            "avg_latency_ms": 50.0,
        },
    ]
    assert [r["requests"] for r in await store.summarise_usage([], day1 + 1, None)] == [2]
    assert await store.summarise_usage([], None, day1) == []


# --- usage journals: records and offset in one transaction --------------------------------------


async def test_a_journal_shipment_lands_with_its_offset_or_not_at_all(store):
    record = UsageRecord(1.0, "acme", "k-1", "m", "r", 1, 1, 1.0, 200)
    await store.ship_journal("w1.000001.journal", [record, record], 120)
    await store.ship_journal("w2.000001.journal", [record], 60)
    await store.ship_journal("w1.000001.journal", [record], 180)
    assert await store.journal_offsets() == {"w1.000001.journal": 180, "w2.000001.journal": 60}

    broken = UsageRecord(2.0, "acme", "k-1", "m", "r", "not a number", 1, 1.0, 200)
    with pytest.raises(StoreError):
        await store.ship_journal("w1.000001.journal", [record, broken], 240)
    assert (await store.journal_offsets())["w1.000001.journal"] == 180
    assert (await store.summarise_usage([], None, None))[0]["requests"] == 4

    await store.forget_journal("w2.000001.journal")
    assert await store.journal_offsets() == {"w1.000001.journal": 180}


# --- nodes ------------------------------------------------------------------------------------


async def test_save_nodes_writes_rows_as_given_and_replaces_them(store):
    first = NodeRow("n1", "0.1.0", '{"gpus": 1}', "online", 100.0, 150.0, 100.0)
    await store.save_nodes([first])
    assert await store.get_node("n1") == first

    second = NodeRow("n1", "0.2.0", '{"gpus": 2}', "lost", 100.0, 200.0, 260.0)
    other = NodeRow("n2", "0.2.0", "{}", "online", 5.0, 6.0, 7.0)
    await store.save_nodes([second, other])
    assert await store.list_nodes() == [second, other]
    assert await store.get_node("nobody") is None


async def test_list_is_ordered_by_name_and_delete_reports_existence(store):
    # Mixed case: the backends' collations differ, the order must not.
    for name in ("n3", "N1", "n2", "a"):
        await store.save_nodes([node(name)])
    assert [n.name for n in await store.list_nodes()] == ["N1", "a", "n2", "n3"]

    assert await store.delete_node("n2")
    assert not await store.delete_node("n2")
    assert [n.name for n in await store.list_nodes()] == ["N1", "a", "n3"]


# --- catalog ----------------------------------------------------------------------------------


def row(kind: str, name: str, source: str, spec: str = "{}", updated: float = 1.0) -> CatalogRow:
    return CatalogRow(kind, name, spec, source, updated)


async def test_catalog_rows_are_listed_by_kind_then_name_and_deleted_by_both(store):
    await store.save_catalog_entries(
        [row("profile", "b", "api"), row("model", "b", "api"), row("model", "a", "config")]
    )
    assert [(r.kind, r.name) for r in await store.list_catalog()] == [
        ("model", "a"),
        ("model", "b"),
        ("profile", "b"),
    ]

    await store.save_catalog_entry("model", "b", '{"x": 1}', "api", 2.0)
    assert (await store.list_catalog())[1] == row("model", "b", "api", '{"x": 1}', 2.0)

    assert await store.delete_catalog_entry("model", "b")
    assert not await store.delete_catalog_entry("model", "b")
    assert [(r.kind, r.name) for r in await store.list_catalog()] == [("model", "a"), ("profile", "b")]


async def test_catalog_rows_are_checked(store):
    with pytest.raises(ConstraintViolation):
        await store.save_catalog_entry("adapter", "x", "{}", "api", 1.0)
    with pytest.raises(ConstraintViolation):
        await store.save_catalog_entry("model", "x", "{}", "yaml", 1.0)


async def test_replace_config_entries(store):
    await store.save_catalog_entries(
        [
            row("model", "old", "config"),
            row("model", "used", "config"),
            row("profile", "mine", "api"),
            row("profile", "taken", "api"),
        ]
    )
    await store.replace_config_entries(
        [row("model", "new", "config"), row("profile", "taken", "config", '{"band": 1}')],
        keep=[("model", "used")],
    )
    assert await store.list_catalog() == [
        row("model", "new", "config"),
        row("model", "used", "api"),  # dropped from the config, kept for its users
        row("profile", "mine", "api"),
        row("profile", "taken", "config", '{"band": 1}'),  # the config took the name over
    ]


async def test_replace_config_entries_is_one_transaction(store):
    await store.save_catalog_entries([row("model", "old", "config")])
    with pytest.raises(ConstraintViolation):
        await store.replace_config_entries([row("model", "new", "config"), row("model", "bad", "nobody")])
    assert await store.list_catalog() == [row("model", "old", "config")]


# --- secrets ----------------------------------------------------------------------------------


async def test_secrets_put_replaces_and_ensure_keeps_the_first(store):
    assert await store.get_secret("admin-token") is None
    await store.put_secret("admin-token", b"one", 1.0)
    await store.put_secret("admin-token", b"two", 2.0)
    assert await store.get_secret("admin-token") == b"two"

    assert await store.ensure_secret("engine-key", lambda: b"first", 1.0) == b"first"
    assert await store.ensure_secret("engine-key", lambda: b"second", 2.0) == b"first"
    assert await store.get_secret("engine-key") == b"first"


async def test_ensure_secret_does_not_call_make_when_present(store):
    await store.put_secret("engine-key", b"stored", 1.0)

    def make() -> bytes:
        raise AssertionError("make() called although a secret is stored")

    assert await store.ensure_secret("engine-key", make, 2.0) == b"stored"


# PostgreSQL only: it is how two servers share a store. Two writers on one SQLite file racing in
# one process were seen to fail "database is locked" under load, whatever the busy timeout.
@pytest.mark.parametrize("open_test_store", ["postgresql"], indirect=True)
async def test_two_stores_on_one_database_agree_on_the_first_secret(open_test_store):
    """Two servers on one PostgreSQL racing to make the engine-key secret both end up with the
    one stored first."""
    first, second = await open_test_store(), await open_test_store()
    got = []
    try:
        async with trio.open_nursery() as nursery:
            for s, value in ((first, b"a" * 32), (second, b"b" * 32)):

                async def ensure(s=s, value=value):
                    got.append(await s.ensure_secret("engine-key", lambda: value, 1.0))

                nursery.start_soon(ensure)
        assert len(got) == 2 and got[0] == got[1]
        assert await first.get_secret("engine-key") == got[0]
    finally:
        await first.aclose()
        await second.aclose()


# --- trio access ------------------------------------------------------------------------------


async def test_concurrent_writes_all_land_and_reads_see_them(store):
    async with trio.open_nursery() as nursery:
        for i in range(50):
            nursery.start_soon(store.save_nodes, [node(f"n{i:02}")])
            nursery.start_soon(store.list_nodes)

    assert [n.name for n in await store.list_nodes()] == [f"n{i:02}" for i in range(50)]
    await store.save_nodes([node("n07", "lost", 2.0)])
    assert (await store.get_node("n07")).state == "lost"


async def test_jobs_are_saved_and_a_finished_job_registers_its_adapter_in_one_transaction(store):
    pending = JobRow("j-1", "n1", "Pending", 1.0, '{"id": "j-1"}')
    await store.save_jobs([pending, JobRow("j-0", "n2", "Pending", 0.5, "{}")])
    await store.save_jobs([JobRow("j-1", "n1", "Training", 1.0, '{"id": "j-1", "state": "Training"}')])
    assert [(j.id, j.state) for j in await store.list_jobs()] == [("j-0", "Pending"), ("j-1", "Training")]

    adapter = AdapterRow("faq", "m", "j-1", 2.0, '[{"name": "a", "size": 1, "sha256": "00"}]', 1)
    await store.finish_job(JobRow("j-1", "n1", "Succeeded", 1.0, "{}"), adapter)
    assert await store.list_adapters() == [adapter]
    assert (await store.list_jobs())[1].state == "Succeeded"

    # A name taken fails the whole step: the other job's row is not written either.
    with pytest.raises(ConstraintViolation):
        await store.finish_job(
            JobRow("j-0", "n2", "Succeeded", 0.5, "{}"), AdapterRow("faq", "m", "j-0", 3.0, "[]", 0)
        )
    assert (await store.list_jobs())[0].state == "Pending"
    assert await store.list_adapters() == [adapter]


# --- PostgreSQL: its password -------------------------------------------------------------------


async def test_the_password_never_reaches_a_message_or_a_log_line(pg_cluster, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    url = pg_cluster.url(pg_cluster.create_database())
    wrong = "not-the-password-9f3a"
    with pytest.raises(StoreError) as info:
        await open_store(tmp_path, url, wrong)
    assert "password authentication failed" in str(info.value)
    assert wrong not in str(info.value)

    # In the URL (as a careless server.yaml might have it): still named without it.
    with_password = url.replace("llmgw@", f"llmgw:{pg_cluster.password}@")
    store = await open_store(tmp_path, with_password)
    try:
        assert store.where == url
        await store.save_nodes([node("n1")])
        with pytest.raises(ConstraintViolation) as info:
            await store.add_api_key(ApiKeyRow("k-1", "nobody", b"d", "[]", 0, None, 1.0, None))
    finally:
        await store.aclose()
    for text in [str(info.value), caplog.text]:
        assert pg_cluster.password not in text and wrong not in text


# --- SQLite: its files --------------------------------------------------------------------------


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


def _garbage(data_dir: Path) -> Path:
    data_dir.mkdir()
    path = data_dir / DB_FILENAME
    path.write_bytes(b"this is not a database, it is a shopping list\n" * 100)
    return path


async def test_garbage_file_is_refused_naming_the_path(data_dir: Path):
    path = _garbage(data_dir)

    with pytest.raises(StoreError, match=str(path)):
        await open_store(data_dir)


async def test_files_are_private(data_dir: Path):
    store = await open_store(data_dir)
    try:
        await store.save_nodes([node("n1")])  # makes sure -wal exists
        assert mode(data_dir) == 0o700
        db = data_dir / DB_FILENAME
        assert mode(db) == 0o600
        sidecars = [db.with_name(db.name + suffix) for suffix in ("-wal", "-shm")]
        assert all(p.exists() for p in sidecars)
        for p in sidecars:
            assert mode(p) == 0o600, p
    finally:
        await store.aclose()


async def test_existing_loose_db_file_is_tightened(data_dir: Path):
    await (await open_store(data_dir)).aclose()
    db = data_dir / DB_FILENAME
    db.chmod(0o644)
    await (await open_store(data_dir)).aclose()
    assert mode(db) == 0o600


def _old_database(data_dir: Path, versions: int, *statements: str) -> Path:
    """A database as an earlier release left it: its first ``versions`` migrations only."""
    data_dir.mkdir()
    path = data_dir / DB_FILENAME
    with sqlite3.connect(path) as conn:
        conn.executescript("".join(render(sql, SQLITE) for _, sql in MIGRATIONS[:versions]))
        for statement in statements:
            conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {versions}")
    conn.close()
    return path


async def test_a_version_1_database_is_migrated_and_keeps_its_data(data_dir: Path):
    path = _old_database(
        data_dir,
        1,
        "INSERT INTO nodes VALUES ('n1', '0.1.0', '{}', 'online', 1.0, 2.0, 1.0)",
        "INSERT INTO secrets VALUES ('engine-key', x'00ff', 1.0)",
    )
    store = await open_store(data_dir)
    try:
        assert user_version(path) == SCHEMA_VERSION
        assert [n.name for n in await store.list_nodes()] == ["n1"]
        assert await store.get_secret("engine-key") == b"\x00\xff"
        assert await store.list_catalog() == []
        assert await store.journal_offsets() == {}
    finally:
        await store.aclose()


async def test_a_version_2_database_gains_tenants_keys_and_usage(data_dir: Path):
    path = _old_database(data_dir, 2, "INSERT INTO catalog VALUES ('model', 'm', '{}', 'api', 1.0)")
    store = await open_store(data_dir)
    try:
        assert user_version(path) == SCHEMA_VERSION
        assert await store.list_catalog() == [CatalogRow("model", "m", "{}", "api", 1.0)]
        await store.add_tenant(TenantRow("acme", '{"rpm":1}', 2.0))
        await store.add_usage([UsageRecord(4.0, "acme", "k-00000001", "m", "r", 1, 2, 3.0, 200)])
        assert (await store.summarise_usage(["tenant"], None, None))[0]["requests"] == 1
    finally:
        await store.aclose()
    with sqlite3.connect(path) as conn:
        indexes = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    conn.close()
    assert {"usage_time", "usage_tenant_time"} <= indexes


@pytest.mark.slow
async def test_committed_write_survives_kill_9(data_dir: Path):
    await kill_9_after(CHILD, [str(data_dir)], b"committed\n")

    # The row must come back from the WAL the killed process left behind, not from a checkpoint.
    wal = data_dir / (DB_FILENAME + "-wal")
    assert wal.stat().st_size > 0
    store = await open_store(data_dir)
    try:
        found = await store.get_node("node-killed")
    finally:
        await store.aclose()
    assert found is not None
    assert found.state == "online"


async def test_usage_carries_the_adapter_a_request_named_and_sums_by_it(store):
    await store.add_usage(
        [
            UsageRecord(1.0, "acme", "k-1", "m", "r", 10, 5, 1.0, 200, "sql"),
            UsageRecord(2.0, "acme", "k-1", "m", "r", 1, 2, 1.0, 200, "sql"),
            UsageRecord(3.0, "acme", "k-1", "m", "r", 3, 0, 1.0, 200),  # the base model
        ]
    )
    rows = await store.summarise_usage(["model", "adapter"], None, None)
    assert [(r["model"], r["adapter"], r["requests"], r["total_tokens"]) for r in rows] == [
        ("m", "", 1, 3),
        ("m", "sql", 2, 18),
    ]
