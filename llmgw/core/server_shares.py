"""Quotas across servers sharing one store: each live server admits against its share.

Each server enforces its share of every limit on its own (its gateway, or its workers' leases of
it), so no request waits on another server. The shares are static splits of each limit over the
live servers (those that looked at the leader lease within one lease, from the store's servers
table), by rank in the sorted list of their ids: ``limit // n``, plus one for the first
``limit % n`` ranks, so they sum to the limit exactly. No share may be 0 (a Limits of 0 would
mean a suspension), so a limit below the number of servers gives every server 1.

**The bound.** While the set of live servers stays the same, everything admitted in any window's
span, over all servers, is at most the limit (plus core.quota's one-request overrun per server):
each server's own windows hold at most its share. A server joining or leaving changes the shares
at each server's next look at the lease (within lease/3); a server's windows still hold what it
admitted under its old share, so each change of the live set can add at most one old share per
server (``ceil(limit / n)``) to the windows it overlaps — in practice one leaving server's share,
which its survivors take over while its admissions are still in the window: at most
``limit + ceil(limit / n)`` in a minute that spans a server's death. A limit below the number of
servers is exceeded by up to ``n - limit`` (each server holding 1).
"""

from __future__ import annotations

import attrs

from llmgw.core.quota import Limits


@attrs.frozen
class ServerShare:
    """This server's place among the live ones: ``rank`` in 0..servers-1."""

    servers: int = 1
    rank: int = 0

    @classmethod
    def of(cls, live: list[str] | tuple[str, ...], me: str) -> ServerShare:
        """From the live servers' ids (``me`` counted whether or not the list has it yet)."""
        ids = sorted(set(live) | {me})
        return cls(servers=len(ids), rank=ids.index(me))


def split(limit: int | None, share: ServerShare) -> int | None:
    if limit is None or share.servers <= 1:
        return limit
    base, extra = divmod(limit, share.servers)
    return max(1, base + (1 if share.rank < extra else 0))


def share_of(limits: Limits, share: ServerShare) -> Limits:
    """This server's part of ``limits``."""
    if share.servers <= 1:
        return limits
    return Limits(rpm=split(limits.rpm, share), tpm=split(limits.tpm, share), tpd=split(limits.tpd, share))
