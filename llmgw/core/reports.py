"""What agents report of the work they run: shards and their state, training jobs and the
pieces of their output.

The core decides on these (the reconciler follows shard states, the jobs core job states, the
reassembly the pieces); the link carries them as they are (wire.messages re-exports them).
"""

from __future__ import annotations

import enum

import attrs

from llmgw.core.shard import ShardSpec
from llmgw.core.states import Lifecycle
from llmgw.core.training import FileDigest

frozen = attrs.frozen(kw_only=True)


class ShardState(enum.StrEnum):
    """A shard's life on its node, as the agent reports it (the strings are what travels)."""

    STARTING = "Starting"  # processes launched, the engine does not answer /health yet
    LOADING = "Loading"  # /health answers, the model is not served yet (/v1/models)
    READY = "Ready"  # serving
    DRAINING = "Draining"  # waiting for in-flight requests before stopping
    STOPPED = "Stopped"  # stopped on request
    FAILED = "Failed"  # exited or refused to start; see reason and log tail


_SHARD_ENDS = (ShardState.STOPPED, ShardState.FAILED)
# One shard's life under one agent process, which the supervisor moves only through this table:
# forward only, and a stop or a failure from anywhere. A rank that serves no HTTP, or an engine
# that answers /v1/models at its first probe, skips Loading; a shard that was never Ready drains
# at once. An agent restart begins a new life at Starting for each shard it adopts, which is why
# the server's copy of a shard's state, following reports, may go back where this table may not.
SHARD_LIFECYCLE = Lifecycle.of(
    "shard",
    ShardState,
    {
        ShardState.STARTING: {ShardState.LOADING, ShardState.READY, ShardState.DRAINING, *_SHARD_ENDS},
        ShardState.LOADING: {ShardState.READY, ShardState.DRAINING, *_SHARD_ENDS},
        ShardState.READY: {ShardState.DRAINING, *_SHARD_ENDS},
        ShardState.DRAINING: {*_SHARD_ENDS},
        ShardState.STOPPED: (),
        ShardState.FAILED: (),
    },
)


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
    # A ShardState value. Plain str on the link, here and below: a state a newer peer added is
    # then ignored by whoever reads it, where an enum field would fail the message and drop the
    # link (see wire.codec on rolling upgrades).
    state: str
    pid: int = 0  # the engine's (the last command's) pid
    compute: Compute | None = None  # None until known
    adopted: bool = False  # started by an earlier agent process


@frozen
class RunningJob:
    """A training job the agent runs, as listed in every Register."""

    job_id: str
    state: str  # a JobState value


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
