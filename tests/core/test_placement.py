"""The catalog's checks and pure placement: where a replica goes, or every node's reason why not."""

from __future__ import annotations

import collections
import itertools
import random

import attrs
import cattrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.catalog import Model, Profile, validate_model, validate_profile
from llmgw.core.engines import EngineBinaries, build_plan, validate
from llmgw.core.placement import (
    ClusterView,
    GpuView,
    NodeView,
    Placement,
    ShardPlacement,
    Unplaceable,
    apply,
    place,
    to_shard_specs,
)
from llmgw.core.shard import Adapter, Fabric

PORTS = (20000, 29999)
IB = Fabric(kind="ib", hcas=("mlx5_0", "mlx5_1"))

LLAMA = Model(name="llama-3-70b", path="/models/llama-3-70b", format="safetensors")
SMOL = Model(name="smol", path="/models/smol.gguf", format="gguf")
MODELS = {m.name: m for m in (LLAMA, SMOL)}


def gpu(index: int, gpu_class: str = "l40s-45g", free: int = 45_000, **changes: object) -> GpuView:
    return GpuView(
        index=index,
        uuid=f"GPU-{gpu_class}-{index}",
        gpu_class=gpu_class,
        compute_capability="8.9",
        memory_total_mib=46_068,
        memory_free_mib=free,
        **changes,
    )


def node(
    name: str, gpus: int | tuple[GpuView, ...] = 0, gpu_class: str = "l40s-45g", **changes: object
) -> NodeView:
    """A node named like "node-3" (address 10.0.0.3); ``gpus`` is a count of free cards or the cards."""
    defaults: dict[str, object] = {
        "address": f"10.0.0.{name.rsplit('-', 1)[-1]}",
        "mgmt_interface": "eth0",
        "gpus": gpus if isinstance(gpus, tuple) else tuple(gpu(i, gpu_class) for i in range(gpus)),
        "memory_free_mib": 64_000,
        "cpu_cores_free": 16,
    }
    return NodeView(name=name, **{**defaults, **changes})


def gpu_profile(**changes: object) -> Profile:
    base = Profile(
        name="chat",
        model="llama-3-70b",
        engine="vllm",
        gpu_class="l40s-45g",
        gpus_per_node=2,
        tensor_parallel=2,
        memory_mib=20_000,
    )
    return attrs.evolve(base, **changes)


def cpu_profile(**changes: object) -> Profile:
    base = Profile(
        name="tiny", model="smol", engine="llamacpp", gpu_class=None, memory_mib=4_096, cpu_cores=4
    )
    return attrs.evolve(base, **changes)


def placed(result: Placement | Unplaceable) -> Placement:
    assert isinstance(result, Placement), result.summary
    return result


def reasons(result: Placement | Unplaceable) -> dict[str, str]:
    assert isinstance(result, Unplaceable), result
    return dict(result.reasons)


# --- catalog ------------------------------------------------------------------------------------


