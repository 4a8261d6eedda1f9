"""The server's catalog: its models and profiles, in memory, kept in the store.

Entries have one of two owners, recorded as their ``source``:

- ``config``: declared in server.yaml. The file is declarative: at every start its entries are
  written into the store, replacing what an earlier server.yaml declared, and an API entry of
  the same name too. The admin API refuses (409) to change, scale or remove them, since the next
  restart would silently undo the change; the message says to edit server.yaml instead.
- ``api``: added with the admin API (``llmgw ctl apply``), kept until removed there.

Two consequences of a server.yaml edit are settled at start, where nobody can be asked:

- A model the file no longer declares, but that an API profile still uses, stays, as an API entry
  (with a warning), so that no profile is left without its model. Remove it with ctl once nothing
  uses it.
- An API profile that the file's models no longer fit (a model's format changed under a llama.cpp
  profile) stays as it is, with a warning naming the problem: removing an operator's entry on
  their behalf would lose it, and refusing to start would leave no API to fix it with.

Every change is checked whole before anything is written, written in one transaction, and only
then made visible; one lock keeps changes from interleaving. Whoever acts on the catalog (the
reconciler) reads :attr:`Catalog.version` before looking, and after acting waits with
:meth:`Catalog.wait_changed` for a version past it, so a change made meanwhile is never missed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs
import trio

from llmgw.config import converter, structure_catalog
from llmgw.core.catalog import (
    Model,
    Profile,
    StoredAdapter,
    adapter_name_problems,
    name_problem,
    stored_adapter_problems,
    validate_model,
    validate_profile,
)
from llmgw.server.changes import Changes
from llmgw.server.store import CatalogRow, Store, StoreError

log = logging.getLogger(__name__)

CONFIG = "config"
API = "api"


@attrs.frozen
class Entry:
    kind: str  # "model" or "profile"
    spec: Model | Profile
    source: str  # CONFIG or API
    updated: float  # wall-clock unix seconds of the last change

    @property
    def name(self) -> str:
        return self.spec.name


@attrs.frozen
class Change:
    kind: str
    name: str
    change: str  # "created", "updated" or "unchanged"


class CatalogError(Exception):
    """A change the catalog did not make; each of ``problems`` leads with what it is about."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


class Invalid(CatalogError):
    """The change itself is wrong (a field's value, a model that does not exist)."""


class Refused(CatalogError):
    """The change is sound but the catalog as it stands forbids it (owned by server.yaml, in use)."""


class NotFound(CatalogError):
    """No entry of that kind and name."""


