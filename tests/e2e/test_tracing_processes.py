"""Traces across processes: a real server, its gateway workers and a real agent export to an
OTLP/HTTP receiver this test runs on 127.0.0.1. A replica's start is one trace with spans from the
server and the agent; a client's request, with its traceparent, is one trace from the gateway
worker that served it, and the engine is handed that trace."""

from __future__ import annotations

import http.client
import json
import os
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
        self.instances: dict[bytes, str] = {}  # span id: its process's service.instance.id
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
                            for s in scope.spans:
                                receiver.instances[s.span_id] = attributes.get("service.instance.id", "")
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
        wanted = {"reconcile.pass", "reconcile.StartReplica", "replica.start_shard", "agent.start_shard"}

        def whole() -> list:
            # Each process exports in its own batches: the server's may come after the agent's.
            with receiver.lock:
                found = [(svc, s) for svc, s in receiver.spans if s.trace_id == trace_id]
            return found if wanted <= {s.name for _, s in found} else []

        in_trace = wait_until(whole, "the server's spans of the replica's trace")
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


def attributes_of(span) -> dict:
    return {a.key: a.value.string_value or a.value.int_value or a.value.bool_value for a in span.attributes}


def test_a_request_through_real_gateway_workers_is_one_trace_from_the_client_to_the_engine(tmp_path):
    receiver = Receiver()
    tracing = {"endpoint": receiver.url}
    server = Server(tmp_path, gateway={"workers": 2})
    config = yaml.safe_load(server.config.read_text())
    write_yaml(server.config, {**config, "tracing": tracing})
    server.start()
    traceparents = tmp_path / "traceparents"
    engines = {
        "llama_server": fake_llama_server(tmp_path, traceparents=str(traceparents)),
        "run_as": None,
        "stop_grace": "2s",
    }
    agent = start_agent(tmp_path, server, "n1", engines=engines)
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
        assert server.ctl("tenant", "create", "acme").returncode == 0
        made = server.ctl("keys", "create", "--tenant", "acme", "--json")
        assert made.returncode == 0, made.stderr
        secret = json.loads(made.stdout)["secret"]
        wait_until(lambda: [r for r in replicas(server, "chat") if r["state"] == "Ready"], "the replica")
        host, _, port = server.endpoints["gateway"].rpartition(":")
        trace_ids = [os.urandom(16).hex() for _ in range(4)]

        def ask(trace_id: str, stream: bool) -> int:
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            try:
                body = {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "a prompt"}],
                    "stream": stream,
                }
                conn.request(
                    "POST",
                    "/v1/chat/completions",
                    body=json.dumps(body),
                    headers={
                        "Authorization": f"Bearer {secret}",
                        "traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01",
                    },
                )
                response = conn.getresponse()
                response.read()
                return response.status
            finally:
                conn.close()

        # The workers may not have the route yet when the replica just became Ready: requests
        # wait in their queue for it, so the first answer is a 200 too.
        assert [ask(t, stream=i % 2 == 1) for i, t in enumerate(trace_ids)] == [200] * 4

        def traced() -> dict[str, list]:
            with receiver.lock:
                found = {
                    t: [(svc, s) for svc, s in receiver.spans if s.trace_id.hex() == t] for t in trace_ids
                }
            return found if all(any(s.name == "gateway.relay" for _, s in v) for v in found.values()) else {}

        by_trace = wait_until(traced, "the workers' spans of every request")
        for in_trace in by_trace.values():
            assert {svc for svc, _ in in_trace} == {"llmgw-gateway-worker"}
            instances = {receiver.instances[s.span_id] for _, s in in_trace}
            assert len(instances) == 1 and instances <= {"w0", "w1"}  # one worker served it
            by_name = {s.name: s for _, s in in_trace}
            root = by_name["chat tiny"]
            attributes = attributes_of(root)
            assert attributes["gen_ai.request.model"] == "tiny" and attributes["llmgw.tenant"] == "acme"
            assert (
                attributes["gen_ai.usage.input_tokens"] == 5 and attributes["gen_ai.usage.output_tokens"] == 6
            )
            ids = {s.span_id: s for _, s in in_trace}
            for child in ("gateway.authenticate", "gateway.quota", "gateway.admission", "gateway.upstream"):
                assert ids[by_name[child].parent_span_id].name == "chat tiny", child
        # The engine was handed each request's trace, as a child of the worker's attempt.
        handed = {line.split("-")[1]: line.split("-")[2] for line in traceparents.read_text().split()}
        assert set(handed) == set(trace_ids)
        for trace_id, in_trace in by_trace.items():
            [attempt] = [s for _, s in in_trace if s.name == "gateway.upstream"]
            assert handed[trace_id] == attempt.span_id.hex()
        with receiver.lock:
            dumped = b"".join(span.SerializeToString() for _, span in receiver.spans)
        assert secret.encode() not in dumped and b"a prompt" not in dumped
    finally:
        agent.stop()
        server.proc.stop()
        kill_recorded_shards(tmp_path / "agent-n1")
        receiver.close()


