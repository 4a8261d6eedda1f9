"""Tenants and their API keys: in memory for the gateway's hot path, kept in the store.

A key's secret is ``llmgw-<id>-<random>``. It is shown once, when the key is made, and the server
keeps only its SHA-256, like the admin token (see tokens.py): a copy of the database gives no key
that works. The id inside the secret finds the key without trying every digest, and the ids are
public (listings show them), so looking one up may take variable time; only the digest
comparison must not, and it is hmac.compare_digest.

:meth:`Tenants.authenticate` reads only memory. Every change is written to the store first and
made visible after, under one lock, so memory never shows what the store does not hold; a revoked
key fails from the moment revoke returns.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Iterable, Mapping

import attrs
import trio

from llmgw.core.quota import Limits
from llmgw.server import tokens
from llmgw.server.changes import Changes
from llmgw.server.store import ApiKeyRow, Store, TenantRow

SECRET_PREFIX = "llmgw-"
KEY_ID_PREFIX = "k-"
# 8 hex digits: ids stay short enough to read out, and a collision is checked at creation.
KEY_ID_BYTES = 4
# 256 bits, like the admin token: guessing one is out of the question.
SECRET_BYTES = 32
_SECRET = re.compile(r"llmgw-(k-[0-9a-f]{8})-[A-Za-z0-9_-]+")

# Tenant names appear in URLs and in the usage account: no slashes, no spaces.
TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
TENANT_NAME_RULE = "1-63 characters of a-z, 0-9, '.', '_', '-', starting with a letter or digit"

LIMIT_NAMES = ("rpm", "tpm", "tpd")


@attrs.frozen
class Tenant:
    name: str
    limits: Limits
    created: float  # wall-clock unix seconds


@attrs.frozen
class KeyRecord:
    """An API key as the gateway sees it: never its secret or digest."""

    id: str
    tenant: str
    models: tuple[str, ...]  # the models it may use; () for every model
    band: int  # priority band of its requests, higher first
    limits: Limits | None  # its own limits, on top of its tenant's; None for none
    created: float
    revoked: float | None = None

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


class TenantError(Exception):
    """A change that was not made; the message leads with the field or the thing it is about."""


class Invalid(TenantError):
    """The request itself is wrong."""


class NotFound(TenantError):
    """No tenant or key of that name or id."""


class Conflict(TenantError):
    """Sound, but the state forbids it (a tenant that exists, or still has working keys)."""


def key_id_of(secret: str) -> str | None:
    """The key id inside a secret, or None when it is not shaped like one of ours."""
    match = _SECRET.fullmatch(secret)
    return None if match is None else match[1]


class Tenants:
    def __init__(self, store: Store, tenants: Iterable[Tenant], keys: Iterable[tuple[KeyRecord, bytes]]):
        self._store = store
        self._tenants = {tenant.name: tenant for tenant in tenants}
        self._keys: dict[str, KeyRecord] = {}
        self._digests: dict[str, bytes] = {}  # of working keys only: a revoked key is absent
        for record, digest in keys:
            self._keys[record.id] = record
            if record.revoked is None:
                self._digests[record.id] = digest
        self._lock = trio.Lock()
        self.changes = Changes()  # bumped on every change: gateway workers get the keys anew

    @classmethod
    async def load(cls, store: Store) -> Tenants:
        tenant_rows = await store.list_tenants()
        key_rows = await store.list_api_keys()
        return cls(
            store,
            [Tenant(row.name, limits_from_json(json.loads(row.limits)), row.created) for row in tenant_rows],
            [(_key_record(row), row.digest) for row in key_rows],
        )

    async def reload(self) -> bool:
        """Takes the tenants and keys the store holds now (another server sharing it made or
        revoked some); True, and the change counter bumped, when they differ from ours."""
        async with self._lock:
            fresh = await Tenants.load(self._store)
            if (fresh._tenants, fresh._keys, fresh._digests) == (self._tenants, self._keys, self._digests):
                return False
            self._tenants, self._keys, self._digests = fresh._tenants, fresh._keys, fresh._digests
        self.changes.bump()
        return True

    # --- the hot path -----------------------------------------------------------------------------

    def authenticate(self, secret: str) -> KeyRecord | None:
        """The working key whose secret this is, or None."""
        key_id = key_id_of(secret)
        if key_id is None:
            return None
        digest = self._digests.get(key_id)
        if digest is None or not tokens.matches(secret, digest):
            return None
        return self._keys[key_id]

    def tenant(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    def working_keys(self) -> list[tuple[KeyRecord, bytes]]:
        """Every key that is not revoked, with its digest: what a gateway worker checks against."""
        return [(self._keys[key_id], digest) for key_id, digest in sorted(self._digests.items())]

    # --- reading ----------------------------------------------------------------------------------

    def list_tenants(self) -> list[Tenant]:
        return [tenant for _, tenant in sorted(self._tenants.items())]

    def list_keys(self, tenant: str | None = None) -> list[KeyRecord]:
        """Every key, revoked ones too, by tenant then age; only ``tenant``'s when given."""
        keys = [key for key in self._keys.values() if tenant is None or key.tenant == tenant]
        return sorted(keys, key=lambda key: (key.tenant, key.created, key.id))

    def active_keys(self, tenant: str) -> list[KeyRecord]:
        return [key for key in self.list_keys(tenant) if key.revoked is None]

    # --- changing ---------------------------------------------------------------------------------

    async def create_tenant(self, name: str, limits: Limits) -> Tenant:
        if not TENANT_NAME.fullmatch(name):
            raise Invalid(f"name: expected {TENANT_NAME_RULE}, got {name!r}")
        async with self._lock:
            if name in self._tenants:
                raise Conflict(f'tenant "{name}" already exists')
            tenant = Tenant(name, limits, time.time())
            await self._store.add_tenant(TenantRow(name, _limits_json(limits), tenant.created))
            self._tenants[name] = tenant
            self.changes.bump()
            return tenant

    async def set_limits(self, name: str, limits: Limits) -> Tenant:
        async with self._lock:
            tenant = self._existing_tenant(name)
            await self._store.set_tenant_limits(name, _limits_json(limits))
            tenant = self._tenants[name] = attrs.evolve(tenant, limits=limits)
            self.changes.bump()
            return tenant

    async def delete_tenant(self, name: str) -> None:
        """Deletes a tenant without working keys, and its revoked keys' records with it (the
        usage account keeps naming them)."""
        async with self._lock:
            self._existing_tenant(name)
            if active := self.active_keys(name):
                ids = ", ".join(key.id for key in active)
                raise Conflict(f'tenant "{name}" still has working keys ({ids}); revoke them first')
            await self._store.delete_tenant(name)
            del self._tenants[name]
            for key in self.list_keys(name):
                del self._keys[key.id]
            self.changes.bump()

    async def create_key(
        self, tenant: str, models: Iterable[str] = (), band: int = 0, limits: Limits | None = None
    ) -> tuple[KeyRecord, str]:
        """A new key and its secret: the only time the secret exists outside the client.

        ``models`` need not be in the catalog yet: a key may be handed out before its model is.
        """
        models = tuple(models)
        for index, model in enumerate(models):
            if not isinstance(model, str) or not model:
                raise Invalid(f"models[{index}]: expected a model name, got {json.dumps(model)}")
        async with self._lock:
            self._existing_tenant(tenant, field="tenant")
            key_id = _new_key_id()
            while key_id in self._keys:
                key_id = _new_key_id()
            secret = f"{SECRET_PREFIX}{key_id}-{secrets.token_urlsafe(SECRET_BYTES)}"
            record = KeyRecord(key_id, tenant, models, band, limits, time.time())
            digest = tokens.digest(secret)
            await self._store.add_api_key(_key_row(record, digest))
            self._keys[key_id] = record
            self._digests[key_id] = digest
            self.changes.bump()
            return record, secret

    async def revoke_key(self, key_id: str) -> KeyRecord:
        """Revokes a key; revoking it again changes nothing and returns it as it is."""
        async with self._lock:
            record = self._keys.get(key_id)
            if record is None:
                raise NotFound(f'no api key "{key_id}"')
            if record.revoked is not None:
                return record
            now = time.time()
            await self._store.revoke_api_key(key_id, now)
            record = self._keys[key_id] = attrs.evolve(record, revoked=now)
            del self._digests[key_id]
            self.changes.bump()
            return record

    def _existing_tenant(self, name: str, field: str | None = None) -> Tenant:
        tenant = self._tenants.get(name)
        if tenant is None:
            raise NotFound(f'{field + ": " if field else ""}no tenant "{name}"')
        return tenant


