"""``llmgw ctl bench``: load against the gateway, or straight at one replica's engine.

Each worker owns one keep-alive HTTP/1.1 connection (trio + h11, as the gateway's own relay) and
sends chat completions one after another. A streamed answer is timed as its SSE events arrive: the
first content delta gives the time to first token, each later one an inter-token gap. The run ends
at --requests or --duration, whichever comes first, and never later than MAX_DURATION_S.
The figures are computed by :mod:`llmgw.core.bench_stats`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Callable
from urllib.parse import quote, urlsplit

import attrs
import h11
import trio
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from llmgw.core.bench_stats import rate, summarize
from llmgw.ctl import render
from llmgw.ctl.client import AdminClient, CtlError
from llmgw.gateway.h11_stream import H11Stream

# However --requests is set, a forgotten bench must not load a deployment for days.
MAX_DURATION_S = 3600.0
DEFAULT_TIMEOUT_S = 120.0
EXIT_USAGE = 2
API_KEY_ENV = "LLMGW_API_KEY"
PROGRESS_INTERVAL_S = 0.25

NO_BOUND_MESSAGE = (
    "error: bench needs a bound: give --requests N and/or --duration SECONDS "
    f"(a run never lasts more than {MAX_DURATION_S:g} s either way)"
)

EPILOG = f"""\
The API key for --url comes from --api-key or ${API_KEY_ENV}; prefer the variable,
since other users can read a command line. --replica needs no API key: the engine
key is fetched from the admin API (--server/--token, as every ctl command).

Percentiles are nearest-rank: each figure is a latency some request really had.
A run stops at --requests or --duration, whichever comes first, and never lasts
more than {MAX_DURATION_S:g} s; requests still in flight then are cancelled and
reported as such. Errors are counted by kind: http_<status>, connect, timeout,
protocol.

examples:
  LLMGW_API_KEY=sk-... llmgw ctl bench --url http://127.0.0.1:8080/v1 --model smollm2 --requests 200
  llmgw ctl bench --replica smollm2-cpu-1 --concurrency 8 --duration 30 --json

exit status: 0 when at least one request succeeded, 1 when none did, 2 on bad options.
"""


@attrs.frozen(kw_only=True)
class Target:
    """Where the requests go: `base_path` is the URL's path, e.g. /v1, without a trailing slash."""

    scheme: str
    host: str
    port: int
    base_path: str
    key: str | None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.authority}{self.base_path}"

    @property
    def authority(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return self.host if self.port == default else f"{self.host}:{self.port}"


@attrs.frozen(kw_only=True)
class Plan:
    target: Target
    model: str
    concurrency: int = 4
    requests: int | None = None
    duration: float = MAX_DURATION_S
    stream: bool = True
    prompt: str = "Write a short poem about the sea."
    max_tokens: int = 128
    timeout: float = DEFAULT_TIMEOUT_S


@attrs.define
class Outcome:
    """One request: `error` is its kind when it failed, and the timings are then unset."""

    error: str | None = None
    e2e: float = 0.0
    ttft: float | None = None
    itl: list[float] = attrs.Factory(list)
    tokens: int = 0


@attrs.define
class Tally:
    """What the workers share: tickets handed out, and what came back."""

    requests: int | None
    issued: int = 0
    e2e: list[float] = attrs.Factory(list)
    ttft: list[float] = attrs.Factory(list)
    itl: list[float] = attrs.Factory(list)
    tokens: int = 0
    errors: Counter = attrs.Factory(Counter)

    def take(self) -> bool:
        # No await between the check and the increment: trio cannot switch tasks in between.
        if self.requests is not None and self.issued >= self.requests:
            return False
        self.issued += 1
        return True

    def record(self, outcome: Outcome) -> None:
        if outcome.error is not None:
            self.errors[outcome.error] += 1
            return
        self.e2e.append(outcome.e2e)
        if outcome.ttft is not None:
            self.ttft.append(outcome.ttft)
        self.itl.extend(outcome.itl)
        self.tokens += outcome.tokens

    @property
    def done(self) -> int:
        return len(self.e2e) + self.errors.total()


class ProtocolFault(Exception):
    """The answer broke HTTP or the OpenAI shape: bad JSON, a stream without [DONE]."""


class NoResponse(Exception):
    """The connection failed before any response head: on a reused connection, the peer may have
    closed it while idle, so the request is worth one retry on a fresh connection."""


# --- the parser and the command --------------------------------------------------------------


def add_parser(commands, add, client: Callable[[argparse.Namespace], AdminClient]) -> None:
    """Adds ``bench``; `add` is :func:`llmgw.ctl.subcommand.add`, `client` the admin-client factory."""
    parser = add(
        commands, "bench", "send chat completions and measure throughput and latency", _command(client)
    )
    parser.epilog = EPILOG
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", metavar="URL", help="the gateway's base URL, e.g. http://127.0.0.1:8080/v1")
    target.add_argument(
        "--replica", metavar="ID", help="straight at this replica's engine, with its engine key"
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"API key for --url (default: ${API_KEY_ENV}; prefer it, since other users can read argv)",
    )
    parser.add_argument("--model", help="model to ask for (default with --replica: the replica's model)")
    parser.add_argument("--concurrency", type=_positive_int, default=4, metavar="N", help="default: 4")
    parser.add_argument("--requests", type=_positive_int, metavar="N", help="stop after N requests")
    parser.add_argument("--duration", type=_positive_float, metavar="SECONDS", help="stop after this long")
    parser.add_argument(
        "--stream", action=argparse.BooleanOptionalAction, default=True, help="stream the answers (default)"
    )
    parser.add_argument("--prompt", default=Plan.__attrs_attrs__.prompt.default, metavar="TEXT")
    parser.add_argument("--max-tokens", type=_positive_int, default=128, metavar="N", help="default: 128")
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"per request (default: {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print the summary as JSON"
    )


