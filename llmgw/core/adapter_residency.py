"""Adapters loaded on demand: which replica holds which adapter, and where a cold one goes.

A profile with ``max_loaded_adapters: N`` starts its engines with no adapter loaded and room
for N; the control plane loads one through the engine's runtime LoRA API when a request first
wants it. This module is that decision, for every replica of such profiles at once; the shell
(``server.adapter_loads``) carries out what it decides and tells it how that went.

For a request naming adapter A, :meth:`Residency.want` answers:

- :class:`Use` — a replica that holds A has room for the request: go there (the least loaded
  such holder);
- :class:`Await` — A is being loaded already: wait for that load (**single flight**: however
  many requests want a cold adapter at once, it is loaded once);
- :class:`Load` — load A on the replica best placed for it: one that takes requests now before
  one that does not, then the least loaded, then one with a free adapter slot before one that
  must unload another adapter first, then the least loaded. The victim (``evict``) is the least recently used adapter
  of that replica with **no request in flight**; an adapter in use is never unloaded;
- :class:`Queue` — every holder is busy and no replica with room can take A: wait for a holder's
  room rather than push out another adapter to open a second copy nowhere faster;
- :class:`NoRoom` — nobody holds A and every adapter slot holds an adapter in use (or is being
  changed): try again when a request ends.

A load the shell reports failed (:meth:`load_failed`) leaves A unloaded, and only the next
request that wants it starts another: a broken adapter is not retried in a loop. A replica whose
engine has not yet said what it holds (just Ready, or known from before a server restart) takes
no load until :meth:`relearn` has been given the engine's list: the control plane never loads
twice what it merely forgot.

Pure: no I/O; ``now`` and the requests in flight per (replica, adapter) are parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs

frozen = attrs.frozen(kw_only=True)


@frozen
class ReplicaView:
    """One Ready replica of an on-demand profile, as the choice needs it now."""

    id: str
    load: float = 0.0  # requests in flight per slot: the least loaded is the best placed
    has_room: bool = True  # takes another request now


@frozen
class Use:
    replica: str


@frozen
class Await:
    replica: str  # where the adapter is being loaded


@frozen
class Load:
    replica: str
    evict: str | None = None  # unload this one first (its slot is needed)


@frozen
class Queue:
    holders: tuple[str, ...]  # replicas that hold the adapter, all busy


@frozen
class NoRoom:
    reason: str


Want = Use | Await | Load | Queue | NoRoom


@attrs.define
class _Replica:
    capacity: int
    known: bool = False  # its engine's list has been learned
    resident: dict[str, float] = attrs.field(factory=dict)  # adapter -> when last used
    loading: set[str] = attrs.field(factory=set)
    unloading: set[str] = attrs.field(factory=set)

    def slots_taken(self) -> int:
        # A victim being unloaded gives its slot to the load that evicted it: the shell loads
        # only once the unload is done, so the engine never holds both.
        return len(self.resident) + len(self.loading)


class Residency:
    """The adapters held by every replica of the on-demand profiles, as the control plane knows
    them; changed only by its own decisions and by what the shell reports back."""

    def __init__(self) -> None:
        self._replicas: dict[str, _Replica] = {}

    # --- the replicas ------------------------------------------------------------------------------

    def sync(self, capacities: Mapping[str, int]) -> list[str]:
        """The Ready replicas now (id -> max_loaded_adapters): new ones are added, not yet known;
        gone ones are forgotten. Returns the replicas whose engine's list is still to be learned."""
        for gone in self._replicas.keys() - capacities.keys():
            del self._replicas[gone]
        for replica, capacity in capacities.items():
            held = self._replicas.get(replica)
            if held is None:
                self._replicas[replica] = _Replica(capacity=capacity)
            else:
                held.capacity = capacity
        return sorted(r for r, held in self._replicas.items() if not held.known)

    def relearn(self, replica: str, adapters: Iterable[str], now: float) -> None:
        """What the replica's engine says it holds (after a restart of the server, the agent or
        nothing at all): that is what it holds, loads under way aside."""
        held = self._replicas.get(replica)
        if held is None:
            return
        names = set(adapters) - held.loading - held.unloading
        held.resident = {name: held.resident.get(name, now) for name in sorted(names)}
        held.known = True

    def replicas(self) -> list[str]:
        """The replicas followed, known or not."""
        return sorted(self._replicas)

    def holders(self, adapter: str) -> list[str]:
        """The replicas that hold ``adapter`` and may be sent its requests."""
        return sorted(r for r, held in self._replicas.items() if adapter in held.resident)

    def held(self, replica: str) -> list[str]:
        held = self._replicas.get(replica)
        return sorted(held.resident) if held is not None else []

    def loading(self, replica: str) -> list[str]:
        held = self._replicas.get(replica)
        return sorted(held.loading) if held is not None else []

    def capacity(self, replica: str) -> int:
        held = self._replicas.get(replica)
        return held.capacity if held is not None else 0

    # --- the decision --------------------------------------------------------------------------------

    def want(
        self,
        adapter: str,
        replicas: Sequence[ReplicaView],
        in_flight: Mapping[tuple[str, str], int],
        now: float,
    ) -> Want:
        """Where a request for ``adapter`` goes, or what to do first (see the module's text).
        ``replicas``: the model's Ready replicas that may serve it; ``in_flight``: requests in
        flight per (replica, adapter). A Load is recorded at once (the adapter is loading there,
        and its victim unloading): the next want() of it awaits that load."""
        views = [view for view in replicas if view.id in self._replicas]
        holders = [view for view in views if adapter in self._replicas[view.id].resident]
        with_room = [view for view in holders if view.has_room]
        if with_room:
            best = min(with_room, key=lambda view: (view.load, view.id))
            self._replicas[best.id].resident[adapter] = now
            return Use(replica=best.id)
        loading = sorted(view.id for view in views if adapter in self._replicas[view.id].loading)
        if loading:
            return Await(replica=loading[0])
        options = []
        for view in views:
            held = self._replicas[view.id]
            if not held.known or adapter in held.resident or held.capacity < 1:
                continue
            if holders and not view.has_room:
                continue  # a second copy where requests wait too would serve nobody sooner
            if held.slots_taken() < held.capacity:
                victim = None
            else:
                victim = self._victim(view.id, in_flight)
                if victim is None:
                    continue
            options.append(((not view.has_room, victim is not None, view.load, view.id), view.id, victim))
        if options:
            _, replica, victim = min(options)
            held = self._replicas[replica]
            held.loading.add(adapter)
            if victim is not None:
                del held.resident[victim]
                held.unloading.add(victim)
            return Load(replica=replica, evict=victim)
        if holders:
            return Queue(holders=tuple(view.id for view in holders))
        if not views:
            return NoRoom(reason=f"no Ready replica may load adapter {adapter}")
        if not any(self._replicas[view.id].known for view in views):
            return NoRoom(reason="the replicas' engines have not yet said which adapters they hold")
        return NoRoom(
            reason=f"every replica's adapter slots hold adapters with requests in flight; {adapter} waits"
        )

    def _victim(self, replica: str, in_flight: Mapping[tuple[str, str], int]) -> str | None:
        held = self._replicas[replica]
        idle = [
            (used, name) for name, used in held.resident.items() if in_flight.get((replica, name), 0) <= 0
        ]
        return min(idle)[1] if idle else None

    def used(self, replica: str, adapter: str, now: float) -> None:
        """A request for ``adapter`` went to ``replica`` (or was seen in flight there)."""
        held = self._replicas.get(replica)
        if held is not None and adapter in held.resident:
            held.resident[adapter] = max(held.resident[adapter], now)

    # --- what the shell reports back -------------------------------------------------------------

    def loaded(self, replica: str, adapter: str, now: float) -> None:
        held = self._replicas.get(replica)
        if held is None:
            return
        held.loading.discard(adapter)
        held.resident[adapter] = now

    def load_failed(self, replica: str, adapter: str) -> None:
        """The load did not happen: the adapter is not held there, and nothing retries it but
        the next request that wants it."""
        held = self._replicas.get(replica)
        if held is not None:
            held.loading.discard(adapter)

    def unloaded(self, replica: str, adapter: str) -> None:
        held = self._replicas.get(replica)
        if held is not None:
            held.unloading.discard(adapter)

    def unload_failed(self, replica: str, adapter: str, now: float) -> None:
        """The engine kept it (its unload was refused): it holds it still."""
        held = self._replicas.get(replica)
        if held is not None and adapter in held.unloading:
            held.unloading.discard(adapter)
            held.resident[adapter] = now
