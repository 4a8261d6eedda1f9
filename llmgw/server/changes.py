"""A change counter that tasks can wait on: the catalog's and the fleet's, for the reconciler.

A waiter remembers the version it last acted on and waits for a later one, so a change that
happens while it is busy is never missed (an Event alone would be, if set and cleared meanwhile).
"""

from __future__ import annotations

import trio


class Changes:
    def __init__(self) -> None:
        self.version = 0
        self._event = trio.Event()

    def bump(self) -> None:
        self.version += 1
        self._event.set()
        self._event = trio.Event()

    async def wait_past(self, seen: int) -> int:
        """The version, once it is past ``seen`` (at once if it already is)."""
        while self.version == seen:
            await self._event.wait()
        return self.version