def test_a_valid_profile_has_no_errors():
    assert validate_profile(gpu_profile(), MODELS) == []
    assert validate_profile(gpu_profile(nodes=2, tensor_parallel=2, pipeline_parallel=2), MODELS) == []
    assert validate_profile(cpu_profile(), MODELS) == []
    assert validate_profile(gpu_profile(engine="llamacpp", model="smol", tensor_parallel=2), MODELS) == []


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        (
            {"name": "chat-fast", "tensor_parallel": 4},
            "profiles.chat-fast.tensor_parallel: 4 × pipeline 1 needs 4 GPUs, the profile has 1 node × 2 GPUs",
        ),
        ({"model": "gpt-9"}, "profiles.chat.model: no model named 'gpt-9' in the catalog"),
        ({"engine": "tgi"}, "profiles.chat.engine: 'tgi' is not one of vllm, sglang, llamacpp"),
        ({"launcher": "slurm"}, "profiles.chat.launcher: 'slurm' is not one of mp, ray"),
        (
            {"engine": "sglang", "launcher": "ray"},
            "profiles.chat.launcher: 'ray' is for vLLM only; SGLang starts its own ranks",
        ),
        (
            {"engine": "llamacpp", "nodes": 2, "model": "smol"},
            "profiles.chat.nodes: llama.cpp runs on one node, not 2",
        ),
        (
            {"engine": "llamacpp"},
            "profiles.chat.model: llama.cpp loads gguf, and 'llama-3-70b' is safetensors",
        ),
        (
            {"engine": "sglang", "gpu_class": None, "gpus_per_node": 0, "tensor_parallel": 1},
            "profiles.chat.gpu_class: SGLang needs GPUs and none is set (only vLLM and llama.cpp run on the CPU)",
        ),
        (
            {"gpus_per_node": 0, "tensor_parallel": 1},
            "profiles.chat.gpus_per_node: a l40s-45g profile needs at least 1 GPU per node, not 0",
        ),
        ({"gpu_class": ""}, "profiles.chat.gpu_class: empty; leave it unset for a CPU profile"),
        ({"min_replicas": 3, "max_replicas": 2}, "profiles.chat.min_replicas: 3 is above max_replicas 2"),
        ({"memory_mib": 0}, "profiles.chat.memory_mib: must be at least 1, not 0"),
        ({"nodes": 0}, "profiles.chat.nodes: must be at least 1, not 0"),
        ({"min_replicas": -1}, "profiles.chat.min_replicas: must be at least 0, not -1"),
        ({"gpus_per_node": -2}, "profiles.chat.gpus_per_node: must be at least 0, not -2"),
        ({"ctx_size": 0}, "profiles.chat.ctx_size: must be at least 1 when set, not 0"),
        ({"startup_timeout": 0.0}, "profiles.chat.startup_timeout: must be above 0 seconds, not 0.0"),
    ],
)
def test_gpu_profile_errors_name_the_field(changes, error):
    assert error in validate_profile(gpu_profile(**changes), MODELS)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        (
            {"gpus_per_node": 2},
            "profiles.tiny.gpus_per_node: 2 GPUs on a CPU profile: set gpu_class to use GPUs",
        ),
        (
            {"tensor_parallel": 2},
            "profiles.tiny.tensor_parallel: 2 × pipeline 1 on a CPU profile, which runs as 1 × 1",
        ),
        ({"cpu_cores": 0}, "profiles.tiny.cpu_cores: must be at least 1, not 0"),
    ],
)
def test_cpu_profile_errors_name_the_field(changes, error):
    assert error in validate_profile(cpu_profile(**changes), MODELS)


def test_a_profile_without_a_name_says_so():
    assert validate_profile(gpu_profile(name=""), MODELS)[0] == "profiles: a profile needs a name"


def test_model_errors_name_the_field():
    assert validate_model(SMOL) == [] and validate_model(LLAMA) == []
    assert validate_model(Model(name="m", path="/m", format="onnx")) == [
        "models.m.format: 'onnx' is not one of gguf, safetensors"
    ]
    assert validate_model(Model(name="m", path="/models/m/", format="gguf")) == [
        "models.m.path: a gguf model is one .gguf file, and '/models/m/' is not one"
    ]


def test_profiles_come_from_plain_configuration():
    raw = {
        "name": "chat",
        "model": "llama-3-70b",
        "engine": "vllm",
        "gpu_class": "l40s-45g",
        "gpus_per_node": 2,
        "tensor_parallel": 2,
        "memory_mib": 20000,
        "flags": ["--enforce-eager"],
        "adapters": [{"name": "sql", "path": "/adapters/sql"}],
    }
    profile = cattrs.structure(raw, Profile)
    assert profile.flags == ("--enforce-eager",)
    assert profile.adapters == (Adapter(name="sql", path="/adapters/sql"),)
    assert cattrs.structure(cattrs.unstructure(profile), Profile) == profile


# --- placement: examples ----------------------------------------------------------------------------


