"""A stand-in for llama-server, `vllm serve`, SGLang's launch_server and `ray start`.

Standard library only, so that any Python can run it, as any user. It takes the flags those
engines get from llmgw's command builders (anything it does not know is ignored) and speaks the
HTTP surface llmgw uses: /health (no key), /v1/models, /v1/chat/completions, /v1/completions
(streamed as SSE on request), /metrics (Prometheus text, vLLM's and llama.cpp's names) and
/v1/load_lora_adapter. Its key comes from --api-key (for SGLang, as llmgw's launch program gives
it), LLAMA_API_KEY or VLLM_API_KEY.

Run as `fake_engine.py start ...` it is a Ray node instead: `--head --port P` listens on P (the
rendezvous point workers and vLLM wait for); without --head it just stays up.

Behaviour knobs (environment):
  FAKE_ENGINE_LOAD_DELAY       seconds /health answers 503 (a Ray head: seconds before listening)
  FAKE_ENGINE_EXIT_AFTER       seconds after which it exits with code 3
  FAKE_ENGINE_FORK_WORKER=1    fork a worker process (same process group) that only sleeps
  FAKE_ENGINE_IGNORE_SIGTERM=1 ignore SIGTERM (it and its worker), so only SIGKILL stops it
  FAKE_ENGINE_RESPONSE_DELAY   seconds each completion takes (to have requests in flight)
  FAKE_ENGINE_TRACEPARENTS     a file each request's traceparent header is appended to
  FAKE_ENGINE_LORA_LOAD_DELAY  seconds each run-time adapter load takes
  FAKE_ENGINE_LORA_FAIL        adapter names (comma-separated) whose loads fail, as vLLM's do for
                               files that are not an adapter
Otherwise SIGTERM makes it exit 0.

Run-time adapters, as vLLM's (/v1/load_lora_adapter, /v1/unload_lora_adapter) and SGLang's
(/load_lora_adapter, /unload_lora_adapter): at most --max-loras (or --max-loaded-loras) held, a
load past that refused; /v1/models lists each held with `parent`; a completion naming one it does
not hold is a 404. GET /fake/adapters (no key: the tests' window) says what happened: loads and
unloads in order, and any unload of an adapter with a request in flight.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

EXIT_CODE = 3
ANSWER = "Hello from the fake engine."


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--alias")
    parser.add_argument("--served-model-name")
    parser.add_argument("--api-key")
    parser.add_argument("--head", action="store_true")
    parser.add_argument("--max-loras", "--max-loaded-loras", dest="max_loras", type=int, default=0)
    args, rest = parser.parse_known_args(argv)
    if argv[:1] == ["-c"] and "sglang.launch_server" in argv[1]:
        # llmgw's SGLang launch program (tests/core/test_engines.py runs the real one): it puts the
        # key from its environment last on the server's argv.
        key = os.environ.pop("LLMGW_ENGINE_KEY", "")
        args.api_key = key or args.api_key
    key = args.api_key or os.environ.get("LLAMA_API_KEY") or os.environ.get("VLLM_API_KEY") or ""

    if os.environ.get("FAKE_ENGINE_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # before the fork: the worker ignores it too
    if os.environ.get("FAKE_ENGINE_FORK_WORKER") == "1":
        worker = os.fork()
        if worker == 0:
            say(f"fake worker pid {os.getpid()}")
            while True:
                time.sleep(3600)
        say(f"forked worker pid {worker}")
    if os.environ.get("FAKE_ENGINE_IGNORE_SIGTERM") != "1":
        signal.signal(signal.SIGTERM, on_sigterm)
    if exit_after := os.environ.get("FAKE_ENGINE_EXIT_AFTER"):
        threading.Timer(float(exit_after), exit_now).start()
    load_delay = float(os.environ.get("FAKE_ENGINE_LOAD_DELAY", "0"))

    say(f"fake engine pid {os.getpid()} uid {os.getuid()} cwd {os.getcwd()} args {' '.join(argv)}")
    if rest[:1] == ["start"]:
        ray_node(args.head, args.port, load_delay)
        return
    model = args.alias or args.served_model_name or "fake-model"
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.engine = Engine(
        model=model, key=key, ready_at=time.monotonic() + load_delay, max_loras=args.max_loras
    )
    say(f"listening on {args.host}:{args.port}, model {model}, key {'set' if key else 'none'}")
    server.serve_forever()


def say(line: str) -> None:
    print(line, flush=True)


def on_sigterm(signum: int, frame: object) -> None:
    say("SIGTERM: exiting")
    os._exit(0)


def exit_now() -> None:
    say(f"exiting with code {EXIT_CODE} as told (FAKE_ENGINE_EXIT_AFTER)")
    os._exit(EXIT_CODE)


def ray_node(head: bool, port: int, delay: float) -> None:
    if not head:
        say("ray worker joined")
        while True:
            time.sleep(3600)
    time.sleep(delay)
    listener = socket.create_server(("0.0.0.0", port))
    say(f"ray head listening on {port}")
    while True:
        connection, _ = listener.accept()
        connection.close()


class Engine:
    def __init__(self, *, model: str, key: str, ready_at: float, max_loras: int = 0) -> None:
        self.model = model
        self.key = key
        self.ready_at = ready_at
        self.adapters: dict[str, str] = {}
        self.max_loras = max_loras  # 0: no run-time adapters limit (none given)
        self.running = 0
        self.lock = threading.Lock()
        self.adapter_running: dict[str, int] = {}
        self.events: list[list[str]] = []  # ["load"|"unload"|"load-failed", name]
        self.violations: list[str] = []  # adapters unloaded with a request in flight

    def load_adapter(self, name: str, path: str) -> tuple[int, str]:
        time.sleep(float(os.environ.get("FAKE_ENGINE_LORA_LOAD_DELAY", "0")))
        failing = {n for n in os.environ.get("FAKE_ENGINE_LORA_FAIL", "").split(",") if n}
        with self.lock:
            if name in failing:
                self.events.append(["load-failed", name])
                return 400, f"Loading lora {name} failed: No adapter found for {path}"
            if name in self.adapters:
                return 400, f"The lora adapter '{name}' has already been loaded."
            if self.max_loras and len(self.adapters) >= self.max_loras:
                self.events.append(["load-failed", name])
                return 400, f"cannot load lora {name}: {self.max_loras} already loaded (max_loras)"
            self.adapters[name] = path
            self.events.append(["load", name])
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def unload_adapter(self, name: str) -> tuple[int, str]:
        with self.lock:
            if name not in self.adapters:
                return 404, f"The lora adapter '{name}' cannot be found."
            if self.adapter_running.get(name):
                self.violations.append(name)
            del self.adapters[name]
            self.events.append(["unload", name])
        return 200, f"Success: LoRA adapter '{name}' removed successfully."

    @property
    def loading(self) -> bool:
        return time.monotonic() < self.ready_at


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    @property
    def engine(self) -> Engine:
        return self.server.engine  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: object) -> None:
        say(f"{self.command} {self.path} " + (format % args))

    def do_GET(self) -> None:
        if self.path == "/fake/adapters":
            with self.engine.lock:
                state = {
                    "held": sorted(self.engine.adapters),
                    "events": list(self.engine.events),
                    "violations": list(self.engine.violations),
                }
            self.reply(200, state)
            return
        if self.path == "/health":
            if self.engine.loading:
                self.reply(503, {"error": {"message": "Loading model", "code": 503}})
            else:
                self.reply(200, {"status": "ok"})
            return
        if not self.allowed():
            return
        if self.path == "/v1/models":
            base = {"id": self.engine.model, "object": "model", "parent": None}
            with self.engine.lock:
                held = [
                    {"id": n, "object": "model", "root": p, "parent": self.engine.model}
                    for n, p in self.engine.adapters.items()
                ]
            self.reply(200, {"object": "list", "data": [base, *held]})
        elif self.path == "/metrics":
            self.reply_text(200, self.metrics(), "text/plain; version=0.0.4")
        else:
            self.reply(404, {"error": {"message": f"no {self.path}"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            self.reply(400, {"error": {"message": "body is not JSON"}})
            return
        if not self.allowed():
            return
        # Where the test asks: the trace context each request came with, one line each.
        if (traceparents := os.environ.get("FAKE_ENGINE_TRACEPARENTS")) and self.headers.get("traceparent"):
            with open(traceparents, "a") as file:
                file.write(self.headers["traceparent"] + "\n")
        if self.path in ("/v1/chat/completions", "/v1/completions"):
            self.complete(body, chat=self.path == "/v1/chat/completions")
        elif self.path in ("/v1/load_lora_adapter", "/load_lora_adapter"):
            status, text = self.engine.load_adapter(body.get("lora_name", ""), body.get("lora_path", ""))
            self.reply_text(status, text)
        elif self.path in ("/v1/unload_lora_adapter", "/unload_lora_adapter"):
            status, text = self.engine.unload_adapter(body.get("lora_name", ""))
            self.reply_text(status, text)
        else:
            self.reply(404, {"error": {"message": f"no {self.path}"}})

    def allowed(self) -> bool:
        """Key check, then loading check: as llama.cpp, everything but /health waits for the model."""
        if self.engine.key and self.headers.get("Authorization") != f"Bearer {self.engine.key}":
            self.reply(401, {"error": {"message": "Invalid API Key", "code": 401}})
            return False
        if self.engine.loading:
            self.reply(503, {"error": {"message": "Loading model", "code": 503}})
            return False
        return True

    def complete(self, body: dict, *, chat: bool) -> None:
        name = body.get("model")
        engine = self.engine
        adapter = name if isinstance(name, str) and name != engine.model and engine.max_loras else None
        with engine.lock:
            if adapter is not None and adapter not in engine.adapters:
                self.reply(404, {"error": {"message": f"The model `{adapter}` does not exist.", "code": 404}})
                return
            engine.running += 1
            if adapter is not None:
                engine.adapter_running[adapter] = engine.adapter_running.get(adapter, 0) + 1
        ended = []

        def end_adapter() -> None:
            # Before the answer's last bytes: a client may unload the adapter once it has them.
            if adapter is not None and not ended:
                ended.append(True)
                with engine.lock:
                    engine.adapter_running[adapter] -= 1

        try:
            time.sleep(float(os.environ.get("FAKE_ENGINE_RESPONSE_DELAY", "0")))
            usage = {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
            model = body.get("model") or self.engine.model
            kind = "chat.completion" if chat else "text_completion"
            if not body.get("stream"):
                choice = {"index": 0, "finish_reason": "stop"}
                choice.update(
                    {"message": {"role": "assistant", "content": ANSWER}} if chat else {"text": ANSWER}
                )
                end_adapter()
                self.reply(
                    200, {"id": "fake-1", "object": kind, "model": model, "choices": [choice], "usage": usage}
                )
                return
            self.stream(
                body,
                model=model,
                kind=f"{kind}.chunk" if chat else kind,
                usage=usage,
                chat=chat,
                end=end_adapter,
            )
        finally:
            end_adapter()
            with engine.lock:
                engine.running -= 1

    def stream(self, body: dict, *, model: str, kind: str, usage: dict, chat: bool, end=None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for word in ANSWER.split(" "):
            piece = {"delta": {"content": word + " "}} if chat else {"text": word + " "}
            self.chunk({"id": "fake-1", "object": kind, "model": model, "choices": [{"index": 0, **piece}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            self.chunk({"id": "fake-1", "object": kind, "model": model, "choices": [], "usage": usage})
        if end is not None:
            end()
        self.write_chunk(b"data: [DONE]\n\n")
        self.write_chunk(b"")

    def chunk(self, event: dict) -> None:
        self.write_chunk(b"data: " + json.dumps(event).encode() + b"\n\n")

    def write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def metrics(self) -> str:
        running = self.engine.running
        model = self.engine.model
        return "".join(
            [
                "# TYPE vllm:num_requests_running gauge\n",
                f'vllm:num_requests_running{{model_name="{model}",engine="0"}} {running}.0\n',
                "# TYPE vllm:num_requests_waiting gauge\n",
                f'vllm:num_requests_waiting{{model_name="{model}",engine="0"}} 0.0\n',
                "# TYPE vllm:kv_cache_usage_perc gauge\n",
                f'vllm:kv_cache_usage_perc{{model_name="{model}",engine="0"}} {min(1.0, running / 10)}\n',
                "# TYPE llamacpp:requests_processing gauge\n",
                f"llamacpp:requests_processing {running}\n",
                "# TYPE llamacpp:requests_deferred gauge\n",
                "llamacpp:requests_deferred 0\n",
            ]
        )

    def reply(self, status: int, payload: dict) -> None:
        self.reply_text(status, json.dumps(payload), "application/json")

    def reply_text(self, status: int, text: str, content_type: str = "text/plain") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


if __name__ == "__main__":
    main(sys.argv[1:])
