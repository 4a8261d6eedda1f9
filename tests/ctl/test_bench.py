"""`llmgw ctl bench` and its statistics, against the relay tests' fake engine on 127.0.0.1."""

from __future__ import annotations

import argparse
import json
import queue
import socket
import threading
from collections.abc import Iterator

import h11
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.bench_stats import percentile, rate, summarize
from llmgw.ctl import bench, commands
from llmgw.ctl.commands import add_ctl_parser
from llmgw.gateway.h11_stream import H11Stream
from tests.gateway.test_gateway_relay import ENGINE_KEY, FakeEngine, json_reply, streaming_reply

# --- statistics ---------------------------------------------------------------------------------


def test_nearest_rank_percentiles_on_known_lists():
    values = list(range(1, 11))  # 1..10
    assert percentile(values, 50) == 5
    assert percentile(values, 90) == 9
    assert percentile(values, 99) == 10
    assert percentile([7.0], 50) == 7.0
    assert percentile([3, 1, 2], 1) == 1  # rank never below 1
    assert summarize([4, 1, 3, 2]) == {"p50": 2, "p90": 4, "p99": 4, "max": 4}
    assert summarize([]) is None
    assert rate(10, 2) == 5 and rate(3, 0) == 0.0


def test_percentile_rejects_no_values_and_bad_ranks():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 0)


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1))
def test_percentiles_are_ordered_and_taken_from_the_values(values):
    summary = summarize(values)
    assert summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"] == max(values)
    assert all(figure in values for figure in summary.values())


def test_sse_reader_splits_events_across_reads_and_line_ends():
    reader = bench.SseReader()
    assert reader.feed(b'data: {"a":1}\r') == []
    assert reader.feed(b"\n\r\n: comment\n\ndata: [DO") == [b'{"a":1}']
    assert reader.feed(b"NE]\n\n") == [b"[DONE]"]


# --- the load, in-process -----------------------------------------------------------------------


def plan_for(port: int, **changes) -> bench.Plan:
    target = bench.Target(scheme="http", host="127.0.0.1", port=port, base_path="/v1", key=ENGINE_KEY)
    return bench.Plan(target=target, model="m", **{"concurrency": 2, "requests": 6, **changes})


async def test_streaming_bench_times_tokens_and_reuses_connections(nursery):
    engine = FakeEngine(streaming_reply())
    upstream = await engine.start(nursery)
    report = await bench.run_bench(plan_for(upstream.port))
    assert (report["requests"], report["succeeded"], report["failed"], report["cancelled"]) == (6, 6, 0, 0)
    assert report["output_tokens"] == 6 * 5  # from the usage chunk, not the two deltas
    assert report["ttft_ms"]["p50"] <= report["e2e_ms"]["p50"]
    assert set(report["itl_ms"]) == {"p50", "p90", "p99", "max"}
    assert report["errors"] == {}
    assert engine.connections == 2  # one keep-alive connection per worker
    assert all(seen.body["stream_options"] == {"include_usage": True} for seen in engine.seen)
    assert engine.seen[0].path == "/v1/chat/completions"
    assert engine.seen[0].headers[b"authorization"] == b"Bearer " + ENGINE_KEY.encode()


async def test_stream_without_usage_counts_content_deltas(nursery):
    async def no_usage(engine: H11Stream, body: dict) -> None:
        await streaming_reply()(engine, {**body, "stream_options": None})

    upstream = await FakeEngine(no_usage).start(nursery)
    report = await bench.run_bench(plan_for(upstream.port, requests=3))
    assert report["output_tokens"] == 3 * 2


async def test_non_streaming_bench_counts_usage_tokens(nursery):
    engine = FakeEngine(json_reply)
    upstream = await engine.start(nursery)
    report = await bench.run_bench(plan_for(upstream.port, stream=False, requests=5))
    assert (report["requests"], report["succeeded"], report["output_tokens"]) == (5, 5, 25)
    assert report["ttft_ms"] is None and report["itl_ms"] is None and report["e2e_ms"] is not None
    assert "stream_options" not in engine.seen[0].body


async def test_http_errors_are_counted_by_status(nursery):
    calls = 0

    async def every_other_fails(engine: H11Stream, body: dict) -> None:
        nonlocal calls
        calls += 1
        if calls % 2:
            data = b'{"error": {"message": "boom"}}'
            head = h11.Response(status_code=500, headers=[(b"content-length", b"%d" % len(data))])
            await engine.send(head, h11.Data(data=data), h11.EndOfMessage())
        else:
            await json_reply(engine, body)

    upstream = await FakeEngine(every_other_fails).start(nursery)
    report = await bench.run_bench(plan_for(upstream.port, stream=False, concurrency=1))
    assert (report["succeeded"], report["failed"], report["errors"]) == (3, 3, {"http_500": 3})