def test_picks_the_lowest_gpu_indices_that_fit():
    view = ClusterView(nodes=(node("node-1", gpus=(gpu(0, allocated=True), gpu(1), gpu(2), gpu(3))),))
    assert placed(place(view, gpu_profile(), PORTS)).shards == (
        ShardPlacement(node="node-1", rank=0, gpu_indices=(1, 2), port=20000),
    )


def test_every_reason_text():
    view = ClusterView(
        nodes=(
            node("node-2", gpus=4, gpu_class="h100-80g"),
            node("node-3", gpus=(gpu(0), gpu(1), gpu(2, allocated=True), gpu(3, allocated=True))),
            node(
                "node-4", gpus=(gpu(0, free=10_240), gpu(1), gpu(2, allocated=True), gpu(3, allocated=True))
            ),
            node(
                "node-5",
                gpus=(gpu(0, allocated=True), gpu(1, healthy=False, problems=("ecc-uncorrected",)), gpu(2)),
            ),
            node(
                "node-6",
                gpus=(gpu(0, healthy=False, problems=("foreign-memory",)), gpu(1, healthy=False), gpu(2)),
            ),
            node("node-7", gpus=4, online=False),
            node("node-8", gpus=4, ports_in_use=frozenset(range(20000, 30000))),
            node("node-9", gpus=4, connected=False),
        )
    )
    assert reasons(place(view, gpu_profile(gpus_per_node=3, tensor_parallel=3), PORTS)) == {
        "node-2": "no l40s-45g GPUs",
        "node-3": "2 free l40s-45g, needs 3",
        "node-4": "1 free l40s-45g, needs 3",
        "node-5": "1 free l40s-45g, needs 3",
        "node-6": "GPU 0 holds memory of a process llmgw did not start; GPU 1 is marked unhealthy",
        "node-7": "offline",
        "node-8": "no free port in 20000-29999",
        "node-9": "its agent is not connected (restarting?)",
    }
    without_node_3 = ClusterView(nodes=tuple(n for n in view.nodes if n.name != "node-3"))
    two = reasons(place(without_node_3, gpu_profile(), PORTS))
    assert two["node-4"] == "GPU 0 has 10,240 MiB free, needs 20,000"
    assert two["node-5"] == "GPU 1 has uncorrected ECC errors"


def test_cpu_reason_texts():
    view = ClusterView(
        nodes=(
            node("node-1", memory_free_mib=1_024),
            node("node-2", cpu_cores_free=2),
            node("node-3", memory_free_mib=1_024, cpu_cores_free=1),
            node("node-4", ports_in_use=frozenset(range(20000, 29999))),
        )
    )
    assert reasons(place(view, cpu_profile(launcher="ray"), PORTS)) == {
        "node-1": "1,024 MiB free memory, needs 4,096",
        "node-2": "2 free cores, needs 4",
        "node-3": "1,024 MiB free memory, needs 4,096; 1 free core, needs 4",
        # A Ray head needs its rendezvous port beside the engine's.
        "node-4": "1 free port in 20000-29999, needs 2",
    }


def test_unplaceable_lists_nodes_in_view_order_with_a_summary():
    view = ClusterView(nodes=(node("b", online=False), node("a", gpus=1), node("c", online=False)))
    result = place(view, gpu_profile(name="chat-fast"), PORTS)
    assert isinstance(result, Unplaceable)
    assert [name for name, _ in result.reasons] == ["b", "a", "c"]
    assert result.summary == (
        "profile chat-fast (2 × l40s-45g with 20,000 MiB free each on one node) fits none of 3 nodes: "
        "offline (2 nodes); 1 free l40s-45g, needs 2 (1 node)"
    )
    assert place(ClusterView(), cpu_profile(), PORTS).summary == (
        "profile tiny (4,096 MiB and 4 cores on the CPU on one node) fits none of 0 nodes"
    )


