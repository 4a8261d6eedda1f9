"""When a node counts as lost, and when a link counts as dead.

Both are the same rule — silence longer than ``interval × missed`` — applied to two clocks: a link
end closes a connection that has gone quiet (the peer may be a half-open socket), and the server's
registry marks a node lost when nothing has been heard from it for that long, connected or not.
A disconnect alone does not make a node lost: an agent that restarts reconnects within the window
and its engines never stopped, so the node must not flap to lost and back.
"""

from __future__ import annotations

import enum

import attrs


class NodeState(enum.StrEnum):
    ONLINE = "online"
    LOST = "lost"


@attrs.frozen
class Liveness:
    interval: float  # seconds between heartbeats
    missed: int  # heartbeats that may go missing before we give up

    @property
    def window(self) -> float:
        return self.interval * self.missed

    def silent_too_long(self, last_heard: float, now: float) -> bool:
        return now - last_heard > self.window


def node_state(liveness: Liveness, *, last_heard: float, now: float) -> NodeState:
    """The state a node should be in; ``last_heard`` is on the same clock as ``now``.

    Whether the node is connected right now does not enter into it (see the module docstring).
    """
    return NodeState.LOST if liveness.silent_too_long(last_heard, now) else NodeState.ONLINE