def test_a_training_job_is_one_trace_with_a_span_per_step_on_the_server_and_the_node(tmp_path):
    from tests.e2e.test_train_processes import start_fleet, train
    from tests.real_parts import llama_cpp_converters, require_converters, require_training_stack
    from tests.tiny_llama import tiny_llama_dir

    require_training_stack()
    require_converters()
    base, converter = tiny_llama_dir(), llama_cpp_converters() / "convert_lora_to_gguf.py"
    receiver = Receiver()
    server, agent = start_fleet(tmp_path, converter, base, tracing={"endpoint": receiver.url})
    try:
        result = train(server, tmp_path, base, "traced-qa", "--steps", "3")
        assert result.returncode == 0, result.stdout + result.stderr
        [job] = server.admin("GET", "/admin/v1/jobs")["jobs"]
        assert job["state"] == "Succeeded"
        # The server's root ends with the job; the agent's run ends with its teardown.
        wait_until(lambda: receiver.named("train.job") and receiver.named("train.run"), "the job's spans")
        [(service, root)] = receiver.named("train.job")
        assert service == "llmgw-server"
        with receiver.lock:
            in_trace = [(svc, s) for svc, s in receiver.spans if s.trace_id == root.trace_id]
        names = {(svc, s.name) for svc, s in in_trace}
        server_steps = {"job.queue", "job.sent", "job.start", "job.train", "job.convert", "job.upload"}
        agent_steps = {
            "agent.start_job",
            "train.run",
            "train.prepare",
            "train.train",
            "train.convert",
            "train.upload",
        }
        assert {("llmgw-server", n) for n in server_steps} <= names
        assert {("llmgw-agent", n) for n in agent_steps} <= names
        ids = {s.span_id: s for _, s in in_trace}
        by_name = {s.name: s for _, s in in_trace}
        parent = {name: ids[s.parent_span_id].name for name, s in by_name.items() if s.parent_span_id in ids}
        assert parent["job.queue"] == parent["job.upload"] == "train.job"
        assert parent["job.start"] == "job.sent" and parent["agent.start_job"] == "job.start"
        assert parent["train.run"] == "agent.start_job"
        assert {parent[n] for n in ("train.prepare", "train.train", "train.convert", "train.upload")} == {
            "train.run"
        }
        attributes = attributes_of(root)
        assert (attributes["llmgw.job"], attributes["llmgw.adapter"]) == (job["id"], "traced-qa")
        assert attributes["llmgw.state"] == "Succeeded"
        assert attributes_of(by_name["train.train"])["llmgw.train.steps"] == 3
        # The steps follow one another on the server, inside the job's span.
        order = [by_name[n] for n in ("job.queue", "job.sent", "job.train", "job.convert", "job.upload")]
        assert all(
            a.end_time_unix_nano <= b.start_time_unix_nano for a, b in zip(order, order[1:], strict=False)
        )
        assert root.start_time_unix_nano <= order[0].start_time_unix_nano
        assert order[-1].end_time_unix_nano <= root.end_time_unix_nano
    finally:
        agent.stop()
        server.proc.stop()
        receiver.close()
