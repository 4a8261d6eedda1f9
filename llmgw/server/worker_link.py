"""What the control plane and its gateway workers say to each other, on a local stream.

Each worker listens on a unix socket of its own in the server's data directory (0700); the
control plane connects to it — the one it started, or after a restart the ones an earlier server
left running — and pushes everything a request needs, so that nothing per request waits on the
control plane: :class:`Keys` (API keys as digests, and tenants with their limits), :class:`Routes`
(every served model's Ready replicas, their endpoints, engine keys, slots and loads). Each replaces
what the worker had of that kind. The worker reports back every :data:`REPORT_INTERVAL` seconds
(:class:`Report`: its requests in flight, queued and idle per model, for the scaler and for ctl),
and at once when a request starts to wait for a model that has no Ready replica (:class:`Waiting`,
the scaler's cue to start one), and :class:`NeedAdapter` when a request names an adapter loaded on
demand that no replica with room holds (the server loads it, once for every worker, and answers
with :class:`AdapterAnswer`).

One message per line: JSON with a ``type`` member, as the agent link's codec frames its own. A
worker that meets a type it does not know skips it (a newer server), as the agent link does.
Engine keys travel here and nowhere else: the socket is the server's user's alone, and no message
is ever logged.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import attrs
import cattrs
import trio

from llmgw.core.leases import LeaseGrant, LeaseReport
from llmgw.core.quota import Limits

log = logging.getLogger(__name__)

frozen = attrs.frozen(kw_only=True)

REPORT_INTERVAL = 1.0
# How often a leased worker looks whether it owes the control plane a lease report.
LEASE_TICK = 0.1
# A line past this is refused: a snapshot of thousands of replicas and keys stays far below it.
MAX_LINE = 64 * 1024 * 1024


@frozen
class PushedLimits:
    rpm: int | None = None
    tpm: int | None = None
    tpd: int | None = None

    @classmethod
    def of(cls, limits: Limits) -> PushedLimits:
        return cls(rpm=limits.rpm, tpm=limits.tpm, tpd=limits.tpd)

    def limits(self) -> Limits:
        return Limits(rpm=self.rpm, tpm=self.tpm, tpd=self.tpd)


@frozen
class PushedKey:
    id: str
    tenant: str
    digest: str  # hex SHA-256 of the secret: the worker checks secrets, never holds them
    models: tuple[str, ...] = ()
    band: int = 0
    limits: PushedLimits | None = None


@frozen
class PushedTenant:
    name: str
    limits: PushedLimits = PushedLimits()


@frozen
class Keys:
    keys: tuple[PushedKey, ...]
    tenants: tuple[PushedTenant, ...]


@frozen
class PushedReplica:
    replica: str
    host: str
    port: int
    engine_key: str = attrs.field(repr=False)
    slots: int
    # The engine's load as last scraped; running None when unknown.
    running: int | None = None
    waiting: int = 0
    saturation: float = 0.0
    # The adapters it serves: (name, the body members that select it, as JSON text; '' for none).
    adapters: tuple[tuple[str, str], ...] = ()
    body_members: str = ""  # those that select the base model ('' for none)


@frozen
class PushedModel:
    model: str
    policy: str
    load_factor: float
    prefix_chars: int
    replicas: tuple[PushedReplica, ...] = ()
    adapters: tuple[str, ...] = ()  # served under their own names, this model their base
    # Its adapters are loaded on demand: a replica's adapters are those its engine holds now, and
    # a request for another is asked of the control plane (NeedAdapter) before it queues.
    loads_adapters: bool = False


@frozen
class Routes:
    models: tuple[PushedModel, ...]  # every served model, Ready replicas or not
    ttft_targets: tuple[tuple[str, float], ...] = ()  # per model, where a profile sets one
    # The control plane's count of route changes when it built these: an AdapterAnswer names the
    # version a worker must have taken before the adapter it asked for shows in its routes.
    version: int = 0


@frozen
class Report:
    worker: str
    pid: int
    fresh: bool  # it has had keys and routes: it serves
    requests: int  # answered since the worker started
    lease_left: float | None = None  # seconds its lease still holds; None for a lone worker
    connections: int = 0  # client connections open now
    # Since the worker started: requests answered, those that failed, TTFT SLO violations.
    traffic: tuple[float, float, float] = (0.0, 0.0, 0.0)
    in_flight: tuple[tuple[str, str, int], ...] = ()  # (model, replica, requests)
    queued: tuple[tuple[str, int, int], ...] = ()  # (model, band, requests)
    idle_for: tuple[tuple[str, float], ...] = ()  # (model, seconds with nothing in flight or queued)
    routes_version: int = 0  # the Routes.version it serves by
    # Requests naming an adapter: in flight (replica, adapter, n), and waiting (adapter, n). No
    # adapter with either is unloaded.
    adapters_in_flight: tuple[tuple[str, str, int], ...] = ()
    adapters_waiting: tuple[tuple[str, int], ...] = ()
    # Its leased shares of quotas it holds any of: (kind, id, limit, share), kind "tenant" or "key".
    quota_shares: tuple[tuple[str, str, str, int], ...] = ()


@frozen
class Waiting:
    model: str


@frozen
class NeedAdapter:
    """Worker to control plane: a request names ``adapter`` of ``model``, and no replica with
    room holds it. Answered by an AdapterAnswer with the same ``ask``."""

    ask: int
    model: str
    adapter: str


@frozen
class AdapterAnswer:
    """Go on (status 200) once routes of ``routes_version`` or later are taken; else the error
    the request is answered with (the engine's reason for a failed load, a timeout)."""

    ask: int
    status: int = 200
    message: str = ""
    code: str = ""
    routes_version: int = 0


# Leases (several workers): a worker's LeaseReport each RENEW_INTERVAL, the ledger's LeaseGrant back.
Message = Keys | Routes | Report | Waiting | LeaseReport | LeaseGrant | NeedAdapter | AdapterAnswer
_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (Keys, Routes, Report, Waiting, LeaseReport, LeaseGrant, NeedAdapter, AdapterAnswer)
}
_converter = cattrs.Converter(forbid_extra_keys=False)


def encode(message: Message) -> bytes:
    data = _converter.unstructure(message)
    data["type"] = type(message).__name__
    return json.dumps(data, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> Message | None:
    """The message on ``line``; None for a type this version does not know."""
    data: dict[str, Any] = json.loads(line)
    kind = _TYPES.get(data.pop("type", None))
    if kind is None:
        return None
    return _converter.structure(data, kind)


# What ends a worker link: the other end gone, or what it sent is not a message.
LINK_ERRORS = (EOFError, OSError, trio.BrokenResourceError, trio.ClosedResourceError, ValueError)


class LinkLost(Exception):
    """The worker link ended (the other process went, or spoke nonsense)."""


class LineStream:
    """Messages over a trio stream, one per line."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._buffer = bytearray()
        self._lock = trio.Lock()

    async def send(self, message: Message) -> None:
        async with self._lock:
            await self._stream.send_all(encode(message))

    async def receive(self) -> Message | None:
        """The next message; raises EOFError when the other end has gone."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                message = decode(line)
                if message is None:
                    continue  # a newer peer's message: nothing here acts on it
                return message
            if len(self._buffer) > MAX_LINE:
                raise ValueError(f"a line of over {MAX_LINE} bytes on the worker link")
            data = await self._stream.receive_some(1 << 16)
            if not data:
                raise EOFError("the other end closed the worker link")
            self._buffer += data

    async def aclose(self) -> None:
        await self._stream.aclose()
