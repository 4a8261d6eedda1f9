"""The agent's side of leadership: refuse commands from a leader older than the newest seen.

Servers tell the agent their lease term (in Registered, in every heartbeat, and on every
command); the agent keeps the newest it has seen, on disk so a restart keeps it. A command whose
term is older was decided by a server that has since lost the lease — a leader paused past its
lease and resumed, say — on a view another leader may already have changed, so it is refused,
with the newer term in the answer, and that server steps down.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Verdict:
    ok: bool
    newest: int  # the newest term seen, this command's included
    reason: str = ""


def seen(newest: int, term: int) -> int:
    """The newest term after hearing ``term`` (a heartbeat or Registered from a leader)."""
    return max(newest, term)


def admit(newest: int, term: int) -> Verdict:
    """Whether a command of ``term`` may run on an agent that has seen ``newest``."""
    if term < newest:
        return Verdict(
            False,
            newest,
            f"fenced: the command is of leader term {term}, and this agent has seen term {newest}",
        )
    return Verdict(True, term)
