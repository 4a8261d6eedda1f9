"""The status page's overview, computed from what the admin API returns.

:func:`summarise` reads nodes and replicas in the shape of the API's JSON objects (the server
passes just the fields it counts, so a large fleet's overview stays cheap), and :class:`SampleRing` keeps a short history of fleet-wide totals so the page
can draw rates over time without a metrics database. Pure: the shell takes the samples on its
clock and passes every value in.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence

import attrs

from llmgw.core.reports import ShardState

# One sample every SAMPLE_INTERVAL seconds, MAX_SAMPLES of them: half an hour of history in a
# few tens of kilobytes.
SAMPLE_INTERVAL = 5.0
MAX_SAMPLES = 360

# Shard states whose GPUs are taken (a stopped or failed shard has let go of its cards).
_HOLDING = frozenset({ShardState.STARTING, ShardState.LOADING, ShardState.READY, ShardState.DRAINING})


def summarise(
    nodes: Sequence[Mapping], replicas: Sequence[Mapping], queue: Mapping[str, Mapping[int, int]]
) -> dict:
    """Counts for the overview: nodes by state, GPUs used/free per class, replicas by state, the
    gateway's queue. ``nodes`` and ``replicas`` have the API's node and replica objects' fields."""
    node_states: Counter[str] = Counter()
    gpu_classes: dict[str, dict[str, int]] = {}
    for node in nodes:
        node_states[node["state"]] += 1
        used = gpus_in_use(node)
        for gpu in node["inventory"].get("gpus", ()):
            row = gpu_classes.setdefault(gpu["gpu_class"], {"total": 0, "used": 0, "free": 0, "unhealthy": 0})
            row["total"] += 1
            if gpu["index"] in used:
                row["used"] += 1
            elif gpu.get("problems"):
                row["unhealthy"] += 1
            elif node["state"] == "online":
                row["free"] += 1
    replica_states = Counter(replica["state"] for replica in replicas)
    depth = sum(sum(bands.values()) for bands in queue.values())
    return {
        "nodes": {"total": len(nodes), **dict(sorted(node_states.items()))},
        "gpus": dict(sorted(gpu_classes.items())),
        "replicas": {"total": len(replicas), **dict(sorted(replica_states.items()))},
        "queue_depth": depth,
    }


def gpus_in_use(node: Mapping) -> dict[int, list[str]]:
    """A node's GPU indices that a live shard holds, each with the replicas on it."""
    used: dict[int, list[str]] = {}
    for shard in node.get("shards", ()):
        spec = shard.get("spec")
        if spec is None or shard.get("state") not in _HOLDING:
            continue
        for gpu in spec.get("gpus", ()):
            used.setdefault(gpu["index"], []).append(shard["replica_id"])
    return used


@attrs.frozen
class Sample:
    at: float  # wall clock
    requests: float  # totals since the server started: counters, so rates are differences
    errors: float
    slo_violations: float
    queue_depth: int  # gauges: the value at ``at``
    ready_replicas: int
    gpus_used: int


class SampleRing:
    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        if max_samples < 2:
            raise ValueError(f"max_samples: expected at least 2 (a rate needs two), got {max_samples!r}")
        self._samples: deque[Sample] = deque(maxlen=max_samples)

    def add(self, sample: Sample) -> None:
        if self._samples and sample.at <= self._samples[-1].at:
            return  # a clock step backwards would make a negative interval: keep the older one
        self._samples.append(sample)

    def samples(self) -> list[Sample]:
        return list(self._samples)

    def __len__(self) -> int:
        return len(self._samples)


def series(samples: Iterable[Sample]) -> list[dict]:
    """One point per interval between consecutive samples: per-second rates of the counters
    over it, and the gauges at its end. A counter that went down (a restart) counts as zero."""
    points = []
    previous: Sample | None = None
    for sample in samples:
        if previous is not None:
            span = sample.at - previous.at
            points.append(
                {
                    "at": sample.at,
                    "request_rate": _rate(previous.requests, sample.requests, span),
                    "error_rate": _rate(previous.errors, sample.errors, span),
                    "slo_violation_rate": _rate(previous.slo_violations, sample.slo_violations, span),
                    "queue_depth": sample.queue_depth,
                    "ready_replicas": sample.ready_replicas,
                    "gpus_used": sample.gpus_used,
                }
            )
        previous = sample
    return points


def _rate(before: float, after: float, span: float) -> float:
    if span <= 0 or after < before:
        return 0.0
    return (after - before) / span
