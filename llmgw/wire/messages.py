"""Messages exchanged on the agent link.

Every message is a frozen attrs class. On the wire each one is a JSON object whose ``type`` field
names the class (see :mod:`llmgw.wire.codec`). Adding a field with a default is compatible both
ways: an older peer ignores nothing silently, so new fields must always have defaults.

Commands (server → agent) carry an ``id`` that the agent's reply repeats as ``reply_to``, and a
``trace`` context (W3C traceparent/tracestate style key/values; empty until tracing lands).
"""

from __future__ import annotations

import attrs

from llmgw.core.shard import ShardSpec
from llmgw.core.training import FileDigest, TrainSpec

frozen = attrs.frozen(kw_only=True)


# --- what a node is made of (the agent's discovery) -------------------------------------------


@frozen
class ForeignProcess:
    """A process holding GPU memory that llmgw did not start."""

    pid: int
    name: str = ""
    used_mib: int = 0


@frozen
class Gpu:
    index: int
    uuid: str
    name: str
    gpu_class: str  # e.g. "l40s-45g": product name + driver-reported memory rounded to GiB
    memory_total_mib: int
    memory_used_mib: int
    compute_capability: str  # "8.9"
    ecc_uncorrected: int = 0  # volatile uncorrected ECC errors; -1 when the GPU cannot say
    foreign_processes: tuple[ForeignProcess, ...] = ()
    # Health flags, empty when healthy: "ecc-uncorrected", "foreign-memory".
    problems: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        return not self.problems

    @property
    def memory_free_mib(self) -> int:
        return max(0, self.memory_total_mib - self.memory_used_mib)


@frozen
class IbPort:
    """One port of an InfiniBand/RoCE adapter, from /sys/class/infiniband."""

    device: str  # "mlx5_0"
    port: int
    state: str  # "ACTIVE", "DOWN", ...
    rate_gbps: float
    link_layer: str  # "InfiniBand" or "Ethernet" (RoCE)
    # RoCE only: the GID table entry that is RoCE v2 and holds an IPv4 address (NCCL_IB_GID_INDEX).
    roce_v2_gid_index: int | None = None
    # GID 0's subnet prefix (IB) or the IPv4 of the RoCE v2 GID: what ties ports into one fabric.
    subnet: str = ""

    @property
    def is_roce(self) -> bool:
        return self.link_layer == "Ethernet"


@frozen
class Inventory:
    hostname: str
    cpu_count: int
    memory_total_mib: int
    memory_available_mib: int
    gpus: tuple[Gpu, ...] = ()
    ib_ports: tuple[IbPort, ...] = ()
    # The island this node's multi-node placements may span; "" = a single-node island.
    fabric: str = ""
    # The interface holding the address this agent uses to reach the server (NCCL/GLOO socket ifname).
    mgmt_interface: str = ""
    mgmt_address: str = ""
    # Why the node has no GPUs listed, when NVML could not be used ("" when it could).
    gpu_note: str = ""
    # The GPUs and RDMA ports come from a file (agent.yaml's discovery.simulate), not the hardware.
    simulated: bool = False


class ShardState:
    """A shard's life on its node, as the agent reports it."""

    STARTING = "Starting"  # processes launched, the engine does not answer /health yet
    LOADING = "Loading"  # /health answers, the model is not served yet (/v1/models)
    READY = "Ready"  # serving
    DRAINING = "Draining"  # waiting for in-flight requests before stopping
    STOPPED = "Stopped"  # stopped on request
    FAILED = "Failed"  # exited or refused to start; see reason and log tail


@frozen
class GpuUse:
    """GPU memory held by a shard's processes on one card (NVML per-process accounting)."""

    index: int
    uuid: str
    used_mib: int


@frozen
class Compute:
    """What a shard computes on: GPUs and memory, or the CPU when it holds none."""

    gpus: tuple[GpuUse, ...] = ()

    @property
    def on_cpu(self) -> bool:
        return not self.gpus


@frozen
class RunningShard:
    """A shard the agent runs, as listed in every Register."""

    spec: ShardSpec
    state: str  # a ShardState value
    pid: int = 0  # the engine's (the last command's) pid
    compute: Compute | None = None  # None until known
    adopted: bool = False  # started by an earlier agent process


@frozen
class RunningJob:
    """A training job the agent runs, as listed in every Register."""

    job_id: str
    state: str  # a JobState value


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


@frozen
class Registered:
    """The server's answer to Register: the link is up and these are its rhythms."""

    node: str
    server_version: str
    heartbeat_interval: float  # seconds; both sides send one at this rate
    missed_heartbeats: int  # silence for interval × this ends the link


@frozen
class Heartbeat:
    """Sent both ways every heartbeat interval; any message counts as a sign of life."""

    seq: int
    # The agent may attach a fresh inventory (free memory changes); None = unchanged.
    inventory: Inventory | None = None


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
    spec: ShardSpec
    # The replica's engine key. Never logged (repr=False), never put in argv where the engine
    # takes it from its environment.
    engine_key: str | None = attrs.field(default=None, repr=False)


@frozen
class StopShard:
    """Stop a shard: SIGTERM to each process group, SIGKILL after ``grace`` seconds."""

    id: int
    trace: dict[str, str] = attrs.field(factory=dict)
    shard_id: str
    grace: float = 30.0


@frozen
class DrainShard:
    """Stop a shard once its engine has no request running, or after ``timeout`` seconds."""

    id: int
    trace: dict[str, str] = attrs.field(factory=dict)
    shard_id: str
    timeout: float = 60.0


@frozen
class CommandResult:
    """The agent's answer to a command other than Ping."""

    reply_to: int
    ok: bool
    message: str = ""  # why not, or what happened ("already running", "not running")


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


@frozen
class StartJob:
    """Train an adapter. A StartJob for a job the agent already runs is a no-op."""

    id: int
    trace: dict[str, str] = attrs.field(factory=dict)
    spec: TrainSpec


@frozen
class CancelJob:
    """Stop a job's child (SIGTERM to its group, SIGKILL after ``grace``) and drop its files."""

    id: int
    trace: dict[str, str] = attrs.field(factory=dict)
    job_id: str
    grace: float = 10.0


@frozen
class JobStatus:
    """A job moved on: a new state, or progress inside Training. Sent by the agent as it happens.

    Progress is sent at most a few times a second, so a fast tiny model does not flood the link.
    """

    job_id: str
    state: str  # a JobState value
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    # Peak memory of the card the child trains on, or the child's peak RSS on a CPU node.
    peak_mib: int = 0
    device: str = ""  # "cuda:0 (GPU 0)" or "cpu"
    reason: str = ""  # why, for Failed and Cancelled
    log_tail: tuple[str, ...] = ()  # the child's last lines, on failure
    # With state Uploading: the files that follow as JobPiece messages, in this order.
    files: tuple[FileDigest, ...] = ()


@frozen
class JobPiece:
    """One piece of one output file. Pieces of a file arrive in order, index 0..count-1."""

    job_id: str
    file: str  # FileDigest.name
    index: int
    count: int
    data: str  # base64 of at most PIECE_BYTES bytes
    sha256: str  # hex digest of this piece's bytes


@frozen
class Goodbye:
    """Sent before a side closes the stream on purpose (shutdown, replaced by a newer link)."""

    reason: str = ""


@frozen
class PutAdapter:
    """Before a shard that serves a stored adapter starts: does the node hold these files?

    The agent answers CommandResult ok with "present" when its copy holds exactly these files,
    or "send": AdapterPiece messages follow (files in this order), then AdapterDone.
    """

    id: int
    trace: dict[str, str] = attrs.field(factory=dict)
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