def test_pack_fills_the_fullest_node_and_spread_the_emptiest():
    view = ClusterView(
        nodes=(
            node("node-1", gpus=8),
            node("node-2", gpus=(gpu(0, allocated=True), *(gpu(i) for i in range(1, 8)))),
            node("node-3", gpus=4),
            node("node-4", gpus=8),
        )
    )
    assert placed(place(view, gpu_profile(), PORTS)).shards[0].node == "node-3"
    # Equal room: the name decides.
    assert placed(place(view, gpu_profile(spread=True), PORTS)).shards[0].node == "node-1"


def test_pack_on_the_cpu_takes_the_node_with_the_least_memory_that_fits():
    view = ClusterView(nodes=(node("a", memory_free_mib=64_000), node("b", memory_free_mib=8_000)))
    assert placed(place(view, cpu_profile(), PORTS)).shards == (ShardPlacement(node="b", rank=0, port=20000),)
    assert placed(place(view, cpu_profile(spread=True), PORTS)).shards[0].node == "a"


def test_a_multi_node_replica_stays_in_one_fabric():
    view = ClusterView(
        nodes=(
            node("node-1", gpus=2, fabric="ib-a"),
            node("node-2", gpus=2, fabric="ib-b"),
            node("node-3", gpus=2, fabric="ib-b"),
            node("node-4", gpus=2),
            node("node-5", gpus=2, fabric="ib-a", ports_in_use=frozenset({20000})),
        )
    )
    profile = gpu_profile(nodes=2, tensor_parallel=4)
    shards = placed(place(view, profile, PORTS)).shards
    # Both fabrics have two nodes that fit with nothing left: the fabric name decides.
    assert [s.node for s in shards] == ["node-1", "node-5"]
    assert [s.rank for s in shards] == [0, 1]
    assert [s.port for s in shards] == [20000, 20001]
    # The rendezvous is on the leader, and every rank knows it.
    assert [s.rendezvous_port for s in shards] == [20001, 20001]


def test_a_multi_node_replica_that_no_fabric_holds_says_why_for_every_node():
    view = ClusterView(
        nodes=(
            node("node-1", gpus=2, fabric="ib-a"),
            node("node-2", gpus=2, fabric="ib-b"),
            node("node-3", gpus=2, fabric="ib-b", online=False),
            node("node-4", gpus=2),
        )
    )
    assert reasons(place(view, gpu_profile(nodes=2, tensor_parallel=4), PORTS)) == {
        "node-1": "fits, but fabric ib-a has 1 node that fit, needs 2",
        "node-2": "fits, but fabric ib-b has 1 node that fit, needs 2",
        "node-3": "offline",
        "node-4": "on no fabric (a single-node island), needs 2 nodes on one",
    }


def test_a_multi_node_replica_packs_into_the_fullest_fabric():
    view = ClusterView(
        nodes=(
            node("a-1", gpus=8, fabric="ib-a"),
            node("a-2", gpus=8, fabric="ib-a"),
            node("b-1", gpus=4, fabric="ib-b"),
            node("b-2", gpus=8, fabric="ib-b"),
            node("b-3", gpus=4, fabric="ib-b"),
        )
    )
    profile = gpu_profile(nodes=2, gpus_per_node=4, tensor_parallel=8)
    assert [s.node for s in placed(place(view, profile, PORTS)).shards] == ["b-1", "b-3"]
    spread = attrs.evolve(profile, spread=True)
    assert [s.node for s in placed(place(view, spread, PORTS)).shards] == ["a-1", "a-2"]


def test_ports_skip_those_in_use_and_a_single_node_mp_shard_has_no_rendezvous():
    view = ClusterView(nodes=(node("n-1", gpus=2, ports_in_use=frozenset({20000, 20001, 20003})),))
    assert placed(place(view, gpu_profile(), PORTS)).shards[0] == ShardPlacement(
        node="n-1", rank=0, gpu_indices=(0, 1), port=20002, rendezvous_port=0
    )
    ray = placed(place(view, gpu_profile(launcher="ray"), PORTS)).shards[0]
    assert (ray.port, ray.rendezvous_port) == (20002, 20004)