class Catalog:
    def __init__(self, store: Store, entries: Iterable[Entry]) -> None:
        self._store = store
        self._models: dict[str, Entry] = {}
        self._profiles: dict[str, Entry] = {}
        for entry in entries:
            self._table(entry.kind)[entry.name] = entry
        self._lock = trio.Lock()
        self.changes = Changes()
        # The adapters the server keeps (the job manager's), which profiles may name as a
        # ``source``; set once they are loaded. Until then none is kept.
        self.stored_adapters: Callable[[], Mapping[str, StoredAdapter]] = dict

    @classmethod
    async def load(cls, store: Store, models: Sequence[Model], profiles: Sequence[Profile]) -> Catalog:
        """The catalog in the store, once server.yaml's entries (``models``, ``profiles``, already
        validated together by the config) have replaced the earlier config's."""
        stored = _entries(await store.list_catalog(), store.where)
        declared = {("model", m.name): m for m in models} | {("profile", p.name): p for p in profiles}
        # Profiles server.yaml declares use only models it declares; the API's are the question.
        still_used = {
            e.spec.model
            for e in stored
            if e.kind == "profile" and e.source == API and ("profile", e.name) not in declared
        }
        demote = [
            ("model", e.name)
            for e in stored
            if e.kind == "model"
            and e.source == CONFIG
            and ("model", e.name) not in declared
            and e.name in still_used
        ]
        for _, name in demote:
            log.warning(
                'catalog: server.yaml no longer declares model "%s", but profiles added through the admin API '
                "use it; it stays, as an API entry (remove it with `llmgw ctl delete model %s` once unused)",
                name,
                name,
            )
        now = time.time()
        previous = {(e.kind, e.name): e for e in stored}
        rows = []
        for (kind, name), spec in declared.items():
            before = previous.get((kind, name))
            unchanged = before is not None and before.source == CONFIG and before.spec == spec
            rows.append(_row(Entry(kind, spec, CONFIG, before.updated if unchanged else now)))
        await store.replace_config_entries(rows, demote)
        catalog = cls(store, _entries(await store.list_catalog(), store.where))
        catalog._warn_about_unfit_profiles()
        return catalog

    async def reload(self) -> bool:
        """Takes what the store holds now (another server sharing it changed the catalog through
        its admin API); True, and the change counter bumped, when that differs from ours. Under
        the lock, so a change of our own is never half-applied when compared."""
        async with self._lock:
            entries = _entries(await self._store.list_catalog(), self._store.where)
            models = {e.name: e for e in entries if e.kind == "model"}
            profiles = {e.name: e for e in entries if e.kind == "profile"}
            if (models, profiles) == (self._models, self._profiles):
                return False
            self._models, self._profiles = models, profiles
        log.info(
            "catalog: changed in the store by another server (%d models, %d profiles)",
            len(models),
            len(profiles),
        )
        self.changes.bump()
        return True

    # --- reading ----------------------------------------------------------------------------------

    def models(self) -> dict[str, Model]:
        """Every model by name: a copy, which later changes leave as it is (safe across awaits)."""
        return {name: entry.spec for name, entry in sorted(self._models.items())}

    def profiles(self) -> dict[str, Profile]:
        """Every profile by name: a copy, like :meth:`models`."""
        return {name: entry.spec for name, entry in sorted(self._profiles.items())}

    def entries(self, kind: str) -> list[Entry]:
        """Every entry of ``kind`` ("model" or "profile"), by name, with its owner."""
        return [entry for _, entry in sorted(self._table(kind).items())]

    @property
    def version(self) -> int:
        return self.changes.version

    async def wait_changed(self, seen: int) -> int:
        """Returns the catalog's version once it is past ``seen`` (at once if it already is)."""
        return await self.changes.wait_past(seen)

    # --- changing ---------------------------------------------------------------------------------

    async def apply(self, models: Sequence[Model], profiles: Sequence[Profile]) -> list[Change]:
        """Creates or replaces these entries as API entries, all or none.

        Raises Refused for entries that server.yaml owns and Invalid with every problem, each
        led by the field's path (``profiles.chat.memory_mib: ...``).
        """
        async with self._lock:
            owned = [
                f"{kind}s.{entry.name}: declared in server.yaml; change it there and restart the server"
                for kind, entry in _kinds(models, profiles)
                if (current := self._table(kind).get(entry.name)) is not None and current.source == CONFIG
            ]
            if owned:
                raise Refused(owned)
            if problems := self._problems(models, profiles):
                raise Invalid(problems)
            now = time.time()
            changes, rows = [], []
            for kind, spec in _kinds(models, profiles):
                current = self._table(kind).get(spec.name)
                if current is not None and current.spec == spec:
                    changes.append(Change(kind, spec.name, "unchanged"))
                    continue
                changes.append(Change(kind, spec.name, "created" if current is None else "updated"))
                rows.append(Entry(kind, spec, API, now))
            if rows:
                await self._store.save_catalog_entries([_row(entry) for entry in rows])
                # No checkpoint from here on: a cancel arriving during the write is delivered only
                # after memory matches what was committed.
                for entry in rows:
                    self._table(entry.kind)[entry.name] = entry
                self._bump()
            return changes

    async def scale(
        self, name: str, min_replicas: int | None = None, max_replicas: int | None = None
    ) -> Entry:
        """Sets an API profile's replica bounds; None keeps a bound as it is. Returns the entry."""
        async with self._lock:
            entry = self._owned_by_api("profile", name, "change min_replicas and max_replicas there")
            scaled = attrs.evolve(
                entry.spec,
                min_replicas=entry.spec.min_replicas if min_replicas is None else min_replicas,
                max_replicas=entry.spec.max_replicas if max_replicas is None else max_replicas,
            )
            # Only the bounds are judged: they are all that changes here.
            bounds = (f"profiles.{name}.min_replicas:", f"profiles.{name}.max_replicas:")
            problems = [p for p in validate_profile(scaled, self.models()) if p.startswith(bounds)]
            if problems:
                raise Invalid(problems)
            if scaled == entry.spec:
                return entry
            entry = Entry("profile", scaled, API, time.time())
            await self._store.save_catalog_entry(*_row_values(entry))
            self._profiles[name] = entry
            self._bump()
            return entry

    async def remove(self, kind: str, name: str) -> None:
        """Removes an API entry; a model only once no profile uses it."""
        async with self._lock:
            self._owned_by_api(kind, name, "remove it there")
            if kind == "model":
                users = sorted(p.name for p in self._profiles.values() if p.spec.model == name)
                if users:
                    raise Refused(
                        [
                            f'model "{name}" is used by profile {", ".join(users)}; delete or change those first'
                        ]
                    )
            await self._store.delete_catalog_entry(kind, name)
            del self._table(kind)[name]
            self._bump()

    # --- inside -----------------------------------------------------------------------------------

    def _table(self, kind: str) -> dict[str, Entry]:
        if kind == "model":
            return self._models
        if kind == "profile":
            return self._profiles
        raise ValueError(f"not a catalog kind: {kind!r}")

    def _owned_by_api(self, kind: str, name: str, fix: str) -> Entry:
        entry = self._table(kind).get(name)
        if entry is None:
            raise NotFound([f'no {kind} named "{name}"'])
        if entry.source == CONFIG:
            raise Refused([f'{kind} "{name}" is declared in server.yaml; {fix} and restart the server'])
        return entry

    def _problems(self, models: Sequence[Model], profiles: Sequence[Profile]) -> list[str]:
        problems = []
        for section, entries in (("models", models), ("profiles", profiles)):
            seen = set()
            for entry in entries:
                if problem := name_problem(entry.name):
                    problems.append(f"{section}.{entry.name}: {problem}")
                elif entry.name in seen:
                    problems.append(f"{section}.{entry.name}: given twice")
                seen.add(entry.name)
        after = self.models() | {model.name: model for model in models}
        for model in models:
            problems += validate_model(model)
        stored = self.stored_adapters()
        for profile in profiles:
            problems += validate_profile(profile, after)
            problems += stored_adapter_problems(profile, stored)
        # A profile already here must still hold with a model this change replaces.
        applied = {profile.name for profile in profiles}
        replaced = {model.name for model in models}
        for name, entry in self._profiles.items():
            if name not in applied and entry.spec.model in replaced:
                problems += validate_profile(entry.spec, after)
        # Adapters are asked for by name among the models: checked over the catalog as it
        # would be, so a model declared after an adapter of its name is refused too.
        profiles_after = {name: entry.spec for name, entry in self._profiles.items()}
        profiles_after.update((profile.name, profile) for profile in profiles)
        problems += adapter_name_problems(profiles_after, after)
        return problems

    def _warn_about_unfit_profiles(self) -> None:
        models = self.models()
        for entry in self._profiles.values():
            for problem in validate_profile(entry.spec, models):
                log.warning(
                    "catalog: %s (an API profile that server.yaml's models no longer fit: re-apply it "
                    "fixed, or delete it with `llmgw ctl delete profile %s`)",
                    problem,
                    entry.name,
                )

    def warn_about_unservable_adapters(self) -> None:
        """Logs each profile naming a stored adapter it cannot serve (server.yaml is read before
        the adapters are; an adapter may go after its profile came): its replicas fail to start
        with the same reason, until the profile or the adapter is fixed."""
        stored = self.stored_adapters()
        for entry in self._profiles.values():
            for problem in stored_adapter_problems(entry.spec, stored):
                log.warning("catalog: %s; its replicas cannot start", problem)

    def _bump(self) -> None:
        self.changes.bump()


