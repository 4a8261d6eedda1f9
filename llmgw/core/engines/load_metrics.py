"""Where each engine's /metrics says how loaded it is (its descriptor's ``metrics``): one table
for the agent and the server.

The server's scraper reads running, waiting and KV fill from it (routing and scaling); the
agent's drain waits until the running and waiting requests are none. Both read the same names,
so an engine's metrics are named once.
"""

from __future__ import annotations

from llmgw.core.engines.descriptor import EngineMetrics
from llmgw.core.engines.registry import ENGINES

__all__ = ["BUSY_METRICS", "ENGINE_METRICS", "EngineMetrics", "busy_requests"]

# Checked in order; the first whose running metric is present is the engine. Gauges keep their
# names through prometheus_client's parser, colons included (only counters lose ``_total``).
ENGINE_METRICS = tuple(engine.metrics for engine in ENGINES.values())


# Requests an engine holds, running or queued, by engine: a drain waits for all of them.
BUSY_METRICS = frozenset(name for names in ENGINE_METRICS for name in (names.running, names.waiting))


def busy_requests(metrics: str) -> int | None:
    """Requests running or queued, from Prometheus text; None when no known metric is there."""
    total: float | None = None
    for line in metrics.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name = line[: line.index("{")]
            rest = line[line.rindex("}") + 1 :].split()
        else:
            name, *rest = line.split()
        if name in BUSY_METRICS and rest:
            try:
                value = float(rest[0])
            except ValueError:
                continue
            total = (total or 0.0) + value
    return None if total is None else round(total)