async def test_a_stream_cut_short_is_a_protocol_error(nursery):
    async def no_done(engine: H11Stream, body: dict) -> None:
        await engine.send(h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")]))
        await engine.send(h11.Data(data=b'data: {"choices": []}\n\n'), h11.EndOfMessage())

    upstream = await FakeEngine(no_done).start(nursery)
    report = await bench.run_bench(plan_for(upstream.port, requests=2))
    assert report["errors"] == {"protocol": 2}


async def test_a_silent_engine_is_a_timeout(nursery, autojump_clock):
    async def silent(engine: H11Stream, body: dict) -> None:
        await trio.sleep_forever()

    upstream = await FakeEngine(silent).start(nursery)
    report = await bench.run_bench(plan_for(upstream.port, requests=2, timeout=5.0))
    assert report["errors"] == {"timeout": 2}


async def test_the_duration_bound_cancels_what_is_in_flight(nursery, autojump_clock):
    gate = trio.Event()  # never set: every answer stops after its first token
    upstream = await FakeEngine(streaming_reply(gate)).start(nursery)
    report = await bench.run_bench(plan_for(upstream.port, requests=None, duration=3.0))
    assert (report["requests"], report["cancelled"]) == (0, 2)
    assert report["duration_s"] == pytest.approx(3.0)


async def test_a_closed_port_gives_connect_errors():
    report = await bench.run_bench(plan_for(closed_port(), requests=4))
    assert (report["requests"], report["succeeded"], report["errors"]) == (4, 0, {"connect": 4})


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the command line ---------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmgw")
    add_ctl_parser(parser.add_subparsers(dest="role", required=True))
    return parser.parse_args(argv)


@pytest.fixture
def engine_thread() -> Iterator[tuple[int, FakeEngine]]:
    """A FakeEngine on its own trio loop in a thread, for the CLI, which runs trio itself."""
    engine = FakeEngine(streaming_reply())
    started: queue.Queue = queue.Queue()

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            upstream = await engine.start(nursery)
            started.put((upstream.port, trio.lowlevel.current_trio_token(), nursery.cancel_scope))

    thread = threading.Thread(target=trio.run, args=(serve,))
    thread.start()
    port, token, scope = started.get(timeout=10)
    try:
        yield port, engine
    finally:
        trio.from_thread.run_sync(scope.cancel, trio_token=token)
        thread.join()


def test_refuses_to_run_without_a_bound(capsys):
    args = parse(["ctl", "bench", "--url", "http://127.0.0.1:1/v1", "--model", "m"])
    assert args.func(args) == 2
    assert "--requests N and/or --duration SECONDS" in capsys.readouterr().err


def test_refuses_a_duration_beyond_the_hard_maximum(capsys):
    args = parse(["ctl", "bench", "--url", "http://h/v1", "--model", "m", "--duration", "99999"])
    assert args.func(args) == 2
    assert "at most" in capsys.readouterr().err


def test_json_output_shape_with_the_key_from_the_environment(engine_thread, monkeypatch, capsys):
    port, engine = engine_thread
    monkeypatch.setenv("LLMGW_API_KEY", "sk-env")
    argv = ["ctl", "bench", "--url", f"http://127.0.0.1:{port}/v1", "--model", "m", "--requests", "3"]
    args = parse([*argv, "--json"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {
        "target", "model", "stream", "concurrency", "requests", "succeeded", "failed", "cancelled",
        "duration_s", "requests_per_s", "output_tokens", "output_tokens_per_s",
        "ttft_ms", "itl_ms", "e2e_ms", "errors",
    }  # fmt: skip
    assert (report["requests"], report["succeeded"], report["stream"]) == (3, 3, True)
    assert report["target"] == f"http://127.0.0.1:{port}/v1"
    assert engine.seen[0].headers[b"authorization"] == b"Bearer sk-env"


def test_text_report_when_piped(engine_thread, capsys):
    port, _ = engine_thread
    url = f"http://127.0.0.1:{port}/v1"
    args = parse(["ctl", "bench", "--url", url, "--model", "m", "--requests", "2"])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert "requests    2 in" in captured.out and "errors      none" in captured.out
    assert captured.err == ""  # no progress bar when stderr is not a terminal


def test_all_failing_exits_1(capsys):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    args = parse(["ctl", "bench", "--url", url, "--model", "m", "--requests", "2"])
    assert args.func(args) == 1
    assert "connect 2" in capsys.readouterr().out


def test_replica_resolves_endpoint_and_engine_key_through_the_admin_api(
    engine_thread, monkeypatch, tmp_path, capsys
):
    port, engine = engine_thread
    asked: list[str] = []

    class FakeAdmin:
        def __init__(self, server: str, token: str | None) -> None:
            assert (server, token) == ("http://admin:7071", "t")

        def get(self, path: str):
            asked.append(path)
            return {
                "/admin/v1/replicas/r%2F1": {"id": "r/1", "model": "smollm2", "state": "Ready",
                                            "endpoint": f"127.0.0.1:{port}"},
                "/admin/v1/replicas/r%2F1/engine-key": {"replica_id": "r/1", "key": "engine-k"},
            }[path]  # fmt: skip

    monkeypatch.setenv("LLMGW_CONTEXT", str(tmp_path / "context.json"))
    monkeypatch.setattr(commands, "AdminClient", FakeAdmin)
    args = parse(["ctl", "--server", "http://admin:7071", "--token", "t", "bench", "--replica", "r/1",
                  "--requests", "2", "--json"])  # fmt: skip
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "smollm2" and report["succeeded"] == 2
    assert asked == ["/admin/v1/replicas/r%2F1", "/admin/v1/replicas/r%2F1/engine-key"]
    assert engine.seen[0].headers[b"authorization"] == b"Bearer engine-k"
    assert engine.seen[0].body["model"] == "smollm2"


def test_replica_without_an_endpoint_says_to_wait(monkeypatch, tmp_path, capsys):
    class PendingAdmin:
        def __init__(self, server: str, token: str | None) -> None:
            pass

        def get(self, path: str):
            return {"id": "r1", "model": "m", "state": "Pending", "endpoint": None}

    monkeypatch.setenv("LLMGW_CONTEXT", str(tmp_path / "context.json"))
    monkeypatch.setattr(commands, "AdminClient", PendingAdmin)
    args = parse(["ctl", "--token", "t", "bench", "--replica", "r1", "--requests", "1"])
    assert args.func(args) == 1
    assert "no endpoint yet (state Pending)" in capsys.readouterr().err