def test_the_same_view_gives_the_same_answer_whatever_its_node_order():
    nodes = [node(f"node-{i}", gpus=8, fabric=f"ib-{i % 3}") for i in range(12)]
    profile = gpu_profile(nodes=3, gpus_per_node=8, tensor_parallel=8, pipeline_parallel=3)
    first = place(ClusterView(nodes=tuple(nodes)), profile, PORTS)
    for seed in range(5):
        random.Random(seed).shuffle(nodes)
        assert place(ClusterView(nodes=tuple(nodes)), profile, PORTS) == first


def test_apply_holds_gpus_memory_cores_and_ports():
    view = ClusterView(nodes=(node("n-1", gpus=4), node("n-2")))
    placement = placed(place(view, gpu_profile(launcher="ray"), PORTS))
    after = apply(view, placement, gpu_profile(launcher="ray"))
    n1 = after.nodes[0]
    assert [(g.allocated, g.memory_free_mib) for g in n1.gpus] == [(True, 25_000)] * 2 + [(False, 45_000)] * 2
    assert n1.ports_in_use == {20000, 20001}
    assert after.nodes[1] == view.nodes[1]
    # Equal memory on both: the name decides, and the next free port on n-1 is taken.
    cpu = placed(place(after, cpu_profile(), PORTS))
    assert cpu.shards == (ShardPlacement(node="n-1", rank=0, port=20002),)
    n1 = apply(after, cpu, cpu_profile()).nodes[0]
    assert (n1.memory_free_mib, n1.cpu_cores_free, n1.ports_in_use) == (
        64_000 - 4_096,
        12,
        {20000, 20001, 20002},
    )


def test_shard_specs_carry_the_placement_and_the_profile_and_pass_launch_checks():
    view = ClusterView(
        nodes=(
            node("node-1", gpus=4, fabric="ib-a", rdma=IB, mgmt_interface="ens1"),
            node("node-2", gpus=4, fabric="ib-a", rdma=IB, mgmt_interface="ens2"),
        )
    )
    profile = gpu_profile(
        nodes=2,
        gpus_per_node=4,
        tensor_parallel=4,
        pipeline_parallel=2,
        flags=("--enforce-eager",),
        adapters=(Adapter(name="sql", path="/adapters/sql"),),
        ctx_size=8192,
        quantization="fp8",
    )
    placement = placed(place(view, profile, PORTS))
    specs = to_shard_specs(placement, profile, LLAMA, "r7", view)
    assert [s.shard_id for s in specs] == ["r7-s0", "r7-s1"]
    assert [(s.rank, s.node_address, s.mgmt_interface) for s in specs] == [
        (0, "10.0.0.1", "ens1"),
        (1, "10.0.0.2", "ens2"),
    ]
    assert {s.leader_address for s in specs} == {"10.0.0.1"}
    assert {s.rendezvous_port for s in specs} == {20001}
    assert specs[1].gpus[3].uuid == "GPU-l40s-45g-3"
    assert specs[0].fabric == IB
    assert (specs[0].model, specs[0].model_path, specs[0].extra_flags) == (
        "llama-3-70b",
        "/models/llama-3-70b",
        ("--enforce-eager",),
    )
    assert (specs[0].ctx_size, specs[0].quantization, specs[0].adapters) == (8192, "fp8", profile.adapters)
    assert [validate(s) for s in specs] == [[], []]


def test_single_node_and_cpu_specs_use_no_fabric_and_pass_launch_checks():
    view = ClusterView(nodes=(node("node-1", gpus=2, fabric="ib-a", rdma=IB),))
    single = to_shard_specs(placed(place(view, gpu_profile(), PORTS)), gpu_profile(), LLAMA, "r1", view)
    assert single[0].fabric == Fabric() and validate(single[0]) == []
    cpu = to_shard_specs(placed(place(view, cpu_profile(), PORTS)), cpu_profile(), SMOL, "r2", view)
    assert cpu[0].gpus == () and validate(cpu[0]) == []
    # The engine gets the cores placement counted for it; a GPU shard's threads are its own.
    assert (cpu[0].cpu_threads, single[0].cpu_threads) == (cpu_profile().cpu_cores, None)


