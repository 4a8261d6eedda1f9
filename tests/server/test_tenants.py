"""Tenants and API keys: the in-memory index the gateway authenticates against, kept in the store."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.core.quota import Limits
from llmgw.server import tokens
from llmgw.server.store import TABLES, Store
from llmgw.server.tenants import (
    Conflict,
    Invalid,
    KeyRecord,
    NotFound,
    Tenants,
    key_id_of,
    limits_from_json,
)


@pytest.fixture
async def store(open_test_store):  # on both backends
    s = await open_test_store()
    yield s
    await s.aclose()


@pytest.fixture
async def tenants(store: Store) -> Tenants:
    t = await Tenants.load(store)
    await t.create_tenant("acme", Limits(rpm=60))
    return t


async def test_a_new_key_authenticates_with_its_secret(tenants: Tenants):
    record, secret = await tenants.create_key("acme", ["org/qwen"], band=2, limits=Limits(tpm=1000))
    assert secret.startswith(f"llmgw-{record.id}-")
    assert record.id.startswith("k-") and len(record.id) == 10
    assert key_id_of(secret) == record.id
    assert tenants.authenticate(secret) == record
    assert record == KeyRecord(record.id, "acme", ("org/qwen",), 2, Limits(tpm=1000), record.created)


async def test_wrong_unknown_and_malformed_secrets_fail(tenants: Tenants):
    record, secret = await tenants.create_key("acme")
    other_id = "k-00000000" if record.id != "k-00000000" else "k-11111111"
    for wrong in (
        secret[:-1] + ("A" if secret[-1] != "A" else "B"),  # right id, wrong secret
        secret.replace(record.id, other_id),  # unknown id
        "",
        "llmgw-",
        "Bearer " + secret,
        secret + " ",
        record.id,
    ):
        assert tenants.authenticate(wrong) is None, wrong


async def test_the_digest_comparison_is_constant_time(tenants: Tenants, monkeypatch):
    record, secret = await tenants.create_key("acme")
    compared = []
    real = tokens.hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tokens.hmac, "compare_digest", spy)
    assert tenants.authenticate(secret) == record
    assert compared == [(tokens.digest(secret), tokens.digest(secret))]


async def test_a_revoked_key_fails_at_once_and_after_a_restart(store: Store, tenants: Tenants):
    record, secret = await tenants.create_key("acme")
    kept, kept_secret = await tenants.create_key("acme")
    revoked = await tenants.revoke_key(record.id)
    assert revoked.revoked is not None
    assert tenants.authenticate(secret) is None
    assert await tenants.revoke_key(record.id) == revoked  # again: unchanged

    reloaded = await Tenants.load(store)
    assert reloaded.authenticate(secret) is None
    assert reloaded.authenticate(kept_secret) == kept
    assert reloaded.list_keys() == tenants.list_keys() == [revoked, kept]


async def test_revoking_an_unknown_key(tenants: Tenants):
    with pytest.raises(NotFound, match='no api key "k-12345678"'):
        await tenants.revoke_key("k-12345678")


async def test_the_secret_is_nowhere_in_the_database_files(tmp_path: Path, store: Store, tenants: Tenants):
    record, secret = await tenants.create_key("acme")
    stored = await store.list_api_keys()
    assert [row.digest for row in stored] == [tokens.digest(secret)]
    secret_part = secret.removeprefix(f"llmgw-{record.id}-")
    for table in TABLES:  # every row, on either backend
        text = repr(await store.export_rows(table.name, None, 1000))
        assert secret not in text and secret_part not in text, table.name
    files = list((tmp_path / "data").iterdir()) if (tmp_path / "data").exists() else []
    if store.where.endswith(".db"):  # SQLite: its files too, the WAL included
        assert any(f.name.endswith("-wal") for f in files)
    for f in files:
        data = f.read_bytes()
        assert secret.encode() not in data, f
        assert secret_part.encode() not in data, f


def test_a_key_allows_its_models_or_every_model():
    every = KeyRecord("k-1", "acme", (), 0, None, 1.0)
    some = KeyRecord("k-2", "acme", ("a", "org/b"), 0, None, 1.0)
    assert every.allows("anything")
    assert some.allows("org/b") and some.allows("a")
    assert not some.allows("c")


async def test_tenants_are_checked(tenants: Tenants):
    with pytest.raises(Conflict, match='tenant "acme" already exists'):
        await tenants.create_tenant("acme", Limits())
    with pytest.raises(Invalid, match="^name: expected 1-63 characters"):
        await tenants.create_tenant("Has Spaces", Limits())
    with pytest.raises(NotFound, match='^tenant: no tenant "nobody"'):
        await tenants.create_key("nobody")
    with pytest.raises(Invalid, match=r"^models\[1\]: expected a model name, got 3"):
        await tenants.create_key("acme", ["a", 3])


async def test_delete_tenant_refuses_working_keys_then_removes_revoked_ones(store: Store, tenants: Tenants):
    record, _ = await tenants.create_key("acme")
    with pytest.raises(Conflict, match=f'tenant "acme" still has working keys \\({record.id}\\)'):
        await tenants.delete_tenant("acme")
    await tenants.revoke_key(record.id)
    await tenants.delete_tenant("acme")
    assert tenants.list_tenants() == [] and tenants.list_keys() == []
    assert await store.list_tenants() == []
    assert await store.list_api_keys() == []
    with pytest.raises(NotFound):
        await tenants.delete_tenant("acme")


async def test_limits_are_kept_and_set(store: Store, tenants: Tenants):
    await tenants.set_limits("acme", Limits(tpm=500, tpd=9000))
    reloaded = await Tenants.load(store)
    assert reloaded.tenant("acme").limits == Limits(tpm=500, tpd=9000)
    with pytest.raises(NotFound):
        await tenants.set_limits("nobody", Limits())


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1], "limits: expected an object"),
        ({"rpm": 0}, "limits.rpm: expected a whole number of at least 1, or null, got 0"),
        ({"tpm": True}, "limits.tpm: expected a whole number of at least 1, or null, got true"),
        ({"rps": 3}, "limits.rps: unknown limit (expected one of: rpm, tpm, tpd)"),
    ],
)
def test_limits_from_json_names_the_field(data, message):
    with pytest.raises(Invalid) as info:
        limits_from_json(data)
    assert str(info.value).startswith(message)


def test_limits_from_json():
    assert limits_from_json(None) == Limits()
    assert limits_from_json({"rpm": 5, "tpd": None}) == Limits(rpm=5)
