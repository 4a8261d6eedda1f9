"""Lifecycles as tables: which state may follow which, and one check that raises on anything else.

h11's ``_state.py`` is the model: the table *is* the code. A record's state changes only through
:meth:`Lifecycle.move` (:meth:`Lifecycle.move_in_place` for a mutable one, :meth:`Lifecycle.check`
where the caller builds the record itself), so an illegal move — a Stopped replica made Ready, a
Succeeded job set Training — fails at the line that tried it instead of surfacing later as a
record in a state nothing expects.

Staying in the same state is always legal: reports repeat, and a pass that re-applies what is
already true must not need a special case.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any, Generic, TypeVar

import attrs

S = TypeVar("S", bound=enum.StrEnum)
R = TypeVar("R")


class IllegalTransition(ValueError):
    """A state change the lifecycle's table does not allow."""


@attrs.frozen
class Lifecycle(Generic[S]):
    """The legal moves of one kind of record: ``moves[old]`` is every state that may follow ``old``."""

    name: str  # what the records are, for the error ("replica", "shard", "job")
    moves: Mapping[S, frozenset[S]]

    @classmethod
    def of(cls, name: str, states: type[S], moves: Mapping[S, Iterable[S]]) -> Lifecycle[S]:
        """Build one from a table that names every state (a state missing from it is a typo, so
        it raises here, at import, instead of making that state a dead end). A row or a move
        naming something that is not one of ``states`` (a plain string mistyped) raises too."""
        missing = set(states) - set(moves)
        if missing:
            raise ValueError(f"{name} lifecycle: no row for {', '.join(sorted(missing))}")
        strangers = {s for old, new in moves.items() for s in (old, *new) if not isinstance(s, states)}
        if strangers:
            raise ValueError(f"{name} lifecycle: not a state: {', '.join(sorted(map(str, strangers)))}")
        return cls(name, {old: frozenset(new) for old, new in moves.items()})

    def allows(self, old: str, new: str) -> bool:
        return old == new or new in self.moves.get(old, frozenset())  # type: ignore[call-overload]

    def check(self, old: str, new: str) -> None:
        if not self.allows(old, new):
            raise IllegalTransition(f"{self.name}: {old} → {new} is not a legal move")

    def move(self, record: R, new: S, **changes: Any) -> R:
        """``record`` (a frozen attrs instance with a ``state`` field) in ``new``, with ``changes``."""
        self.check(record.state, new)  # type: ignore[attr-defined]
        return attrs.evolve(record, state=new, **changes)  # type: ignore[misc]

    def move_in_place(self, record: Any, new: S) -> None:
        """``record`` (a mutable one with a ``state`` attribute: a task's own bookkeeping, as the
        agent's shards and jobs are) set to ``new``, after the same check as :meth:`move`."""
        self.check(record.state, new)
        record.state = new

    def terminal(self) -> frozenset[S]:
        """The states nothing follows."""
        return frozenset(old for old, new in self.moves.items() if not new - {old})