def limits_from_json(data: object, field: str = "limits") -> Limits:
    """Limits from ``{"rpm": n, "tpm": n, "tpd": n}``: each optional, null for unlimited."""
    if data is None:
        return Limits()
    if not isinstance(data, Mapping):
        raise Invalid(
            f'{field}: expected an object like {{"rpm": 60, "tpm": 100000}}, got {json.dumps(data)}'
        )
    problems = [
        f"{field}.{name}: unknown limit (expected one of: {', '.join(LIMIT_NAMES)})"
        for name in data
        if name not in LIMIT_NAMES
    ]
    for name in LIMIT_NAMES:
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            problems.append(
                f"{field}.{name}: expected a whole number of at least 1, or null, got {json.dumps(value)}"
            )
    if problems:
        raise Invalid("; ".join(problems))
    return Limits(**{name: data.get(name) for name in LIMIT_NAMES})


def limits_json(limits: Limits) -> dict:
    return attrs.asdict(limits)


def _limits_json(limits: Limits) -> str:
    return json.dumps(limits_json(limits), separators=(",", ":"))


def _new_key_id() -> str:
    return KEY_ID_PREFIX + secrets.token_hex(KEY_ID_BYTES)


def _key_row(record: KeyRecord, digest: bytes) -> ApiKeyRow:
    return ApiKeyRow(
        record.id,
        record.tenant,
        digest,
        json.dumps(list(record.models)),
        record.band,
        None if record.limits is None else _limits_json(record.limits),
        record.created,
        record.revoked,
    )


def _key_record(row: ApiKeyRow) -> KeyRecord:
    return KeyRecord(
        row.id,
        row.tenant,
        tuple(json.loads(row.models)),
        row.band,
        None if row.limits is None else limits_from_json(json.loads(row.limits)),
        row.created,
        row.revoked,
    )
