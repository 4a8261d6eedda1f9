"""Traces across processes: a real server and a real agent export to an OTLP/HTTP receiver this
test runs on 127.0.0.1, and a replica's start is one trace with spans from both."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.e2e.test_replicas_processes import fake_llama_server, profile, replicas
from tests.procs import Server, kill_recorded_shards, start_agent, wait_until, write_yaml

pytestmark = pytest.mark.slow

ENGINE_KEY_MARK = "llmgw-engine-key"  # what an engine key looks like nowhere in a span


class Receiver:
    """An OTLP/HTTP collector of one endpoint: POST /v1/traces, protobuf, every span kept as
    (service.name, span) with the headers each export came with."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.headers: list[dict[str, str]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver.lock:
                    receiver.headers.append(dict(self.headers))
                    for resource_spans in request.resource_spans:
                        attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                        for scope in resource_spans.scope_spans:
                            receiver.spans += [(attributes["service.name"], s) for s in scope.spans]
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def named(self, name: str) -> list[tuple[str, object]]:
        with self.lock:
            return [(service, span) for service, span in self.spans if span.name == name]

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def test_a_replica_started_on_a_real_agent_is_one_trace_from_server_to_node(tmp_path):
    receiver = Receiver()
    tracing = {"endpoint": receiver.url, "headers": {"x-collector-key": "collector-s3cret"}}
    server = Server(tmp_path)
    config = yaml.safe_load(server.config.read_text())
    write_yaml(server.config, {**config, "tracing": tracing})
    server.start()
    engines = {"llama_server": fake_llama_server(tmp_path), "run_as": None, "stop_grace": "2s"}
    agent = start_agent(tmp_path, server, "n1", engines=engines, tracing=tracing)
    try:
        wait_until(lambda: server.nodes().get("n1", {}).get("connected"), "the agent")
        server.admin(
            "POST",
            "/admin/v1/catalog",
            {
                "models": [{"name": "tiny", "path": "/models/tiny.gguf", "format": "gguf"}],
                "profiles": [profile("chat")],
            },
        )
        ready = wait_until(
            lambda: [r for r in replicas(server, "chat") if r["state"] == "Ready"], "the replica"
        )[0]
        # The agent's span lasts until the shard is Ready; batches leave every few seconds.
        until_ready = wait_until(lambda: receiver.named("shard.until_ready"), "the agent's spans")
        (service, agent_span), *_ = until_ready
        assert service == "llmgw-agent"
        trace_id = agent_span.trace_id
        in_trace = [(svc, s) for svc, s in receiver.spans if s.trace_id == trace_id]
        services = {svc for svc, _ in in_trace}
        assert services == {"llmgw-server", "llmgw-agent"}
        by_name = {s.name: (svc, s) for svc, s in in_trace}
        assert by_name["reconcile.pass"][0] == "llmgw-server"
        assert by_name["reconcile.StartReplica"][0] == "llmgw-server"
        assert {"replica.start_shard", "agent.start_shard", "engine.launch", "readiness"} <= set(by_name)
        # Parents: pass → action → the server's start → (the command) → the agent's → until ready.
        ids = {s.span_id: s for _, s in in_trace}
        assert ids[by_name["agent.start_shard"][1].parent_span_id].name == "replica.start_shard"
        assert ids[by_name["replica.start_shard"][1].parent_span_id].name == "reconcile.StartReplica"
        assert ids[by_name["shard.until_ready"][1].parent_span_id].name == "agent.start_shard"
        assert ids[by_name["readiness"][1].parent_span_id].name == "shard.until_ready"
        attributes = {a.key: a.value.string_value for a in by_name["replica.start_shard"][1].attributes}
        assert attributes["llmgw.replica"] == ready["id"] and attributes["llmgw.node"] == "n1"
        # The collector's header went with every export; no secret went into a span.
        assert all(h.get("x-collector-key") == "collector-s3cret" for h in receiver.headers)
        with receiver.lock:
            dumped = b"".join(span.SerializeToString() for _, span in receiver.spans)
        assert b"s3cret" not in dumped
        join_token = (server.data_dir / "join-token").read_text().strip().encode()
        assert join_token not in dumped
        assert "collector-s3cret" not in server.proc.output() and "collector-s3cret" not in agent.output()
    finally:
        agent.stop()
        server.proc.stop()
        kill_recorded_shards(tmp_path / "agent-n1")
        receiver.close()
