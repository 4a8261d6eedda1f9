"""Messages exchanged on the agent link.

Every message is a frozen attrs class. On the wire each one is a JSON object whose ``type`` field
names the class (see :mod:`llmgw.wire.codec`). Adding a field with a default is compatible both
ways: an older peer ignores nothing silently, so new fields must always have defaults.

Commands (server → agent) carry an ``id`` that the agent's reply repeats as ``reply_to``, a
``trace`` context (W3C traceparent/tracestate style key/values), and the sending leader's
``term``, which the agent checks (core/fencing.py) before it acts.
"""

from __future__ import annotations

import attrs

from llmgw.core.inventory import ForeignProcess, Gpu, IbPort, Inventory
from llmgw.core.reports import (
    Compute,
    GpuUse,
    JobPiece,
    JobStatus,
    RunningJob,
    RunningShard,
    ShardState,
)
from llmgw.core.shard import ShardSpec
from llmgw.core.training import FileDigest, TrainSpec

# Defined in the core, which decides on them; carried here as they are.
__all__ = [
    "Compute",
    "ForeignProcess",
    "Gpu",
    "GpuUse",
    "IbPort",
    "Inventory",
    "JobPiece",
    "JobStatus",
    "RunningJob",
    "RunningShard",
    "ShardState",
]

frozen = attrs.frozen(kw_only=True)


# --- link messages ------------------------------------------------------------------------------


@frozen
class Register:
    """First message of the agent on a new stream."""

    node: str
    agent_version: str
    inventory: Inventory
    shards: tuple[RunningShard, ...] = ()
    # Training jobs this agent still runs (a restarted server re-attaches them, fails the rest).
    jobs: tuple[RunningJob, ...] = ()
    # Its engines.stop_grace: how long a stop may wait before SIGKILL, so that the server waits
    # long enough for a stop's answer. (An agent older than the field reports nothing: 30 s.)
    stop_grace: float = 30.0


@frozen
class Registered:
    """The server's answer to Register: the link is up and these are its rhythms."""

    node: str
    server_version: str
    heartbeat_interval: float  # seconds; both sides send one at this rate
    missed_heartbeats: int  # silence for interval × this ends the link
    # The leader lease as this server sees it (core/leadership.py): the term, and whether this
    # server holds it. Servers older than the fields say 0 and False.
    term: int = 0
    leader: bool = False


@frozen
class Heartbeat:
    """Sent both ways every heartbeat interval; any message counts as a sign of life."""

    seq: int
    # The agent may attach a fresh inventory (free memory changes); None = unchanged.
    inventory: Inventory | None = None
    # From a server: the lease's term as it sees it and whether it leads (as in Registered),
    # sent at once when either changes. An agent's heartbeats leave them as they are.
    term: int = 0
    leader: bool = False


@frozen
class Ping:
    """A command that proves the server can call the agent and get an answer."""

    id: int
    trace: dict[str, str] = attrs.field(factory=dict)
    payload: str = ""


@frozen
class Pong:
    reply_to: int
    payload: str = ""
    node: str = ""


@frozen
class StartShard:
    """Run a shard. A StartShard for a shard that already runs is a no-op."""

    id: int
    trace: dict[str, str] = attrs.field(factory=dict)
    term: int = 0  # the sender's leader term (core/fencing.py); set by the link
    spec: ShardSpec
    # The replica's engine key. Never logged (repr=False), never put in argv where the engine
    # takes it from its environment.
    engine_key: str | None = attrs.field(default=None, repr=False)


@frozen
class StopShard:
    """Stop a shard: SIGTERM to each process group, SIGKILL after ``grace`` seconds."""

    id: int
    trace: dict[str, str] = attrs.field(factory=dict)
    term: int = 0  # the sender's leader term (core/fencing.py); set by the link
    shard_id: str
    grace: float | None = None  # None: the agent's own engines.stop_grace