def test_specs_carry_the_memory_reserved_on_each_card_and_the_cards_size():
    """What the engine needs to stay inside its reservation: the profile's memory_mib per GPU
    (what fit() found free and apply() took) and each card's own memory. A CPU shard has neither."""
    view = ClusterView(nodes=(node("node-1", gpus=2),))
    profile = gpu_profile(memory_mib=30_000)
    (shard,) = to_shard_specs(placed(place(view, profile, PORTS)), profile, LLAMA, "r1", view)
    assert shard.gpu_memory_mib == 30_000
    assert [g.memory_total_mib for g in shard.gpus] == [46_068, 46_068]
    # Told to vLLM as its share of the card, 30,000 of 46,068 MiB rounded down: 0.65 × 46,068 is
    # 29,944 MiB, inside the reservation.
    (engine,) = build_plan(shard, engine_key=None, binaries=EngineBinaries()).commands
    assert engine.argv[engine.argv.index("--gpu-memory-utilization") + 1] == "0.65"
    (cpu,) = to_shard_specs(placed(place(view, cpu_profile(), PORTS)), cpu_profile(), SMOL, "r2", view)
    assert cpu.gpu_memory_mib is None


# --- placement: properties ----------------------------------------------------------------------------

CLASSES = ("l40s-45g", "h100-80g")
# Most nodes and profiles share a class, so that multi-node placements happen often enough.
CLASS_MIX = ("h100-80g", "h100-80g", "h100-80g", "l40s-45g")
FABRICS = ("", "ib-a", "ib-a", "ib-a", "ib-b")
# A narrow range, so that running out of ports is as likely as running out of GPUs.
SMALL_PORTS = (100, 103)


@st.composite
def gpu_views(draw, index: int, node_class: str, calm: bool) -> GpuView:
    if calm:
        problems, allocated = (), draw(st.sampled_from([False] * 7 + [True]))
        memory_free = draw(st.sampled_from([40_000, 80_000]))
    else:
        problems = draw(st.sampled_from([()] * 6 + [("ecc-uncorrected",), ("foreign-memory",)]))
        allocated = draw(st.sampled_from([False, False, False, True]))
        memory_free = draw(st.sampled_from([0, 10_000, 20_000, 40_000, 80_000, 80_000]))
    return GpuView(
        index=index,
        uuid=f"GPU-{index}",
        # Nodes are mostly of one class, as fleets are; a stray card tests the class filter.
        gpu_class=draw(st.sampled_from([node_class] * 5 + list(CLASSES))),
        compute_capability="9.0",
        memory_total_mib=80_000,
        memory_free_mib=memory_free,
        allocated=allocated,
        healthy=not problems,
        problems=problems,
    )


@st.composite
def node_views(draw, name: str, main_class: str, calm: bool) -> NodeView:
    count = draw(st.integers(0, 8))
    node_class = draw(st.sampled_from([main_class] * 4 + list(CLASSES)))
    # Indices out of order: discovery lists them in order, placement must not rely on it.
    indices = draw(st.permutations(range(count)))
    return NodeView(
        name=name,
        online=draw(st.sampled_from([True, True, True, True, False])),
        address=f"10.0.0.{name}",
        fabric=draw(st.sampled_from(FABRICS)),
        gpus=tuple(draw(gpu_views(i, node_class, calm)) for i in indices),
        memory_free_mib=draw(st.sampled_from([0, 2_048, 8_192, 65_536])),
        cpu_cores_free=draw(st.integers(0, 8)),
        ports_in_use=frozenset(
            draw(st.sets(st.integers(SMALL_PORTS[0] - 1, SMALL_PORTS[1] + 1), max_size=3))
        ),
    )


