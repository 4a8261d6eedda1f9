"""The gateway's /metrics across workers: whichever worker answers shows every living worker's
series, labelled by worker, one HELP and TYPE per family, the engines' load once."""

from __future__ import annotations

import os
import re

from prometheus_client.parser import text_string_to_metric_families

from llmgw.gateway.contract import RequestRecord, Upstream
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.server.scrape import EngineSample
from llmgw.server.worker_metrics import STALE_AFTER, SharedExposition, WorkerInfo


class Engines:
    def snapshot(self):
        return {"r-1": EngineSample("m", "", running=2, waiting=0, saturation=0.5)}


def worker(tmp_path, name, *, pid, lease_left=None, clock=None):
    metrics = GatewayMetrics(engines=Engines())
    info = WorkerInfo(pid=pid, serving=True, lease_left=lease_left)
    shared = SharedExposition(metrics, tmp_path, name, lambda: info, **({"clock": clock} if clock else {}))
    metrics.answer_with(shared.exposition)
    return metrics, shared


def answer(metrics, n, replica="r-1"):
    for _ in range(n):
        upstream = Upstream(host="127.0.0.1", port=1, engine_key="", replica=replica)
        metrics.on_done(
            RequestRecord(path="/v1/chat/completions", started=0.0, model="m", upstream=upstream, status=200,
                          completed=True, finished=0.1)
        )  # fmt: skip


def samples(text: bytes, name: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_any_worker_answers_for_every_worker(tmp_path):
    m0, shared0 = worker(tmp_path, "w0", pid=100, lease_left=20.0)
    m1, shared1 = worker(tmp_path, "w1", pid=101, lease_left=25.0)
    answer(m0, 3)
    answer(m1, 5)
    m1.connections_open = 2
    shared0.write()
    shared1.write()
    for metrics in (m0, m1):
        text = metrics.exposition()
        requests = samples(text, "llmgw_requests_total")
        assert requests == {
            (("model", "m"), ("status", "200"), ("worker", "w0")): 3,
            (("model", "m"), ("status", "200"), ("worker", "w1")): 5,
        }
        assert samples(text, "llmgw_gateway_worker_info") == {
            (("pid", "100"), ("worker", "w0")): 1,
            (("pid", "101"), ("worker", "w1")): 1,
        }
        assert samples(text, "llmgw_gateway_connections") == {
            (("worker", "w0"),): 0,
            (("worker", "w1"),): 2,
        }
        assert samples(text, "llmgw_gateway_worker_lease_seconds_left") == {
            (("worker", "w0"),): 20.0,
            (("worker", "w1"),): 25.0,
        }
        # The engines' load is the same in every worker: once, with no worker label.
        assert samples(text, "llmgw_engine_running") == {(("model", "m"), ("replica", "r-1")): 2}
        # One TYPE line per family, as Prometheus requires.
        types = re.findall(rb"^# TYPE (\S+)", text, re.M)
        assert len(types) == len(set(types))


def test_a_worker_answers_with_its_own_counts_now_and_its_siblings_as_last_written(tmp_path):
    m0, shared0 = worker(tmp_path, "w0", pid=100)
    m1, _ = worker(tmp_path, "w1", pid=101)
    answer(m0, 1)
    shared0.write()
    answer(m0, 4)  # not written yet
    answer(m1, 2)  # read now, by w1 itself
    counts = samples(m1.exposition(), "llmgw_requests_total")
    assert counts[(("model", "m"), ("status", "200"), ("worker", "w0"))] == 1
    assert counts[(("model", "m"), ("status", "200"), ("worker", "w1"))] == 2
    assert (
        samples(m0.exposition(), "llmgw_requests_total")[
            (("model", "m"), ("status", "200"), ("worker", "w0"))
        ]
        == 5
    )


def test_a_gone_workers_stale_file_and_a_damaged_one_are_left_out(tmp_path):
    now = [1_000_000.0]
    m0, shared0 = worker(tmp_path, "w0", pid=100)
    m1, _ = worker(tmp_path, "w1", pid=101, clock=lambda: now[0])
    answer(m0, 1)
    shared0.write()
    os.utime(shared0.path, (now[0] - STALE_AFTER - 1, now[0] - STALE_AFTER - 1))
    (tmp_path / "w2.metrics").write_text("this is { not prometheus text\n")
    text = m1.exposition()
    assert {dict(k)["worker"] for k in samples(text, "llmgw_gateway_worker_info")} == {"w1"}
    assert not samples(text, "llmgw_requests_total")


def test_the_file_is_the_workers_alone(tmp_path):
    _, shared = worker(tmp_path, "w0", pid=100)
    shared.write()
    assert shared.path.stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob("*.tmp"))
