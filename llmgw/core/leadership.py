"""Who leads the control planes sharing one store: a lease with a fencing term.

One row in the store says which server holds the lease, until when (by the store's clock, so
the servers' own clocks need not agree), and the lease's ``term``. A server that finds the lease
free or expired takes it with the next term; the holder renews it before it runs out; everyone
else follows. The term grows on every change of holder — and on every lapse, even when the same
server takes it again, since a server whose lease lapsed may have missed what another did.

Every command a leader sends an agent carries its term (see :mod:`llmgw.core.fencing`): an agent
that has seen a newer term refuses it, which is what stops a paused leader that wakes up with a
stale view. A holder also keeps its own deadline (:func:`local_deadline`), by its own monotonic
clock and counted from before it asked the store, so it stops acting on its own before the
store could have let anyone else in.

The store runs :func:`decide` inside one transaction holding the row, so two servers asking at
once are served one after the other: a compare-and-set.
"""

from __future__ import annotations

import attrs

# What is left to the holder when computing its own deadline: the store's clock and the holder's
# may run at slightly different rates, and the lease is only safe if the holder stops first.
DRIFT_MARGIN = 0.5  # seconds


@attrs.frozen
class LeaseRow:
    """The lease as the store holds it. ``holder`` '' is nobody (released, or never taken)."""

    holder: str
    term: int
    expires: float  # the store's clock, seconds
    address: str = ""  # the holder's agent-link address, for people and for agents' logs


@attrs.frozen
class Decision:
    """What one look at the lease decided, for the server ``me``.

    ``write`` is the row to store (None: leave it as it is). ``leader`` says whether ``me``
    holds the lease under ``term`` once it is written; ``holder``/``address`` who holds it."""

    write: LeaseRow | None
    leader: bool
    term: int
    holder: str
    address: str
    reason: str


def decide(
    row: LeaseRow | None, *, now: float, me: str, address: str, lease: float, force: bool = False
) -> Decision:
    """Acquire, renew or follow. ``force`` takes the lease whatever the row says: for a store
    only this server can open (SQLite in its own data_dir), where waiting out a lease a crashed
    predecessor left would only delay the restart."""
    if lease <= 0:
        raise ValueError(f"lease must be > 0, got {lease}")
    if row is None:
        row = LeaseRow(holder="", term=0, expires=0.0)
    held = row.holder != "" and now < row.expires
    if held and row.holder == me and not force:
        renewed = LeaseRow(holder=me, term=row.term, expires=now + lease, address=address)
        return Decision(renewed, True, row.term, me, address, "renewed")
    if held and not force:
        return Decision(None, False, row.term, row.holder, row.address, f"held by {row.holder}")
    taken = LeaseRow(holder=me, term=row.term + 1, expires=now + lease, address=address)
    if force:
        why = "taken over (this store has one server)"
    elif row.holder == "":
        why = "free"
    else:
        why = f"expired (held by {row.holder})"
    return Decision(taken, True, taken.term, me, address, f"acquired: {why}")


def release(row: LeaseRow | None, *, now: float, me: str) -> LeaseRow | None:
    """The row after ``me`` gives the lease up on purpose (a clean shutdown), so a follower takes
    it at its next look instead of waiting out the lease; None when ``me`` does not hold it."""
    if row is None or row.holder != me:
        return None
    return LeaseRow(holder="", term=row.term, expires=now, address="")


def local_deadline(asked_at: float, lease: float) -> float:
    """Until when (the holder's own monotonic clock) a holder may act on a lease it was granted
    by a request sent at ``asked_at``: the store counted the lease from a moment after that."""
    return asked_at + lease - min(DRIFT_MARGIN, lease / 4)


def renew_interval(lease: float) -> float:
    """How often the holder renews and followers look: three tries within one lease, so one slow
    or lost round trip does not cost the lease, and a follower notices a lapse within a third."""
    return lease / 3