@st.composite
def clusters(draw) -> ClusterView:
    # A count drawn evenly: lists of nodes would mostly be short, and multi-node placements rare.
    count = draw(st.integers(0, 12))
    names = draw(st.permutations([f"n{i}" for i in range(12)]))[:count]
    # A calm cluster has few busy or broken cards: multi-node requests find room there.
    calm = draw(st.booleans())
    main_class = draw(st.sampled_from(CLASS_MIX))
    return ClusterView(nodes=tuple(draw(node_views(name, main_class, calm)) for name in names))


@st.composite
def profiles(draw) -> Profile:
    spread = draw(st.booleans())
    launcher = draw(st.sampled_from(["mp", "mp", "ray"]))
    if draw(st.booleans()):
        return cpu_profile(
            memory_mib=draw(st.sampled_from([1_024, 4_096, 16_384])),
            cpu_cores=draw(st.integers(1, 6)),
            spread=spread,
            launcher=launcher,
        )
    nodes = draw(st.sampled_from([1, 1, 2, 3]))
    per_node = draw(st.integers(1, 4))
    return gpu_profile(
        gpu_class=draw(st.sampled_from(CLASS_MIX)),
        gpus_per_node=per_node,
        nodes=nodes,
        tensor_parallel=per_node * nodes,
        memory_mib=draw(st.sampled_from([5_000, 20_000, 40_000, 90_000])),
        spread=spread,
        launcher=launcher,
    )


def usable(gpu: GpuView, profile: Profile) -> bool:
    return (
        gpu.gpu_class == profile.gpu_class
        and gpu.healthy
        and not gpu.allocated
        and gpu.memory_free_mib >= profile.memory_mib
    )


def can_host(view: NodeView, profile: Profile) -> bool:
    """Brute force, written apart from placement: some set of this node's GPUs would do."""
    ports_needed = 2 if profile.nodes > 1 or profile.launcher == "ray" else 1
    free_ports = [p for p in range(SMALL_PORTS[0], SMALL_PORTS[1] + 1) if p not in view.ports_in_use]
    if not view.online or len(free_ports) < ports_needed:
        return False
    if profile.gpu_class is None:
        return view.memory_free_mib >= profile.memory_mib and view.cpu_cores_free >= profile.cpu_cores
    combos = itertools.combinations(view.gpus, profile.gpus_per_node)
    return any(all(usable(g, profile) for g in combo) for combo in combos)


def feasible(cluster: ClusterView, profile: Profile) -> bool:
    hosts = [n for n in cluster.nodes if can_host(n, profile)]
    if profile.nodes == 1:
        return bool(hosts)
    per_fabric = collections.Counter(n.fabric for n in hosts if n.fabric)
    return any(count >= profile.nodes for count in per_fabric.values())


def check_placement(cluster: ClusterView, profile: Profile, placement: Placement) -> None:
    """Everything a placement promises, against the view it was made on."""
    nodes = {n.name: n for n in cluster.nodes}
    shards = placement.shards
    assert [s.rank for s in shards] == list(range(profile.nodes))
    assert len({s.node for s in shards}) == profile.nodes
    if profile.nodes > 1:
        assert len({nodes[s.node].fabric for s in shards}) == 1 and nodes[shards[0].node].fabric
    leader = nodes[shards[0].node]
    for shard in shards:
        view = nodes[shard.node]
        assert view.online
        assert SMALL_PORTS[0] <= shard.port <= SMALL_PORTS[1] and shard.port not in view.ports_in_use
        assert shard.rendezvous_port == shards[0].rendezvous_port
        gpus = {g.index: g for g in view.gpus}
        assert len(shard.gpu_indices) == len(set(shard.gpu_indices))
        if profile.gpu_class is None:
            assert shard.gpu_indices == ()
        else:
            assert len(shard.gpu_indices) == profile.gpus_per_node
            assert all(usable(gpus[i], profile) for i in shard.gpu_indices)
            # The lowest indices that would do.
            assert (
                list(shard.gpu_indices)
                == sorted(i for i in gpus if usable(gpus[i], profile))[: profile.gpus_per_node]
            )
    if profile.nodes > 1 or profile.launcher == "ray":
        rendezvous = shards[0].rendezvous_port
        assert rendezvous != shards[0].port and rendezvous not in leader.ports_in_use
        assert SMALL_PORTS[0] <= rendezvous <= SMALL_PORTS[1]
    else:
        assert shards[0].rendezvous_port == 0


