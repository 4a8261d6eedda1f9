"""Where a model's requests may go: the ready upstreams (engine replicas) for a model name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs


@attrs.frozen
class Upstream:
    """One engine replica's OpenAI endpoint and the key it expects."""

    host: str
    port: int
    engine_key: str = attrs.field(repr=False)  # a secret: kept out of logs
    replica: str = ""  # the replica's id, for metrics; empty where upstreams are not replicas


class Router(Protocol):
    """What the relay asks about models; the control plane implements it from its replica table."""

    def models(self) -> Sequence[str]:
        """The model names served, for GET /v1/models."""
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

    def ready_upstreams(self, model: str) -> Sequence[Upstream] | None:
        return self.routes.get(model)
