"""A fast fake engine for scripts/bench_gateway.py: llama-server's HTTP surface at little CPU cost.

Standard library only (asyncio, no http.server), so the agent can run it as its unprivileged engine
user with the system Python. It takes llama-server's flags (--port, --alias, and the key from
--api-key or LLAMA_API_KEY; others are ignored) and always listens on 127.0.0.1, whatever --host
says: a benchmark's traffic stays on loopback. It answers

  GET  /health, /v1/models, /metrics (llama.cpp's load gauges)
  POST /v1/chat/completions, /v1/completions: a fixed answer with usage, or with "stream": true
       BENCH_ENGINE_CHUNKS (64) SSE events, each in a write (and an HTTP chunk) of its own, then
       the usage event when stream_options.include_usage asks, then [DONE].

Answers are built once; a request costs a header scan, a small json.loads and a write. The
benchmark's gateway, not this, should be what the load generator saturates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

CHUNKS = int(os.environ.get("BENCH_ENGINE_CHUNKS", "64"))
# A head is a few hundred bytes; past this the peer is not speaking HTTP to us.
MAX_HEAD_BYTES = 64 * 1024

USAGE = {"prompt_tokens": 5, "completion_tokens": CHUNKS, "total_tokens": 5 + CHUNKS}


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status.encode(),
        content_type,
        len(body),
        body,
    )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Answers:
    def __init__(self, model: str) -> None:
        self.model = model
        message = {"role": "assistant", "content": "ok"}
        chat = {
            "id": "bench-1",
            "object": "chat.completion",
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": USAGE,
        }
        text = {**chat, "object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}
        self.chat = _response("200 OK", json.dumps(chat).encode())
        self.text = _response("200 OK", json.dumps(text).encode())
        models = {"object": "list", "data": [{"id": model, "object": "model"}]}
        self.models = _response("200 OK", json.dumps(models).encode())
        self.health = _response("200 OK", b'{"status":"ok"}')
        # llama.cpp's load gauges: answers leave at once, so nothing is ever in flight here.
        metrics = (
            b"# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 0\n"
            b"# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 0\n"
        )
        self.metrics = _response("200 OK", metrics, b"text/plain; version=0.0.4")
        self.unauthorized = _response(
            "401 Unauthorized", b'{"error":{"message":"Invalid API Key","code":401}}'
        )
        self.not_found = _response("404 Not Found", b'{"error":{"message":"no such path"}}')
        self.bad = _response("400 Bad Request", b'{"error":{"message":"bad request"}}')
        self.stream_head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        event = {"id": "bench-1", "object": "chat.completion.chunk", "model": model}
        self.events = [
            _chunk(
                b"data: "
                + json.dumps({**event, "choices": [{"index": 0, "delta": {"content": "tok"}}]}).encode()
                + b"\n\n"
            )
            for _ in range(CHUNKS)
        ]
        self.usage_event = _chunk(
            b"data: " + json.dumps({**event, "choices": [], "usage": USAGE}).encode() + b"\n\n"
        )
        self.done = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class Engine(asyncio.Protocol):
    def __init__(self, answers: Answers, key: str) -> None:
        self.answers = answers
        # Heads are compared lowercased; the key is hex, as llmgw makes them.
        self.auth = f"authorization: bearer {key}".lower().encode() if key else None
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None and not self.transport.is_closing():
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    self.transport.close()
                return
            head = self.buffer[:end].lower()
            length = 0
            position = head.find(b"\r\ncontent-length:")
            if position >= 0:
                line_end = head.find(b"\r\n", position + 2)
                length = int(head[position + 17 : line_end if line_end >= 0 else len(head)])
            elif b"\r\ntransfer-encoding: chunked" in head:
                self.transport.write(self.answers.bad)  # the gateways under test send lengths
                self.transport.close()
                return
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            self.answer(head, body)

    def answer(self, head: bytes, body: bytes) -> None:
        write = self.transport.write
        method, _, rest = head.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        if path == b"/health":
            write(self.answers.health)
            return
        if self.auth is not None and self.auth not in head:
            write(self.answers.unauthorized)
            return
        if method == b"get" and path == b"/v1/models":
            write(self.answers.models)
        elif method == b"get" and path == b"/metrics":
            write(self.answers.metrics)
        elif method == b"post" and path in (b"/v1/chat/completions", b"/v1/completions"):
            try:
                request = json.loads(body)
            except ValueError:
                write(self.answers.bad)
                return
            if request.get("stream") is True:
                write(self.answers.stream_head)
                for event in self.answers.events:
                    write(event)  # each its own write: the gateway reads events as they come
                if (request.get("stream_options") or {}).get("include_usage"):
                    write(self.answers.usage_event)
                write(self.answers.done)
            else:
                write(self.answers.chat if path == b"/v1/chat/completions" else self.answers.text)
        else:
            write(self.answers.not_found)


async def serve(port: int, model: str, key: str) -> None:
    loop = asyncio.get_running_loop()
    answers = Answers(model)
    server = await loop.create_server(lambda: Engine(answers, key), "127.0.0.1", port, backlog=1024)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    print(
        f"bench engine pid {os.getpid()} on 127.0.0.1:{port}, model {model}, key {'set' if key else 'none'}",
        flush=True,
    )
    async with server:
        await stop.wait()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(add_help=True, allow_abbrev=False, description=__doc__)
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--alias", default="bench-model")
    parser.add_argument("--api-key")
    args, _ignored = parser.parse_known_args(argv)
    key = args.api_key or os.environ.get("LLAMA_API_KEY") or ""
    asyncio.run(serve(args.port, args.alias, key))


if __name__ == "__main__":
    main(sys.argv[1:])
