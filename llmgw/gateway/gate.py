"""Who may ask for what: the hook through which the control plane admits each request.

The relay knows HTTP and engines; the gate knows API keys, quotas and the admission queue. For
every model request the relay asks the gate, in order: who is calling (``authenticate``, before the
body is even parsed), may they use this model and is there room (``admit``, which may wait in the
admission queue), and, once the answer has gone out, what it cost (``finish``). ``GET /v1/models``
lists what ``models`` lets the caller see. A gate raises GatewayError to refuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from llmgw.gateway.relay import RequestRecord


class Gate(Protocol):
    def authenticate(self, authorization: str | None) -> Any:
        """The caller, from the Authorization header's value (None when absent); 401 if unknown."""
        ...

    def models(self, caller: Any, served: Sequence[str]) -> Sequence[str]:
        """Of the models served, those this caller may use."""
        ...

    async def admit(self, caller: Any, model: str, payload: dict, body_size: int) -> Any:
        """A ticket to go ahead: model allowed (else 403), quota reserved (else 429), a place
        through the admission queue (may wait; 429 when full), and a replica with room. The
        ticket's ``upstreams`` are where to send the request, best first: the relay tries them
        in that order. Cancellation leaves nothing held. `payload` is the decoded body,
        `body_size` its length in bytes."""
        ...

    def finish(self, ticket: Any, record: RequestRecord) -> None:
        """The request ended (answered, failed or abandoned): settle what the ticket reserved."""
        ...
