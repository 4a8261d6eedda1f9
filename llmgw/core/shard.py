"""A shard: one node's part of a replica, and the processes that run it.

``ShardSpec`` is what the control plane decides and sends to the agent inside StartShard; the
agent writes it to disk so that it can adopt the shard after a restart. It therefore holds no
secret: the engine key is passed to the command builders separately. ``LaunchPlan`` is what the
builders in :mod:`llmgw.core.engines` turn a spec into.

Every type here is frozen attrs over plain values (str, int, bool, tuple, dict, None), so cattrs
converts them to JSON and back without hooks.
"""

from __future__ import annotations

import attrs

from llmgw.core.training import FileDigest

frozen = attrs.frozen(kw_only=True)

# "" = no RDMA fabric chosen: collectives go over TCP on the management interface.
FABRIC_KINDS = ("", "ib", "roce")


@frozen
class GpuRef:
    """One GPU of this node given to the shard, as the agent's discovery named it."""

    index: int  # NVML's index, which is the PCI bus order
    uuid: str
    gpu_class: str  # e.g. "h100-80g"
    compute_capability: str  # "8.9"
    # The card's memory, as discovery reports it: what an engine's share of the card is a share
    # of. 0: unknown (a spec from before this field), and the engine takes its default share.
    memory_total_mib: int = 0


@frozen
class Fabric:
    """The RDMA fabric the shard's collectives use between nodes."""

    kind: str = ""  # one of FABRIC_KINDS
    # Adapters of the chosen fabric only, e.g. ("mlx5_0", "mlx5_1"): NCCL given an open list may
    # pick an adapter on another fabric, where the peer is unreachable, and hang.
    hcas: tuple[str, ...] = ()
    # RoCE only: the GID entry that is RoCE v2 and holds an IPv4 address.
    gid_index: int | None = None


@frozen
class Adapter:
    """A LoRA adapter loaded when the engine starts: files already on the node (``path``), or an
    adapter the server keeps (``source``), whose files the server delivers to the node before the
    shard starts. A profile sets exactly one of the two."""

    name: str  # the model name clients ask for to get it
    path: str = ""  # its weights on the node; for a stored adapter, filled in by the agent
    source: str = ""  # the name of an adapter kept by the server (``llmgw ctl adapters``)
    # A stored adapter's files the engine needs, filled in by the server when it sends the shard:
    # the agent finds the delivered copy by them, so a re-made adapter is never taken for the old.
    files: tuple[FileDigest, ...] = ()


@frozen
class ShardSpec:
    shard_id: str
    replica_id: str
    # The catalog profile the replica was placed for: what a restarted server matches a running
    # shard against to rebuild its replica ("" for a shard started by hand).
    profile: str = ""
    model: str  # the name clients use
    model_path: str  # weights on the node: a directory, a .gguf file, or a hub id
    # The catalog's checksum of the weights; with a URL or hub reference in model_path, the node
    # fetches them into its cache and checks them against it (llmgw.core.weights).
    model_sha256: str | None = None
    engine: str  # a name in llmgw.core.engines.ENGINES
    # The profile's engine build, installed by the agent first; None: the node's own engine.
    engine_version: str | None = None
    launcher: str = "mp"  # one of the engine's launchers (llmgw.core.engines)
    gpus: tuple[GpuRef, ...] = ()  # this node's GPUs for the shard; empty = CPU
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    nodes: int = 1
    rank: int = 0
    leader_address: str = ""  # rank 0's management IP
    node_address: str = ""  # this node's management IP
    mgmt_interface: str = ""  # the interface holding node_address (NCCL/GLOO sockets)
    port: int  # the engine's HTTP port (served by rank 0)
    # Where the ranks meet on the leader: vLLM's master port, SGLang's dist-init port, the Ray
    # head's port. 0 = none (a single-node mp shard needs none).
    rendezvous_port: int = 0
    ctx_size: int | None = None  # context length the engine is started with
    # Sequences served at once: llama.cpp's slots, vLLM's max-num-seqs, SGLang's max running
    # requests.
    parallel: int | None = None
    # A CPU shard's cores, as placement reserved them: the engine's threads. None: the engine's
    # own default (every core), for a GPU shard or a spec from before this field.
    cpu_threads: int | None = None
    # A CPU shard's host memory, as placement reserved it (MiB): what an engine that sizes its
    # own caches (vLLM's KV cache on the CPU) is told to stay within. None: a GPU shard, or a
    # spec from before this field.
    cpu_memory_mib: int | None = None
    # MiB of each of ``gpus`` that placement reserved for the shard: the engine is told to stay
    # within it, so that a neighbour placed on the rest of the card has it. None: the engine's
    # own default share, for a CPU shard or a spec from before this field.
    gpu_memory_mib: int | None = None
    dtype: str | None = None
    quantization: str | None = None  # e.g. "fp8"
    extra_flags: tuple[str, ...] = ()  # the profile's flags, as argv tokens
    adapters: tuple[Adapter, ...] = ()
    # Adapters loaded at run time instead (the profile's max_loaded_adapters): the engine starts
    # with none and room for this many, of ranks up to max_lora_rank (None: the engine's default).
    max_loaded_adapters: int | None = None
    max_lora_rank: int | None = None
    fabric: Fabric = Fabric()


@frozen
class Command:
    """One process of a shard."""

    name: str  # "engine", "ray-head", "ray-worker"
    argv: tuple[str, ...]
    # Added to the agent's environment for this process.
    env: dict[str, str]
    # Start only once leader_address:rendezvous_port accepts connections: a process that joins
    # the leader exits at once when nothing listens there yet.
    waits_for_leader: bool = False
    serves_http: bool = False


@frozen
class LaunchPlan:
    # Sidecars first, the engine last: the last command's exit is the shard's exit.
    commands: tuple[Command, ...]
    # The port to health-check on this node; None when this rank serves no HTTP and is judged by
    # staying alive.
    health_port: int | None