@frozen
class DrainShard:
    """Stop a shard once its engine has no request running, or after ``timeout`` seconds."""

    id: int
    trace: dict[str, str] = attrs.field(factory=dict)
    term: int = 0  # the sender's leader term (core/fencing.py); set by the link
    shard_id: str
    timeout: float = 60.0


@frozen
class CommandResult:
    """The agent's answer to a command other than Ping."""

    reply_to: int
    ok: bool
    message: str = ""  # why not, or what happened ("already running", "not running")
    # Not 0: refused by fencing, and this is the newer term the agent has seen.
    fenced: int = 0


@frozen
class ShardStatus:
    """A shard changed state (or learned its compute); sent by the agent as it happens."""

    shard_id: str
    replica_id: str
    state: str  # a ShardState value
    reason: str = ""
    pid: int = 0
    compute: Compute | None = None
    log_tail: tuple[str, ...] = ()  # the last lines of output, on failure
    # The shard's spec, so that a server the agent registered with before the shard started
    # (a follower) knows it as fully as Register would have listed it.
    spec: ShardSpec | None = None


@frozen
class StartJob:
    """Train an adapter. A StartJob for a job the agent already runs is a no-op."""

    id: int
    trace: dict[str, str] = attrs.field(factory=dict)
    term: int = 0  # the sender's leader term (core/fencing.py); set by the link
    spec: TrainSpec


@frozen
class CancelJob:
    """Stop a job's child (SIGTERM to its group, SIGKILL after ``grace``) and drop its files."""

    id: int
    trace: dict[str, str] = attrs.field(factory=dict)
    term: int = 0  # the sender's leader term (core/fencing.py); set by the link
    job_id: str
    grace: float = 10.0


@frozen
class Goodbye:
    """Sent before a side closes the stream on purpose (shutdown, replaced by a newer link)."""

    reason: str = ""


@frozen
class PutAdapter:
    """Before a shard that serves a stored adapter starts: does the node hold these files?

    The agent answers CommandResult ok with "present <the copy's directory>" when its copy holds
    exactly these files, or "send": AdapterPiece messages follow (files in this order), then
    AdapterDone, answered with the copy's directory.
    """

    id: int
    trace: dict[str, str] = attrs.field(factory=dict)
    term: int = 0  # the sender's leader term (core/fencing.py); set by the link
    name: str  # the stored adapter's name
    files: tuple[FileDigest, ...] = ()


@frozen
class AdapterPiece:
    """One piece of one file of a stored adapter, server to agent; same rules as JobPiece."""

    name: str  # the stored adapter's name (PutAdapter.name)
    file: str  # FileDigest.name
    index: int
    count: int
    data: str  # base64 of at most PIECE_BYTES bytes
    sha256: str  # hex digest of this piece's bytes


@frozen
class AdapterDone:
    """Every piece of the adapter was sent: answered ok once each file verified and the copy is in
    place; not ok (with why) otherwise, and then nothing of it is kept."""

    id: int
    trace: dict[str, str] = attrs.field(factory=dict)
    term: int = 0  # the sender's leader term (core/fencing.py); set by the link
    name: str


Message = (
    Register
    | Registered
    | Heartbeat
    | Ping
    | Pong
    | StartShard
    | StopShard
    | DrainShard
    | CommandResult
    | ShardStatus
    | StartJob
    | CancelJob
    | JobStatus
    | JobPiece
    | Goodbye
    | PutAdapter
    | AdapterPiece
    | AdapterDone
)
MESSAGE_TYPES: tuple[type, ...] = (
    Register,
    Registered,
    Heartbeat,
    Ping,
    Pong,
    StartShard,
    StopShard,
    DrainShard,
    CommandResult,
    ShardStatus,
    StartJob,
    CancelJob,
    JobStatus,
    JobPiece,
    Goodbye,
    PutAdapter,
    AdapterPiece,
    AdapterDone,
)
