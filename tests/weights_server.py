"""A file server on 127.0.0.1 for fetch tests: Range requests, a cut connection on demand, a log.

It serves the files of one directory by name. ``cut_after`` makes the next answer stop after that
many bytes of its body (the connection is closed with the rest unsent, as a dropped link would),
once. Every request is recorded with its Range header, so a test sees a resume asked for the
right bytes and a shared copy downloaded once.
"""

from __future__ import annotations

import http.server
import re
import threading
import time
from pathlib import Path

import attrs

_RANGE = re.compile(r"bytes=(\d+)-")


@attrs.define
class Seen:
    path: str
    range: str | None
    status: int = 0
    sent: int = 0


class FileServer:
    def __init__(self, root: Path, extra_headers: dict[str, str] | None = None) -> None:
        self.root = root
        self.extra_headers = extra_headers or {}
        self.seen: list[Seen] = []
        self.cut_after: int | None = None
        self.cut_only: str | None = None  # set: the cut waits for a request of this file
        # Seconds between chunks of 256 KiB: slows a download down enough to watch its progress.
        self.chunk_delay = 0.0
        self.lock = threading.Lock()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                owner._serve(self)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/files/{name}"

    def __enter__(self) -> FileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)

    def _serve(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        seen = Seen(path=handler.path, range=handler.headers.get("Range"))
        name = handler.path.removeprefix("/files/").split("?", 1)[0]
        with self.lock:
            self.seen.append(seen)
            cut = None
            if self.cut_only in (None, name):
                cut, self.cut_after = self.cut_after, None
        path = self.root / name
        if any(part in ("", ".", "..") for part in name.split("/")) or not path.is_file():
            seen.status = 404
            handler.send_error(404)
            return
        size = path.stat().st_size
        start = 0
        match = _RANGE.fullmatch(seen.range or "")
        if match:
            start = int(match[1])
            if start >= size:
                seen.status = 416
                handler.send_response(416)
                handler.send_header("Content-Range", f"bytes */{size}")
                handler.send_header("Content-Length", "0")
                handler.end_headers()
                return
        seen.status = 206 if match else 200
        handler.send_response(seen.status)
        if match:
            handler.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        handler.send_header("Content-Length", str(size - start))
        for key, value in self.extra_headers.items():
            handler.send_header(key, value)
        handler.end_headers()
        budget = size - start if cut is None else min(cut, size - start)
        with open(path, "rb") as file:
            file.seek(start)
            while budget > 0:
                chunk = file.read(min(256 * 1024, budget))
                if not chunk:
                    break
                try:
                    handler.wfile.write(chunk)
                except OSError:
                    return
                budget -= len(chunk)
                seen.sent += len(chunk)
                if self.chunk_delay:
                    time.sleep(self.chunk_delay)
        if cut is not None:
            handler.close_connection = True
            handler.wfile.flush()
            handler.connection.shutdown(2)