@settings(max_examples=400, deadline=None)
@given(cluster=clusters(), profile=profiles())
def test_a_placement_exists_exactly_when_one_is_feasible(cluster, profile):
    result = place(cluster, profile, SMALL_PORTS)
    assert isinstance(result, Placement) == feasible(cluster, profile), result
    if isinstance(result, Placement):
        check_placement(cluster, profile, result)
    else:
        # Every node of the view exactly once, in its order, each with a reason.
        assert [name for name, _ in result.reasons] == [n.name for n in cluster.nodes]
        assert all(reason for _, reason in result.reasons)
        assert result.summary.startswith(f"profile {profile.name} (")


@settings(max_examples=200, deadline=None)
@given(cluster=clusters(), requests=st.lists(profiles(), min_size=1, max_size=8))
def test_placements_applied_in_turn_never_share_a_gpu_nor_oversubscribe(cluster, requests):
    given_out: set[tuple[str, int]] = set()
    ports: set[tuple[str, int]] = set()
    originally_free = {
        (n.name, g.index) for n in cluster.nodes for g in n.gpus if not g.allocated and g.healthy
    }
    view = cluster
    for profile in requests:
        result = place(view, profile, SMALL_PORTS)
        assert isinstance(result, Placement) == feasible(view, profile)
        if isinstance(result, Unplaceable):
            continue
        check_placement(view, profile, result)
        for shard in result.shards:
            for index in shard.gpu_indices:
                assert (shard.node, index) not in given_out
                given_out.add((shard.node, index))
            held = {shard.port} | (
                {shard.rendezvous_port} if shard.rank == 0 and shard.rendezvous_port else set()
            )
            assert not ports & {(shard.node, p) for p in held}
            ports |= {(shard.node, p) for p in held}
        view = apply(view, result, profile)
        for n in view.nodes:
            assert n.memory_free_mib >= 0 and n.cpu_cores_free >= 0
            assert all(g.memory_free_mib >= 0 for g in n.gpus)
    assert given_out <= originally_free


@settings(max_examples=100, deadline=None)
@given(cluster=clusters(), profile=profiles(), seed=st.integers(0, 2**32))
def test_node_order_never_changes_the_answer_beyond_reason_order(cluster, profile, seed):
    shuffled = list(cluster.nodes)
    random.Random(seed).shuffle(shuffled)
    first = place(cluster, profile, SMALL_PORTS)
    second = place(ClusterView(nodes=tuple(shuffled)), profile, SMALL_PORTS)
    if isinstance(first, Placement):
        assert second == first
    else:
        assert isinstance(second, Unplaceable) and sorted(second.reasons) == sorted(first.reasons)


def room_left(view: NodeView, profile: Profile) -> int:
    """What the score compares: free cards of the class left after the shard, or free MiB."""
    if profile.gpu_class is None:
        return view.memory_free_mib - profile.memory_mib
    free = sum(1 for g in view.gpus if g.gpu_class == profile.gpu_class and g.healthy and not g.allocated)
    return free - profile.gpus_per_node


@settings(max_examples=200, deadline=None)
@given(
    cluster=clusters(),
    profile=profiles().map(lambda p: attrs.evolve(p, nodes=1, tensor_parallel=p.gpus_per_node)),
)
def test_a_single_node_replica_goes_to_the_best_scored_host(cluster, profile):
    result = place(cluster, profile, SMALL_PORTS)
    hosts = [n for n in cluster.nodes if can_host(n, profile)]
    if not hosts:
        return
    sign = -1 if profile.spread else 1
    best = min(hosts, key=lambda n: (sign * room_left(n, profile), n.name))
    assert placed(result).shards[0].node == best.name
