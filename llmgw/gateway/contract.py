"""The gateway's contract: what the data plane and the control plane say to each other.

The relay knows HTTP and engines; the control plane knows replicas, API keys, quotas and the
admission queue. Everything that passes between them is here, so that each side imports this
module and neither imports the other:

- a :class:`Router` names the models served and, for a relay without a gate, their upstreams;
- an :class:`Upstream` is one engine replica's endpoint and the key it expects;
- a :class:`Gate` admits each request. For every model request the relay asks it, in order: who
  is calling (``authenticate``, before the body is even parsed), may they use this model and is
  there room (``admit``, which may wait in the admission queue, and whose ticket says where to
  send the request), and, once the answer has gone out, what it cost (``finish``, with the
  request's :class:`RequestRecord`). ``GET /v1/models`` lists what ``models`` lets the caller
  see. A gate raises GatewayError to refuse.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from llmgw.gateway.usage_scan import Usage


@attrs.frozen
class Upstream:
    """One engine replica's OpenAI endpoint and the key it expects."""

    host: str
    port: int
    engine_key: str = attrs.field(repr=False)  # a secret: kept out of logs
    replica: str = ""  # the replica's id, for metrics; empty where upstreams are not replicas
    # A JSON object whose members the relay sets in the request's body before sending it here
    # (llama.cpp's per-request adapter list); empty: the body goes as the client sent it.
    body_members: bytes = b""


class Router(Protocol):
    """What the relay asks about models; the control plane implements it from its replica table."""

    def models(self) -> Sequence[str]:
        """The model names served, for GET /v1/models: base models and adapters."""
        ...

    def parent(self, name: str) -> str | None:
        """The base model of adapter ``name``; None when ``name`` is not an adapter."""
        ...

    def ready_upstreams(self, model: str) -> Sequence[Upstream] | None:
        """The ready upstreams for `model`, in the order to try them; None when no such model
        is served. A relay with a gate takes the order the gate chose for the request instead.

        Empty (not None) when the model exists but no replica is ready, which is a 503, not a 404.
        """
        ...


@attrs.frozen
class StaticRouter:
    """A fixed table of models to upstreams: for tests and benchmarks."""

    routes: Mapping[str, Sequence[Upstream]]

    def models(self) -> Sequence[str]:
        return list(self.routes)

    def parent(self, name: str) -> str | None:
        return None

    def ready_upstreams(self, model: str) -> Sequence[Upstream] | None:
        return self.routes.get(model)


@attrs.define
class RequestRecord:
    """What happened to one model request, handed to `on_done` when it ends (for accounting)."""

    path: str
    started: float  # trio.current_time()
    model: str | None = None
    stream: bool = False
    upstream: Upstream | None = None
    status: int = 0  # what the client was told; 0 if it was told nothing
    usage: Usage | None = None
    completed: bool = False  # the whole answer reached the client
    finished: float = 0.0
    # When the answer's first body bytes went to the client: a stream's first token, or the
    # whole of a non-streaming answer. None if none went.
    first_byte: float | None = None

    @property
    def usage_missing(self) -> bool:
        """An engine answered with success (the client may have had tokens) and said nothing of
        its usage: the request is to be accounted at its estimate, flagged, never at 0."""
        return self.usage is None and self.upstream is not None and 200 <= self.status < 300


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
