"""A bounded log of what the control plane did, newest last: the status page's events.

The reconciler's shell records every action it carries out (starts, restarts, drains, failures,
pending placements) with its reason. Each event has a sequence number, so a page that polls asks
only for those after the last it has.
"""

from __future__ import annotations

from collections import deque

import attrs

# About an hour of a busy fleet's actions; a few hundred bytes each.
MAX_EVENTS = 1000


@attrs.frozen
class Event:
    seq: int
    at: float  # wall clock
    kind: str  # the action's name: StartReplica, MarkFailed, ...
    subject: str  # a replica id, or node/shard
    reason: str


class EventLog:
    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        if max_events < 1:
            raise ValueError(f"max_events: expected at least 1, got {max_events!r}")
        self._events: deque[Event] = deque(maxlen=max_events)
        self._seq = 0

    def record(self, at: float, kind: str, subject: str, reason: str) -> Event:
        self._seq += 1
        event = Event(seq=self._seq, at=at, kind=kind, subject=subject, reason=reason)
        self._events.append(event)
        return event

    def since(self, seq: int = 0, limit: int = MAX_EVENTS) -> list[Event]:
        """Events with a sequence number above ``seq``, oldest first, at most the newest ``limit``."""
        newer: list[Event] = []
        for event in reversed(self._events):  # newest first; sequence numbers only grow
            if event.seq <= seq or len(newer) >= limit:
                break
            newer.append(event)
        return newer[::-1]

    @property
    def last_seq(self) -> int:
        return self._seq

    def __len__(self) -> int:
        return len(self._events)
