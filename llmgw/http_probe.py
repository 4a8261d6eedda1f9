"""One GET to an engine: the agent's readiness checks and drains, the server's metrics scrapes
(and one POST: the server's run-time adapter loads).

A bare trio + h11 client: one connection per request (``Connection: close``), which suits a
health check every second or so, or a scrape every few, and needs no pool. Neither the agent nor
the server owns it, so that neither imports the other.
"""

from __future__ import annotations

import h11
import trio

# /metrics of a vLLM with many adapters runs to a few hundred KiB; anything far past that is not
# an engine answering.
MAX_BODY_BYTES = 4 * 2**20
RECEIVE_BYTES = 64 * 2**10


class ProbeFailed(Exception):
    """No HTTP answer: refused, reset, timed out, or not HTTP."""


# A timeout parameter (not the caller's cancel scope): a probe without a bound is a hang waiting to
# happen, so every caller must choose one.
async def http_get(
    host: str,
    port: int,
    path: str,
    *,
    headers: dict[str, str] | None = None,
    timeout: float,  # noqa: ASYNC109
) -> tuple[int, bytes]:
    """The status and body of ``GET path``; raises ProbeFailed without an answer in ``timeout``."""
    try:
        with trio.fail_after(timeout):
            return await _get(host, port, path, headers or {})
    except trio.TooSlowError:
        raise ProbeFailed(f"no answer from {host}:{port}{path} within {timeout}s") from None
    except (OSError, trio.BrokenResourceError, h11.ProtocolError) as exc:
        raise ProbeFailed(f"GET {host}:{port}{path}: {exc}") from None


async def http_post(
    host: str,
    port: int,
    path: str,
    body: bytes,
    *,
    headers: dict[str, str] | None = None,
    timeout: float,  # noqa: ASYNC109
) -> tuple[int, bytes]:
    """The status and body of ``POST path`` with a JSON ``body`` (the server's run-time adapter
    loads); raises ProbeFailed without an answer in ``timeout``."""
    sent = {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}
    try:
        with trio.fail_after(timeout):
            return await _get(host, port, path, sent, method="POST", body=body)
    except trio.TooSlowError:
        raise ProbeFailed(f"no answer from {host}:{port}{path} within {timeout}s") from None
    except (OSError, trio.BrokenResourceError, h11.ProtocolError) as exc:
        raise ProbeFailed(f"POST {host}:{port}{path}: {exc}") from None


async def _get(
    host: str, port: int, path: str, headers: dict[str, str], *, method: str = "GET", body: bytes = b""
) -> tuple[int, bytes]:
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        connection = h11.Connection(h11.CLIENT)
        request = h11.Request(
            method=method,
            target=path,
            headers=[("Host", f"{host}:{port}"), ("Connection", "close"), *headers.items()],
        )
        data = connection.send(request)
        if body:
            data += connection.send(h11.Data(data=body))
        await stream.send_all(data + connection.send(h11.EndOfMessage()))
        status = 0
        body = bytearray()
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(await stream.receive_some(RECEIVE_BYTES))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY_BYTES:
                    raise ProbeFailed(f"{host}:{port}{path} answered more than {MAX_BODY_BYTES} bytes")
            elif isinstance(event, h11.EndOfMessage):
                return status, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                raise ProbeFailed(f"{host}:{port}{path} closed the connection without answering")
