"""Which lower-band replicas to stop so that one that fits nowhere can be placed.

The search is over the ledger (:mod:`llmgw.core.reconcile.holds`) and changes nothing: the pass
carries out what it finds. The cheapest set is the one whose highest band is lowest, then the
fewest replicas, then the newest (they have the least warm caches), on one node for a single-node
profile or on one fabric for a multi-node one.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from llmgw.core.catalog import Profile
from llmgw.core.placement import NodeView, Placement
from llmgw.core.reconcile.holds import Ledger
from llmgw.core.replica import Replica

# Preemption searches one pass makes. Each may try every node of the fleet for the cheapest
# replicas to take (tens of milliseconds on a fleet of thousands of nodes); more would hold the
# server's event loop too long. The other blocked replicas get theirs on the next pass, which
# costs little: what is preempted takes seconds to stop anyway.
SEARCHES_PER_PASS = 3

BandOf = Callable[[Replica], int]


def preference(band_of: BandOf) -> Callable[[Replica], tuple[int, float, str]]:
    """The order victims are taken in: the lowest band, then the newest."""
    return lambda record: (band_of(record), -record.created, record.id)


def room_being_freed(ledger: Ledger, profile: Profile, leaving: frozenset[str]) -> Placement | None:
    """Where ``profile`` fits once the owners in ``leaving`` (stopping, draining) are gone."""
    for nodes in ledger.islands(profile, leaving).values():
        placement = ledger.fit_without(nodes, profile, leaving)
        if placement is not None:
            return placement
    return None


def cheapest_victims(
    ledger: Ledger, candidates: list[Replica], profile: Profile, leaving: frozenset[str], band_of: BandOf
) -> tuple[list[Replica], Placement] | None:
    """Which of ``candidates`` to preempt, and where ``profile`` would go once they are gone."""
    key = preference(band_of)
    on_node: dict[str, list[Replica]] = collections.defaultdict(list)
    for candidate in candidates:
        for node in dict.fromkeys(s.node for s in candidate.shards):
            on_node[node].append(candidate)
    best: tuple[tuple[object, ...], list[Replica], Placement] | None = None
    for island, nodes in ledger.islands(profile, {c.id for c in candidates}).items():
        local = sorted({c.id: c for n in nodes for c in on_node[n.name]}.values(), key=key)
        found = _victims(ledger, local, nodes, profile, leaving)
        if found is not None:
            chosen, placement = found
            rank = (max(map(band_of, chosen)), len(chosen), -max(c.created for c in chosen), island)
            if best is None or rank < best[0]:
                best = (rank, chosen, placement)
    return None if best is None else (best[1], best[2])


def _victims(
    ledger: Ledger, local: list[Replica], nodes: list[NodeView], profile: Profile, leaving: frozenset[str]
) -> tuple[list[Replica], Placement] | None:
    """The first of ``local`` (in preference order) whose removal lets ``profile`` fit, pruned."""
    chosen: list[Replica] = []
    for candidate in local:
        chosen.append(candidate)
        placement = ledger.fit_without(nodes, profile, leaving | {c.id for c in chosen})
        if placement is not None:
            break
    else:
        return None
    # Freeing more never makes a fit impossible, so the last one taken was needed; an earlier
    # one may not be (a small replica taken before the large one that alone makes room).
    for candidate in reversed(chosen[:-1]):
        fewer = [c for c in chosen if c is not candidate]
        smaller = ledger.fit_without(nodes, profile, leaving | {c.id for c in fewer})
        if smaller is not None:
            chosen, placement = fewer, smaller
    return chosen, placement
