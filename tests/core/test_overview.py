"""core.overview: the overview's counts from the API's node and replica JSON, the sample ring,
and rates over it; core.events: the bounded event log."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.events import EventLog
from llmgw.core.overview import Sample, SampleRing, gpus_in_use, series, summarise


def gpu(index, gpu_class="l40s-45g", problems=()):
    return {"index": index, "gpu_class": gpu_class, "problems": list(problems)}


def shard(replica, state, indices):
    return {"replica_id": replica, "state": state, "spec": {"gpus": [{"index": i} for i in indices]}}


NODES = [
    {
        "name": "a",
        "state": "online",
        "inventory": {"gpus": [gpu(0), gpu(1), gpu(2, problems=["ecc-uncorrected"]), gpu(3, "h100-80g")]},
        "shards": [shard("r-1", "Ready", [0]), shard("r-2", "Failed", [1]), shard("r-3", "Loading", [3])],
    },
    {"name": "b", "state": "lost", "inventory": {"gpus": [gpu(0), gpu(1)]}, "shards": []},
    {"name": "c", "state": "online", "inventory": {"gpus": []}, "shards": [shard("r-4", "Ready", [])]},
]


def test_summarise_counts_nodes_gpus_replicas_and_the_queue():
    replicas = [{"state": "Ready"}, {"state": "Ready"}, {"state": "Pending"}]
    queue = {"m1": {0: 2, 10: 1}, "m2": {0: 4}}
    assert summarise(NODES, replicas, queue) == {
        "nodes": {"total": 3, "lost": 1, "online": 2},
        # A failed shard has let go of its card; a lost node's free cards are not free to use.
        "gpus": {
            "h100-80g": {"total": 1, "used": 1, "free": 0, "unhealthy": 0},
            "l40s-45g": {"total": 5, "used": 1, "free": 1, "unhealthy": 1},
        },
        "replicas": {"total": 3, "Pending": 1, "Ready": 2},
        "queue_depth": 7,
    }


def test_gpus_in_use_names_the_replicas_on_each_card():
    node = {
        "shards": [
            shard("r-1", "Ready", [0, 1]),
            shard("r-2", "Starting", [1]),
            {"replica_id": "x", "state": "Ready", "spec": None},
        ]
    }
    assert gpus_in_use(node) == {0: ["r-1"], 1: ["r-1", "r-2"]}


def sample(at, requests=0.0, errors=0.0, slo=0.0, queue=0):
    return Sample(
        at=at,
        requests=requests,
        errors=errors,
        slo_violations=slo,
        queue_depth=queue,
        ready_replicas=1,
        gpus_used=2,
    )


def test_series_gives_rates_between_samples_and_zero_after_a_counter_reset():
    points = series([sample(0, 0), sample(5, 50, 5, 1, queue=3), sample(10, 10)])
    assert [p["request_rate"] for p in points] == [10.0, 0.0]
    assert points[0]["error_rate"] == 1.0 and points[0]["slo_violation_rate"] == 0.2
    assert points[0]["queue_depth"] == 3 and points[0]["at"] == 5


def test_the_ring_is_bounded_and_ignores_a_clock_going_back():
    ring = SampleRing(max_samples=3)
    for at in (1, 2, 3, 4, 2):
        ring.add(sample(at))
    assert [s.at for s in ring.samples()] == [2, 3, 4]
    with pytest.raises(ValueError, match="max_samples"):
        SampleRing(max_samples=1)


@given(st.lists(st.tuples(st.floats(0.1, 100), st.floats(0, 1e6)), max_size=30))
def test_rates_are_never_negative(steps):
    at, samples = 0.0, []
    for gap, requests in steps:
        at += gap
        samples.append(sample(at, requests))
    assert all(p["request_rate"] >= 0 for p in series(samples))
    assert len(series(samples)) == max(0, len(samples) - 1)


def test_event_log_is_bounded_and_reads_after_a_sequence_number():
    log = EventLog(max_events=3)
    for i in range(5):
        log.record(float(i), "StartReplica", f"r-{i}", "because")
    assert len(log) == 3 and log.last_seq == 5
    assert [e.subject for e in log.since(0)] == ["r-2", "r-3", "r-4"]
    assert [e.seq for e in log.since(3)] == [4, 5]
    assert log.since(5) == []
    assert [e.seq for e in log.since(0, limit=1)] == [5]
    with pytest.raises(ValueError, match="max_events"):
        EventLog(max_events=0)
