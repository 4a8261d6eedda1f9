"""examples/grafana/llmgw.json queries only what exists: every metric name and label of its
queries is in the /metrics of a running gateway (a real server, two gateway workers, a replica
on a real agent, requests of two tenants, one of them waiting in the queue) or in the engines'
metric fixtures (tests/fixtures/engine-metrics)."""

from __future__ import annotations

import http.client
import json
import re
import threading
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_replicas_processes import fake_llama_server, profile, replicas
from tests.procs import Server, kill_recorded_shards, start_agent, wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana" / "llmgw.json"
ENGINE_FIXTURES = ROOT / "tests" / "fixtures" / "engine-metrics"
# Labels Prometheus adds to every series it scrapes.
TARGET_LABELS = frozenset({"instance", "job"})
WORDS = frozenset(
    {
        "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
        "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
        "topk", "bottomk", "clamp_min", "clamp_max", "abs",
    }
)  # fmt: skip
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[[^\]]*\]|\{[^}]*\}|[A-Za-z_:][A-Za-z0-9_:]*|\S')
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*"')


class Query:
    """One PromQL expression as far as the check needs it: its metrics, each with the labels
    its selector matches on, and the labels it groups by."""

    def __init__(self, expr: str, legend: str = "") -> None:
        self.expr = expr
        self.metrics: dict[str, set[str]] = {}
        self.grouped: set[str] = set()
        tokens = _TOKEN.findall(expr)
        i = 0
        while i < len(tokens):
            token = tokens[i]
            following = tokens[i + 1] if i + 1 < len(tokens) else ""
            if token in ("by", "without") and following == "(":
                close = tokens.index(")", i)
                self.grouped |= {t for t in tokens[i + 2 : close] if t != ","}
                i = close + 1
                continue
            if re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", token) and token not in WORDS:
                labels = self.metrics.setdefault(token, set())
                if following.startswith("{"):
                    labels |= set(_MATCHER.findall(following))
            i += 1
        self.legend_labels = set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend))


def dashboard_queries() -> list[Query]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queries.append(Query(target["expr"], target.get("legendFormat", "")))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", variable["definition"]).groups()
            query = Query(metric)
            query.grouped = {label}
            queries.append(query)
    return queries


def series_labels(text: str) -> dict[str, set[str]]:
    """Every sample name in a /metrics text, with the label names its samples carry."""
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return found


def problems(queries: list[Query], exposed: dict[str, set[str]], which: str) -> list[str]:
    """What the queries of metrics named ``which`` (a prefix) ask for that ``exposed`` lacks."""
    found = []
    for query in queries:
        for metric, matched in query.metrics.items():
            if not metric.startswith(which):
                continue
            if metric not in exposed:
                found.append(f"{metric}: not exposed ({query.expr})")
                continue
            have = exposed[metric] | TARGET_LABELS
            for label in (matched | query.grouped) - have:
                found.append(f"{metric} has no label {label!r} ({query.expr})")
        for label in query.legend_labels - query.grouped:
            found.append(f"the legend names {label!r}, which {query.expr} does not keep")
    return found


def test_the_dashboard_is_grafana_json_whose_engine_queries_exist_in_the_engines_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    titles = [p["title"] for p in dashboard["panels"] if p["type"] != "row"]
    assert len(titles) == len(set(titles))  # each panel says something of its own
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
    queries = dashboard_queries()
    assert all(q.metrics for q in queries)
    engines: dict[str, set[str]] = {}
    for fixture in sorted(ENGINE_FIXTURES.glob("*.txt")):
        for name, labels in series_labels(fixture.read_text()).items():
            engines.setdefault(name, set()).update(labels)
    engine_queries = [q for q in queries if not all(m.startswith("llmgw_") for m in q.metrics)]
    assert {m.split(":")[0] for q in engine_queries for m in q.metrics} == {"vllm", "sglang", "llamacpp"}
    assert problems(engine_queries, engines, "") == []


def test_the_checks_catch_a_missing_metric_a_missing_label_and_a_legend_not_kept():
    exposed = {"llmgw_requests_total": {"model", "status"}}
    queries = [
        Query('sum by (model) (rate(llmgw_requests_total{status="200"}[5m]))', "{{model}}"),
        Query("sum by (tenant) (rate(llmgw_requests_total[5m]))", "{{tenant}}"),
        Query("sum(rate(llmgw_nope_total[5m]))", "{{model}}"),
    ]
    assert problems(queries, exposed, "llmgw_") == [
        "llmgw_requests_total has no label 'tenant' (sum by (tenant) (rate(llmgw_requests_total[5m])))",
        "llmgw_nope_total: not exposed (sum(rate(llmgw_nope_total[5m])))",
        "the legend names 'model', which sum(rate(llmgw_nope_total[5m])) does not keep",
    ]


@pytest.mark.slow
def test_every_gateway_metric_and_label_the_dashboard_queries_is_on_a_running_gateways_metrics(tmp_path):
    server = Server(tmp_path, gateway={"workers": 2, "tenant_metrics": True}).start()
    # Each answer takes 2 s and the replica has one slot: a second request waits in the queue.
    engines = {
        "llama_server": fake_llama_server(tmp_path, response_delay="2"),
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
                "profiles": [profile("chat", parallel=1)],
            },
        )
        secrets = {}
        for tenant in ("acme", "bravo"):
            assert server.ctl("tenant", "create", tenant).returncode == 0
            made = server.ctl("keys", "create", "--tenant", tenant, "--json")
            assert made.returncode == 0, made.stderr
            secrets[tenant] = json.loads(made.stdout)["secret"]
        wait_until(lambda: [r for r in replicas(server, "chat") if r["state"] == "Ready"], "the replica")
        host, _, port = server.endpoints["gateway"].rpartition(":")

        def get(path: str, body: dict | None = None, secret: str = "") -> tuple[int, str]:
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            try:
                if body is None:
                    conn.request("GET", path)
                else:
                    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
                    conn.request("POST", path, body=json.dumps(body), headers=headers)
                response = conn.getresponse()
                return response.status, response.read().decode()
            finally:
                conn.close()

        statuses: list[int] = []

        def ask(tenant: str, stream: bool) -> None:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
            statuses.append(get("/v1/chat/completions", body, secrets[tenant])[0])

        seen: dict[str, set[str]] = {}

        def scrape() -> dict[str, set[str]]:
            status, text = get("/metrics")
            assert status == 200
            for name, labels in series_labels(text).items():
                seen.setdefault(name, set()).update(labels)
            return seen

        # Until the engines' load has reached the workers, and a request has been seen waiting.
        for _round in range(10):
            threads = [
                threading.Thread(target=ask, args=(tenant, stream))
                for tenant, stream in (("acme", True), ("bravo", False), ("acme", False))
            ]
            for thread in threads:
                thread.start()
            try:
                wait_until(
                    lambda threads=threads: (
                        "llmgw_queue_depth" in scrape() or not any(t.is_alive() for t in threads)
                    ),
                    "a request waiting, or every request answered",
                )
            finally:
                for thread in threads:
                    thread.join(timeout=120)
            scrape()
            if {"llmgw_queue_depth", "llmgw_engine_saturation"} <= set(seen):
                break
        assert set(statuses) == {200}
        assert problems(dashboard_queries(), seen, "llmgw_") == []
        assert seen["llmgw_tenant_tokens_total"] >= {"tenant", "direction", "worker"}
    finally:
        agent.stop()
        server.proc.stop()
        kill_recorded_shards(tmp_path / "agent-n1")