def _command(client: Callable[[argparse.Namespace], AdminClient]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        if args.requests is None and args.duration is None:
            print(NO_BOUND_MESSAGE, file=sys.stderr)
            return EXIT_USAGE
        if args.duration is not None and args.duration > MAX_DURATION_S:
            print(f"error: --duration is at most {MAX_DURATION_S:g} s", file=sys.stderr)
            return EXIT_USAGE
        if args.url is not None and args.model is None:
            print("error: --url needs --model", file=sys.stderr)
            return EXIT_USAGE
        target, model = _resolve(args, client)
        plan = Plan(
            target=target,
            model=model,
            concurrency=args.concurrency,
            requests=args.requests,
            duration=args.duration or MAX_DURATION_S,
            stream=args.stream,
            prompt=args.prompt,
            max_tokens=args.max_tokens,
            timeout=args.timeout,
        )
        with LiveProgress(plan) as progress:
            report = trio.run(run_bench, plan, progress.tick)
        if getattr(args, "json", False):
            render.print_json(report)
        else:
            print_report(report, render.make_console())
        return 0 if report["succeeded"] else 1

    return run


def _resolve(
    args: argparse.Namespace, client: Callable[[argparse.Namespace], AdminClient]
) -> tuple[Target, str]:
    if args.url is not None:
        key = args.api_key or os.environ.get(API_KEY_ENV)
        return parse_url(args.url, key), args.model
    admin = client(args)
    path = f"/admin/v1/replicas/{quote(args.replica, safe='')}"
    replica = admin.get(path)
    if not replica.get("endpoint"):
        raise CtlError(
            f'replica "{args.replica}" has no endpoint yet (state {replica.get("state")}): '
            "wait until `llmgw ctl replicas` shows it Ready"
        )
    key = admin.get(path + "/engine-key")["key"]
    return parse_url(f"http://{replica['endpoint']}/v1", key), args.model or replica["model"]


def parse_url(url: str, key: str | None) -> Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CtlError(f"{url}: give an http:// or https:// URL, e.g. http://127.0.0.1:8080/v1")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise CtlError(f"{url}: the port is not a number") from None
    return Target(
        scheme=parts.scheme, host=parts.hostname, port=port, base_path=parts.path.rstrip("/"), key=key
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


# --- the load ----------------------------------------------------------------------------------


async def run_bench(plan: Plan, on_tick: Callable[[Tally, float], None] | None = None) -> dict:
    """Run `plan` and return the report (the shape `--json` prints)."""
    tally = Tally(requests=plan.requests)
    request, body = _request(plan)
    started = trio.current_time()
    with trio.move_on_after(min(plan.duration, MAX_DURATION_S)):
        async with trio.open_nursery() as nursery:
            if on_tick is not None:
                nursery.start_soon(_ticker, tally, started, on_tick)
            async with trio.open_nursery() as workers:
                for _ in range(plan.concurrency):
                    workers.start_soon(_worker, plan, request, body, tally)
            nursery.cancel_scope.cancel()  # the workers are done: stop the ticker
    elapsed = trio.current_time() - started
    if on_tick is not None:
        on_tick(tally, elapsed)
    return report(plan, tally, elapsed)


async def _ticker(tally: Tally, started: float, on_tick: Callable[[Tally, float], None]) -> None:
    while True:
        on_tick(tally, trio.current_time() - started)
        await trio.sleep(PROGRESS_INTERVAL_S)


def _request(plan: Plan) -> tuple[h11.Request, bytes]:
    payload: dict = {
        "model": plan.model,
        "messages": [{"role": "user", "content": plan.prompt}],
        "max_tokens": plan.max_tokens,
        "stream": plan.stream,
    }
    if plan.stream:
        # Without it an engine's stream carries no usage, and tokens could only be counted as deltas.
        payload["stream_options"] = {"include_usage": True}
    body = json.dumps(payload).encode()
    headers = [
        (b"host", plan.target.authority.encode()),
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
    ]
    if plan.target.key:
        headers.append((b"authorization", b"Bearer " + plan.target.key.encode()))
    target = f"{plan.target.base_path}/chat/completions"
    return h11.Request(method="POST", target=target, headers=headers), body


async def _worker(plan: Plan, request: h11.Request, body: bytes, tally: Tally) -> None:
    conn: H11Stream | None = None
    try:
        while tally.take():
            outcome, conn = await _one(plan, request, body, conn)
            tally.record(outcome)
    finally:
        if conn is not None:
            await conn.aclose()


async def _one(
    plan: Plan, request: h11.Request, body: bytes, conn: H11Stream | None
) -> tuple[Outcome, H11Stream | None]:
    """One request on `conn` (or a fresh connection); returns its outcome and the connection to
    reuse, None when it cannot carry another request."""
    sent = trio.current_time()
    reused = conn is not None
    try:
        with trio.fail_after(plan.timeout):
            if conn is None:
                try:
                    conn = await _connect(plan.target)
                except OSError:
                    return Outcome(error="connect"), None
            outcome = await _exchange(conn, plan, request, body, sent)
    except trio.TooSlowError:
        outcome = Outcome(error="connect" if conn is None else "timeout")
    except trio.Cancelled:
        # The run's deadline: this request is reported as cancelled, and its socket closed here,
        # since a connection opened by this call is not yet the worker's to close.
        if conn is not None:
            await conn.aclose()
        raise
    except NoResponse:
        await conn.aclose()
        if reused:
            # The connection's age, not the server, failed this request: one more try, fresh.
            return await _one(plan, request, body, None)
        return Outcome(error="protocol"), None
    except (ProtocolFault, h11.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
        outcome = Outcome(error="protocol")
    if outcome.error is not None or not conn.reusable():
        await conn.aclose()
        return outcome, None
    conn.conn.start_next_cycle()
    return outcome, conn


async def _connect(target: Target) -> H11Stream:
    if target.scheme == "https":
        stream = await trio.open_ssl_over_tcp_stream(target.host, target.port, https_compatible=True)
    else:
        stream = await trio.open_tcp_stream(target.host, target.port)
    return H11Stream(stream, h11.CLIENT)


async def _exchange(conn: H11Stream, plan: Plan, request: h11.Request, body: bytes, sent: float) -> Outcome:
    try:
        await conn.send(request, h11.Data(data=body), h11.EndOfMessage())
        head = await conn.next_event()
    except (h11.ProtocolError, trio.BrokenResourceError) as e:
        raise NoResponse from e
    if type(head) is h11.ConnectionClosed:
        raise NoResponse
    if type(head) is not h11.Response:
        raise ProtocolFault(f"expected a response, got {head!r}")
    if head.status_code != 200:
        await _drain(conn)
        return Outcome(error=f"http_{head.status_code}")
    if plan.stream:
        return await _read_stream(conn, sent)
    data = await _drain(conn)
    ended = trio.current_time()
    try:
        answer = json.loads(data)
    except ValueError as e:
        raise ProtocolFault("the answer is not JSON") from e
    return Outcome(e2e=ended - sent, tokens=_completion_tokens(answer) or 0)


async def _drain(conn: H11Stream) -> bytes:
    data = b""
    while type(event := await conn.next_event()) is h11.Data:
        data += event.data
    if type(event) is not h11.EndOfMessage:
        raise ProtocolFault(f"the answer ended with {event!r}")
    return data


async def _read_stream(conn: H11Stream, sent: float) -> Outcome:
    reader = SseReader()
    token_times: list[float] = []
    usage_tokens: int | None = None
    ended: float | None = None
    while type(event := await conn.next_event()) is h11.Data:
        now = trio.current_time()
        for payload in reader.feed(event.data):
            if payload == b"[DONE]":
                ended = now
                continue
            try:
                chunk = json.loads(payload)
            except ValueError as e:
                raise ProtocolFault("an SSE event is not JSON") from e
            usage_tokens = _completion_tokens(chunk) if chunk.get("usage") else usage_tokens
            # One time per content delta: several deltas in one read share it (a 0 s gap), as
            # a client reading this socket would see them.
            token_times.extend(now for choice in chunk.get("choices") or [] if _has_content(choice))
    if type(event) is not h11.EndOfMessage:
        raise ProtocolFault(f"the stream ended with {event!r}")
    if ended is None:
        raise ProtocolFault("the stream ended without data: [DONE]")
    return Outcome(
        e2e=ended - sent,
        ttft=token_times[0] - sent if token_times else None,
        itl=[later - earlier for earlier, later in zip(token_times, token_times[1:], strict=False)],
        tokens=usage_tokens if usage_tokens is not None else len(token_times),
    )


def _has_content(choice: object) -> bool:
    return isinstance(choice, dict) and bool((choice.get("delta") or {}).get("content"))


def _completion_tokens(answer: object) -> int | None:
    usage = answer.get("usage") if isinstance(answer, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) else None


class SseReader:
    """Splits a byte stream into server-sent events and returns each event's data: payload."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        # Normalised after joining, so a \r\n cut between two reads is still one line end.
        self._buffer = (self._buffer + data).replace(b"\r\n", b"\n")
        payloads = []
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                payloads.append(b"\n".join(lines))
        return payloads


# --- the report --------------------------------------------------------------------------------


def report(plan: Plan, tally: Tally, elapsed: float) -> dict:
    return {
        "target": plan.target.url,
        "model": plan.model,
        "stream": plan.stream,
        "concurrency": plan.concurrency,
        "requests": tally.done,
        "succeeded": len(tally.e2e),
        "failed": tally.errors.total(),
        "cancelled": tally.issued - tally.done,
        "duration_s": round(elapsed, 3),
        "requests_per_s": round(rate(tally.done, elapsed), 3),
        "output_tokens": tally.tokens,
        "output_tokens_per_s": round(rate(tally.tokens, elapsed), 3),
        "ttft_ms": _ms(tally.ttft),
        "itl_ms": _ms(tally.itl),
        "e2e_ms": _ms(tally.e2e),
        "errors": dict(sorted(tally.errors.items())),
    }


def _ms(seconds: list[float]) -> dict[str, float] | None:
    summary = summarize(seconds)
    return None if summary is None else {name: round(value * 1000, 3) for name, value in summary.items()}


def print_report(data: dict, console: Console) -> None:
    console.print(f"target      {data['target']}  model {data['model']}  stream {data['stream']}")
    console.print(
        f"requests    {data['requests']} in {data['duration_s']:.2f} s = {data['requests_per_s']:.2f} req/s"
        f"  ({data['succeeded']} ok, {data['failed']} failed, {data['cancelled']} cancelled at the end)"
    )
    console.print(f"tokens      {data['output_tokens']} out = {data['output_tokens_per_s']:.1f} tokens/s")
    for label, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("end-to-end", "e2e_ms")):
        figures = data[key]
        text = (
            "-"
            if figures is None
            else "  ".join(f"{name} {value:.1f}" for name, value in figures.items()) + " ms"
        )
        console.print(f"{label:<11} {text}", highlight=False)
    errors = ", ".join(f"{kind} {count}" for kind, count in data["errors"].items()) or "none"
    console.print(f"errors      {errors}", highlight=False)


class LiveProgress:
    """A rich progress bar on stderr while the load runs; nothing when stderr is not a terminal."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        console = Console(stderr=True)
        self._progress = (
            Progress(
                TextColumn("bench"),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                console=console,
            )
            if console.is_terminal
            else None
        )
        self._task = None

    def __enter__(self) -> LiveProgress:
        if self._progress is not None:
            self._progress.start()
            self._task = self._progress.add_task("bench", total=self._total(), status="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def _total(self) -> float:
        # The bar follows whichever bound is set; with both, the count (time still caps it).
        return float(self._plan.requests) if self._plan.requests is not None else self._plan.duration

    def tick(self, tally: Tally, elapsed: float) -> None:
        if self._progress is None:
            return
        total = f"/{self._plan.requests}" if self._plan.requests is not None else ""
        status = (
            f"{tally.done}{total} done  {rate(tally.done, elapsed):.1f} req/s  {tally.errors.total()} errors"
        )
        completed = tally.done if self._plan.requests is not None else elapsed
        self._progress.update(self._task, completed=completed, status=status)