def _kinds(models: Iterable[Model], profiles: Iterable[Profile]) -> list[tuple[str, Model | Profile]]:
    return [("model", m) for m in models] + [("profile", p) for p in profiles]


def spec_options(spec: Model | Profile) -> dict:
    """An entry's options as JSON-ready values: what sits under its name in server.yaml."""
    options = converter.unstructure(spec)
    del options["name"]
    return options


def _row_values(entry: Entry) -> tuple[str, str, str, str, float]:
    spec = json.dumps(spec_options(entry.spec), separators=(",", ":"))
    return entry.kind, entry.name, spec, entry.source, entry.updated


def _row(entry: Entry) -> CatalogRow:
    return CatalogRow(*_row_values(entry))


def _entries(rows: Sequence[CatalogRow], where: str) -> list[Entry]:
    """Decodes stored rows with the same rules as a request, so a row that no longer fits the
    schema stops the start with its name instead of reaching the reconciler half-read."""
    sections: dict[str, list[dict]] = {"models": [], "profiles": []}
    for row in rows:
        sections[f"{row.kind}s"].append({**json.loads(row.spec), "name": row.name})
    models, profiles, problems = structure_catalog(sections)
    if problems:
        raise StoreError(f"{where}: the stored catalog cannot be read: {'; '.join(problems)}")
    source = {(row.kind, row.name): row for row in rows}
    return [
        Entry(kind, spec, source[kind, spec.name].source, source[kind, spec.name].updated)
        for kind, spec in _kinds(models, profiles)
    ]
