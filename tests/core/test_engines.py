"""Engine adapters: shard spec → ordered commands, checked against golden files and the engines'
own help texts.

Regenerate the golden files after an intended change with
``LLMGW_REGEN_GOLDEN=1 .venv/bin/pytest tests/test_engines.py`` and review the diff; by default the
test compares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import cattrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.engines import EngineBinaries, InvalidShard, build_plan, registry, samples, validate
from llmgw.core.engines.common import listen_address
from llmgw.core.flags import ENGINE_ARGV_PREFIX, argv_flags, help_flags
from llmgw.core.shard import Adapter, Fabric, GpuRef, LaunchPlan, ShardSpec
from tests.helpers import TESTS

GOLDEN = TESTS / "golden" / "engines"
HELP = TESTS / "fixtures" / "engine-help"
HELP_FILES = {
    # vLLM's plain --help lists only its option groups; --help=all has the flags.
    "vllm": HELP / "vllm-0.33.0-serve-help.txt",
    "sglang": HELP / "sglang-0.5.23-launch_server-help.txt",
    "llamacpp": HELP / "llama-server-b11434-help.txt",
}
REGENERATE = os.environ.get("LLMGW_REGEN_GOLDEN") == "1"

KEY = "sk-engine-test-key-0123456789"
BINARIES = EngineBinaries()


# Each card's memory as NVML reports it.
H100_MIB, L40S_MIB, A100_MIB = 81559, 46068, 81920


def h100(index: int) -> GpuRef:
    return GpuRef(
        index=index,
        uuid=f"GPU-h100-{index}",
        gpu_class="h100-80g",
        compute_capability="9.0",
        memory_total_mib=H100_MIB,
    )


def l40s(index: int) -> GpuRef:
    return GpuRef(
        index=index,
        uuid=f"GPU-l40s-{index}",
        gpu_class="l40s-45g",
        compute_capability="8.9",
        memory_total_mib=L40S_MIB,
    )


def a100(index: int) -> GpuRef:
    return GpuRef(
        index=index,
        uuid=f"GPU-a100-{index}",
        gpu_class="a100-80g",
        compute_capability="8.0",
        memory_total_mib=A100_MIB,
    )


IB = Fabric(kind="ib", hcas=("mlx5_0", "mlx5_1"))
ROCE = Fabric(kind="roce", hcas=("mlx5_2",), gid_index=3)

BASE = ShardSpec(
    shard_id="r1-s0",
    replica_id="r1",
    model="llama-3-8b",
    model_path="/models/llama-3-8b",
    engine="vllm",
    gpus=(h100(0),),
    node_address="10.0.0.1",
    mgmt_interface="eth0",
    port=8100,
)


def spec(**changes: object) -> ShardSpec:
    return attrs.evolve(BASE, **changes)


def two_nodes(rank: int, **changes: object) -> ShardSpec:
    """Rank ``rank`` of a replica on 10.0.0.1 (leader) and 10.0.0.2; interface names differ."""
    multi_node = {
        "nodes": 2,
        "rank": rank,
        "leader_address": "10.0.0.1",
        "node_address": f"10.0.0.{rank + 1}",
        "mgmt_interface": ("eth0", "ens5")[rank],
        "rendezvous_port": 29500,
    }
    return spec(**{**multi_node, **changes})


LLAMA = {"engine": "llamacpp", "model": "smollm2", "model_path": "/models/smollm2.Q4_1.gguf"}
ADAPTERS = (Adapter(name="support-bot", path="/adapters/support"), Adapter(name="sql", path="/adapters/sql"))

CASES: dict[str, tuple[ShardSpec, str | None]] = {
    "llamacpp-cpu": (
        spec(**LLAMA, gpus=(), ctx_size=4096, parallel=2, cpu_threads=2, mgmt_interface=""),
        KEY,
    ),
    "llamacpp-gpu-adapters": (
        spec(
            **LLAMA,
            gpus=(l40s(1),),
            adapters=(
                Adapter(name="support-bot", path="/adapters/support.gguf"),
                Adapter(name="sql", path="/adapters/sql.gguf"),
            ),
            extra_flags=("--threads", "8"),
        ),
        KEY,
    ),
    "vllm-single-gpu": (
        spec(extra_flags=("--gpu-memory-utilization", "0.85"), quantization="fp8", parallel=32),
        KEY,
    ),
    "vllm-tp2": (
        spec(
            gpus=(h100(2), h100(3)),
            tensor_parallel=2,
            ctx_size=8192,
            dtype="bfloat16",
            adapters=ADAPTERS,
            gpu_memory_mib=40000,
        ),
        KEY,
    ),
    "vllm-mp-rank0": (
        two_nodes(
            0,
            gpus=(h100(0), h100(1)),
            tensor_parallel=2,
            pipeline_parallel=2,
            fabric=IB,
            gpu_memory_mib=H100_MIB,
        ),
        KEY,
    ),
    "vllm-mp-rank1": (
        two_nodes(
            1,
            gpus=(h100(0), h100(1)),
            tensor_parallel=2,
            pipeline_parallel=2,
            fabric=IB,
            gpu_memory_mib=H100_MIB,
        ),
        KEY,
    ),
    "vllm-ray-leader": (
        two_nodes(0, launcher="ray", tensor_parallel=2, fabric=ROCE, gpu_memory_mib=60000),
        KEY,
    ),
    "vllm-ray-worker": (
        two_nodes(1, launcher="ray", tensor_parallel=2, fabric=ROCE, gpu_memory_mib=60000),
        KEY,
    ),
    "sglang-single": (
        spec(
            engine="sglang",
            quantization="fp8",
            dtype="bfloat16",
            ctx_size=32768,
            parallel=64,
            gpu_memory_mib=40000,
        ),
        KEY,
    ),
    "sglang-rank0": (
        two_nodes(
            0,
            engine="sglang",
            gpus=(h100(0), h100(1)),
            tensor_parallel=2,
            pipeline_parallel=2,
            adapters=ADAPTERS,
            gpu_memory_mib=70000,
        ),
        KEY,
    ),
    "sglang-rank1": (
        two_nodes(
            1,
            engine="sglang",
            gpus=(h100(0), h100(1)),
            tensor_parallel=2,
            pipeline_parallel=2,
            adapters=ADAPTERS,
            gpu_memory_mib=70000,
        ),
        KEY,
    ),
}


def plan_of(case: str) -> LaunchPlan:
    shard, key = CASES[case]
    return build_plan(shard, engine_key=key, binaries=BINARIES)


def as_golden(engine: str, plan: LaunchPlan) -> dict:
    return {
        "engine": engine,
        "health_port": plan.health_port,
        "commands": [
            {
                "name": c.name,
                "argv": list(c.argv),
                "env": dict(sorted(c.env.items())),
                "waits_for_leader": c.waits_for_leader,
                "serves_http": c.serves_http,
            }
            for c in plan.commands
        ],
    }


# --- golden files --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_matches_golden(case: str) -> None:
    path = GOLDEN / f"{case}.json"
    actual = as_golden(CASES[case][0].engine, plan_of(case))
    if REGENERATE:
        path.write_text(json.dumps(actual, indent=2) + "\n")
    assert path.exists(), f"{path} missing: run with LLMGW_REGEN_GOLDEN=1 and review it"
    assert actual == json.loads(path.read_text())


def test_every_golden_file_has_a_case() -> None:
    # A stale golden file would still be checked against the help texts below and mislead.
    assert sorted(p.stem for p in GOLDEN.glob("*.json")) == sorted(CASES)


# --- flags against the engines' help texts --------------------------------------------------------

# help_flags (in llmgw.core.flags, shared with `ctl engine-check`) reads the options a help defines.


@pytest.fixture(scope="module")
def engine_flags() -> dict[str, frozenset[str]]:
    return {engine: help_flags(path.read_text()) for engine, path in HELP_FILES.items()}


def test_help_flags_match_at_word_boundaries(engine_flags: dict[str, frozenset[str]]) -> None:
    assert help_flags("  --port-range PORT_RANGE   ports to use") == {"--port-range"}
    assert help_flags("-ngl,  --gpu-layers, --n-gpu-layers N   layers") == {
        "-ngl",
        "--gpu-layers",
        "--n-gpu-layers",
    }
    assert help_flags("  --nnodes NNODES, -n NNODES\n      num of nodes; see --foo") == {"--nnodes", "-n"}
    # The facts the builders rely on, as the engines state them.
    assert "--tp" not in engine_flags["sglang"] and "--tp-size" in engine_flags["sglang"]
    assert {"--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless"} <= engine_flags["vllm"]
    assert "-ngl" in engine_flags["llamacpp"] and "--metrics" in engine_flags["llamacpp"]


def test_plain_vllm_help_would_miss_every_flag() -> None:
    plain = help_flags((HELP / "vllm-0.33.0-serve-help-plain.txt").read_text())
    assert not {"--tensor-parallel-size", "--port", "--served-model-name"} & plain


def golden_files() -> list[Path]:
    return sorted(GOLDEN.glob("*.json"))


@pytest.mark.parametrize("path", golden_files(), ids=lambda p: p.stem)
def test_every_golden_flag_is_in_the_engine_help(path: Path, engine_flags: dict[str, frozenset[str]]) -> None:
    golden = json.loads(path.read_text())
    engine = golden["engine"]
    # `ray start` (a Ray worker's only command) has no captured help text to check against.
    for command in (c for c in golden["commands"] if c["name"] == "engine"):
        options = argv_flags(command["argv"][ENGINE_ARGV_PREFIX[engine] :])
        assert options, f"{path.name}: no flags found in {command['argv']}"
        unknown = [flag for flag in options if flag not in engine_flags[engine]]
        assert not unknown, f"{path.name}: not in {HELP_FILES[engine].name}: {unknown}"


# --- keys ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(c for c in CASES if not c.startswith("sglang")))
def test_vllm_and_llamacpp_keys_only_in_environment(case: str) -> None:
    plan = plan_of(case)
    for command in plan.commands:
        assert not any(KEY in token for token in command.argv)
    key_vars = {"vllm": "VLLM_API_KEY", "llamacpp": "LLAMA_API_KEY"}[CASES[case][0].engine]
    holders = [c.name for c in plan.commands if c.env.get(key_vars) == KEY]
    # Only the process that serves HTTP checks a key; headless ranks and Ray nodes get none.
    assert holders == [c.name for c in plan.commands if c.serves_http]


def test_sglang_key_in_the_environment_of_the_serving_rank_only_never_on_argv() -> None:
    (leader,) = plan_of("sglang-rank0").commands
    assert leader.env["LLMGW_ENGINE_KEY"] == KEY
    (worker,) = plan_of("sglang-rank1").commands
    assert "LLMGW_ENGINE_KEY" not in worker.env
    assert not any(KEY in token for token in (*leader.argv, *worker.argv))


def test_the_sglang_launch_program_hands_the_key_to_the_server_off_its_command_line(tmp_path) -> None:
    """The program run for real, with a stand-in `sglang.launch_server` that writes what it got:
    the key last in its sys.argv, nowhere in its /proc cmdline, gone from its environment."""
    package = tmp_path / "sglang"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(
        "import json, os, sys\n"
        "cmdline = open('/proc/self/cmdline', 'rb').read().decode()\n"
        "json.dump({'argv': sys.argv[1:], 'cmdline': cmdline, 'env': 'LLMGW_ENGINE_KEY' in os.environ,"
        " 'main': __name__}, sys.stdout)\n"
    )
    (command,) = plan_of("sglang-single").commands
    argv = [sys.executable, *command.argv[1:]]
    done = subprocess.run(
        argv, env={**command.env, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["argv"] == [*command.argv[3:], "--api-key", KEY] and seen["main"] == "__main__"
    assert KEY not in seen["cmdline"] and not seen["env"]


def test_a_pinned_vllm_serves_behind_the_key_guard_in_its_own_python_and_a_headless_rank_does_not():
    """vLLM's own key covers /v1 alone: a pinned install's server runs by module, behind llmgw's
    guard (real vLLM: tests/e2e/test_vllm_cpu.py). The headless rank serves no HTTP; an unpinned
    `vllm` is the operator's, whose Python is unknown."""
    binaries = EngineBinaries(vllm="/env/bin/vllm", python="/env/bin/python")
    for rank, launcher, guarded in ((0, "mp", True), (1, "mp", False), (0, "ray", True)):
        shard = samples.two_nodes("vllm", rank, launcher=launcher, engine_version="0.33.0")
        engine = next(
            c for c in build_plan(shard, engine_key="k", binaries=binaries).commands if c.name == "engine"
        )
        if guarded:
            assert engine.argv[:2] == ("/env/bin/python", "-c") and engine.argv[3:5] == (
                "--model",
                shard.model_path,
            )
            assert engine.argv[-2:] == ("--middleware", "llmgw_engine_guard.RequireKey")
        else:
            assert engine.argv[:2] == ("/env/bin/vllm", "serve") and "--middleware" not in engine.argv
    (unpinned,) = build_plan(spec(), engine_key="k", binaries=binaries).commands
    assert unpinned.argv[:2] == ("/env/bin/vllm", "serve")


def test_no_key_no_key_anywhere() -> None:
    for engine in ("vllm", "sglang"):
        (command,) = build_plan(spec(engine=engine), engine_key=None, binaries=BINARIES).commands
        assert "--api-key" not in command.argv and "VLLM_API_KEY" not in command.env


@pytest.mark.parametrize(
    "shard",
    [spec(), spec(engine="sglang"), spec(**LLAMA)],
    ids=["vllm", "sglang", "llamacpp"],
)
def test_engines_listen_on_the_nodes_management_address_alone(shard: ShardSpec) -> None:
    """Where the router, the scraper and the agent's probes reach the engine; loopback on a node
    with no management address; never every address of the node."""
    for node_address, host in (("10.0.0.7", "10.0.0.7"), ("", "127.0.0.1")):
        (command,) = build_plan(
            attrs.evolve(shard, node_address=node_address), engine_key="k", binaries=BINARIES
        ).commands
        argv = list(command.argv)
        assert argv[len(argv) - argv[::-1].index("--host")] == host
        assert "0.0.0.0" not in argv


# --- argv order --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shard",
    [spec(), spec(engine="sglang"), spec(**LLAMA)],
    ids=["vllm", "sglang", "llamacpp"],
)
def test_builtins_come_after_extra_flags_and_win(shard: ShardSpec) -> None:
    extra = ("--port", "1", "--host", "127.0.0.1")
    (command,) = build_plan(
        attrs.evolve(shard, extra_flags=extra), engine_key=None, binaries=BINARIES
    ).commands
    argv = list(command.argv)
    start = argv.index("--port")
    assert tuple(argv[start : start + len(extra)]) == extra
    # argparse (and llama.cpp) keep the last value given.
    last_port = len(argv) - 1 - argv[::-1].index("--port")
    assert last_port > start + len(extra) - 1 and argv[last_port + 1] == "8100"
    last_host = len(argv) - 1 - argv[::-1].index("--host")
    assert argv[last_host + 1] == listen_address(shard) != "0.0.0.0"


# --- shapes of the plans ---------------------------------------------------------------------------


def test_ray_worker_runs_only_the_join_and_waits_for_the_head() -> None:
    plan = plan_of("vllm-ray-worker")
    (worker,) = plan.commands
    assert worker.name == "ray-worker" and worker.waits_for_leader and not worker.serves_http
    assert worker.argv[:4] == ("ray", "start", "--address", "10.0.0.1:29500")
    assert plan.health_port is None


def test_ray_leader_runs_head_then_engine_pointed_at_it() -> None:
    plan = plan_of("vllm-ray-leader")
    assert [c.name for c in plan.commands] == ["ray-head", "engine"]
    head, engine = plan.commands
    assert not head.waits_for_leader and "--head" in head.argv
    assert engine.waits_for_leader and engine.serves_http
    assert engine.env["RAY_ADDRESS"] == "10.0.0.1:29500"
    assert engine.argv[-2:] == ("--distributed-executor-backend", "ray")
    assert plan.health_port == 8100


def test_mp_rank1_is_headless_with_its_own_address() -> None:
    plan = plan_of("vllm-mp-rank1")
    (engine,) = plan.commands
    assert "--headless" in engine.argv and not engine.serves_http and plan.health_port is None
    assert engine.argv[engine.argv.index("--node-rank") + 1] == "1"
    assert engine.argv[engine.argv.index("--master-addr") + 1] == "10.0.0.1"
    # Its own address and interface, not the leader's.
    assert engine.env["VLLM_HOST_IP"] == "10.0.0.2"
    assert engine.env["NCCL_SOCKET_IFNAME"] == "=ens5" and engine.env["GLOO_SOCKET_IFNAME"] == "ens5"


def test_collectives_use_only_the_chosen_fabric() -> None:
    (ib,) = plan_of("vllm-mp-rank0").commands
    assert ib.env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"
    assert "NCCL_IB_GID_INDEX" not in ib.env and "NCCL_IB_DISABLE" not in ib.env
    roce = plan_of("vllm-ray-worker").commands[0]
    assert roce.env["NCCL_IB_HCA"] == "=mlx5_2" and roce.env["NCCL_IB_GID_INDEX"] == "3"
    (none,) = plan_of("sglang-rank0").commands
    assert none.env["NCCL_IB_DISABLE"] == "1" and "NCCL_IB_HCA" not in none.env


def test_a_single_gpu_shard_has_no_collective_settings() -> None:
    (engine,) = plan_of("vllm-single-gpu").commands
    assert not [name for name in engine.env if name.startswith(("NCCL_", "GLOO_"))]
    assert engine.env["CUDA_VISIBLE_DEVICES"] == "0" and engine.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_cpu_shard_hides_every_gpu() -> None:
    (engine,) = plan_of("llamacpp-cpu").commands
    assert engine.env["CUDA_VISIBLE_DEVICES"] == ""
    assert engine.argv[engine.argv.index("-ngl") + 1] == "0"


def test_a_cpu_shard_runs_on_the_cores_placement_reserved() -> None:
    """Two replicas on one node must not each take every core: --threads is the profile's
    cpu_cores. A GPU shard keeps llama.cpp's default (its host threads only feed the GPU)."""
    (engine,) = plan_of("llamacpp-cpu").commands
    assert engine.argv[engine.argv.index("--threads") + 1] == "2"
    (gpu,) = plan_of("llamacpp-gpu-adapters").commands
    assert gpu.argv.count("--threads") == 1  # only the profile's own extra flag


def flag_value(plan: LaunchPlan, flag: str) -> str | None:
    """The value the engine command ends up with for ``flag`` (argparse keeps the last one)."""
    (engine,) = (c for c in plan.commands if c.name == "engine")
    values = [engine.argv[i + 1] for i, token in enumerate(engine.argv) if token == flag]
    return values[-1] if values else None


def test_vllm_is_told_the_share_of_each_card_placement_reserved() -> None:
    """40,000 of 81,559 MiB is 0.4904: vLLM gets 0.49, rounded down so that it stays inside the
    reservation and a neighbour on the rest of the card has what placement promised it."""
    assert flag_value(plan_of("vllm-tp2"), "--gpu-memory-utilization") == "0.49"
    # A profile reserving the whole card runs as vLLM's default would: 0.92, not 1.00.
    assert flag_value(plan_of("vllm-mp-rank0"), "--gpu-memory-utilization") == "0.92"
    # Every rank of a multi-node replica allocates on its own cards, the headless one too.
    assert flag_value(plan_of("vllm-mp-rank1"), "--gpu-memory-utilization") == "0.92"
    # A profile's own value comes first on the command line, and the reservation's wins.
    reserved = spec(extra_flags=("--gpu-memory-utilization", "0.95"), gpu_memory_mib=20000)
    assert flag_value(
        build_plan(reserved, engine_key=KEY, binaries=BINARIES), "--gpu-memory-utilization"
    ) == ("0.24")


def test_sglang_static_pool_leaves_room_for_its_activations_inside_the_reservation() -> None:
    """--mem-fraction-static covers weights and KV only; 17 hundredths of the card are kept for
    activations and CUDA graphs, so 40,000 of 81,559 MiB (0.49) gives a static pool of 0.32."""
    assert flag_value(plan_of("sglang-single"), "--mem-fraction-static") == "0.32"
    assert flag_value(plan_of("sglang-rank1"), "--mem-fraction-static") == "0.68"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_no_reservation_known_leaves_the_engine_its_default(engine: str) -> None:
    flag = {"vllm": "--gpu-memory-utilization", "sglang": "--mem-fraction-static"}[engine]
    # A spec from before the reservation was sent, and one whose cards' memory is unknown.
    unknown_card = GpuRef(index=0, uuid="GPU-0", gpu_class="h100-80g", compute_capability="9.0")
    for shard in (spec(engine=engine), spec(engine=engine, gpus=(unknown_card,), gpu_memory_mib=40000)):
        assert flag_value(build_plan(shard, engine_key=KEY, binaries=BINARIES), flag) is None


@given(card_mib=st.integers(8000, 200_000), data=st.data())
def test_the_engines_stay_inside_the_reservation(card_mib: int, data: st.DataObject) -> None:
    """Whatever the card and the reservation: vLLM's budget, and SGLang's static pool plus what
    it keeps beside it, are at most what placement reserved."""
    reserved = data.draw(st.integers(card_mib // 4, card_mib))
    card = attrs.evolve(h100(0), memory_total_mib=card_mib)
    vllm = spec(gpus=(card,), gpu_memory_mib=reserved)
    share = hundredths(vllm, "--gpu-memory-utilization")
    assert 0 < share <= 92 and share * card_mib <= reserved * 100
    static = hundredths(attrs.evolve(vllm, engine="sglang"), "--mem-fraction-static")
    assert 0 < static and (static + 17) * card_mib <= reserved * 100


def hundredths(shard: ShardSpec, flag: str) -> int:
    # As the flags are written, so that the comparisons are exact where floats would round.
    value = flag_value(build_plan(shard, engine_key=KEY, binaries=BINARIES), flag)
    assert value is not None
    return round(float(value) * 100)


def test_spec_round_trips_through_cattrs_and_json() -> None:
    shard = CASES["vllm-ray-leader"][0]
    converter = cattrs.Converter()
    data = json.loads(json.dumps(converter.unstructure(shard)))
    assert converter.structure(data, ShardSpec) == shard


# --- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shard", "reason"),
    [
        (spec(engine="tgi"), "engine 'tgi' is not one of vllm, sglang, llamacpp"),
        (spec(gpus=(h100(0), a100(1)), tensor_parallel=2), "mixes a100-80g, h100-80g"),
        (
            two_nodes(0, tensor_parallel=4),
            "tensor parallelism 4 × pipeline 1 needs 4 GPUs, this shard spans 2 nodes × 1 GPU",
        ),
        (
            spec(gpus=(a100(0),), quantization="fp8"),
            "quantization 'fp8': fp8 needs compute capability 8.9 or newer, and GPU 0 (a100-80g) is 8.0",
        ),
        (spec(gpus=(a100(0),), engine="sglang", quantization="w8a8_fp8"), "needs compute capability 8.9"),
        (spec(dtype="fp8"), "dtype 'fp8' is not a --dtype choice of vLLM"),
        (attrs.evolve(two_nodes(1), rank=2), "rank 2 is outside 0..1 for a 2-node shard"),
        (two_nodes(1, leader_address=""), "a 2-node shard needs leader_address, which is empty"),
        (two_nodes(1, rendezvous_port=0), "a 2-node shard needs a rendezvous_port on the leader, not 0"),
        (two_nodes(0, mgmt_interface=""), "a 2-node shard needs mgmt_interface"),
        (spec(launcher="ray"), "a Ray-launched shard needs leader_address"),
        (spec(launcher="ray", engine="sglang"), "launcher 'ray' is for vLLM only"),
        (spec(launcher="slurm"), "launcher 'slurm' is not one of mp, ray"),
        (two_nodes(0, **LLAMA, tensor_parallel=2), "llama.cpp runs on one node, and this shard spans 2"),
        (spec(**{**LLAMA, "model_path": "/models/llama-3-8b"}), "llama.cpp loads a .gguf file"),
        (spec(**LLAMA, quantization="q4_0"), "llama.cpp takes its quantization from the GGUF file"),
        (spec(**LLAMA, adapters=(Adapter(name="a", path="/x,y.gguf"),)), "reads as two adapters"),
        (spec(gpus=(), engine_version="0.33.0"), "is vLLM's GPU build, and this shard has no GPUs"),
        (spec(gpus=(), engine_version="0.32.0-cpu", cpu_memory_mib=1024), "less than the 1 GiB of KV cache"),
        (
            spec(**LLAMA, gpus=(), tensor_parallel=2),
            "a CPU shard runs with tensor parallelism 1 × pipeline 1, not 2 × 1",
        ),
        (
            two_nodes(0, tensor_parallel=2, fabric=Fabric(kind="roce", hcas=("mlx5_0",))),
            "RoCE fabric needs the GID index",
        ),
        (two_nodes(0, tensor_parallel=2, fabric=Fabric(kind="ib")), "fabric 'ib' lists no adapters"),
        (spec(extra_flags=("--api-key", "mine")), "extra flag --api-key would replace the key"),
        (
            spec(**LLAMA, extra_flags=("--api-key-file=/k",)),
            "extra flag --api-key-file would replace the key",
        ),
        (spec(adapters=(ADAPTERS[0], ADAPTERS[0])), "adapter name 'support-bot' is given twice"),
        (spec(adapters=(Adapter(name="a=b", path="/p"),)), "holds '='"),
        (spec(port=0), "port 0 is not a TCP port"),
        (spec(gpu_memory_mib=500), "500 MiB reserved per GPU is under a hundredth of the 81,559 MiB card"),
        (spec(engine="sglang", gpu_memory_mib=10000), "leaves SGLang no static pool"),
    ],
)
def test_validation_refuses(shard: ShardSpec, reason: str) -> None:
    reasons = validate(shard)
    assert any(reason in r for r in reasons), reasons
    with pytest.raises(InvalidShard) as refused:
        build_plan(shard, engine_key=KEY, binaries=BINARIES)
    assert refused.value.reasons == tuple(reasons)


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_cases_are_valid(case: str) -> None:
    assert validate(CASES[case][0]) == []


def test_fp8_accepted_from_compute_capability_8_9() -> None:
    assert validate(spec(gpus=(l40s(0),), quantization="fp8")) == []


@given(
    engine=st.sampled_from(["vllm", "sglang"]),
    nodes=st.integers(1, 4),
    gpus_per_node=st.integers(1, 8),
    tp=st.integers(1, 16),
    pp=st.integers(1, 4),
)
def test_gpu_arithmetic_property(engine: str, nodes: int, gpus_per_node: int, tp: int, pp: int) -> None:
    shard = spec(
        engine=engine,
        nodes=nodes,
        leader_address="10.0.0.1",
        rendezvous_port=29500,
        gpus=tuple(h100(i) for i in range(gpus_per_node)),
        tensor_parallel=tp,
        pipeline_parallel=pp,
    )
    assert (validate(shard) == []) == (nodes * gpus_per_node == tp * pp)


def test_llamacpp_loads_its_adapters_unapplied() -> None:
    """With adapters, llama.cpp starts them at scale 0: a request for the base model gets the
    base model, and only the gateway's per-request list applies one."""
    (engine,) = plan_of("llamacpp-gpu-adapters").commands
    assert engine.argv.count("--lora") == 2
    assert "--lora-init-without-apply" in engine.argv
    (cpu,) = plan_of("llamacpp-cpu").commands
    assert "--lora-init-without-apply" not in cpu.argv  # no adapters, nothing to hold back


def test_llamacpp_selects_one_adapter_and_zeroes_the_others() -> None:
    select = registry.ENGINES["llamacpp"].select_adapter
    assert select(("support-bot", "sql", "x"), "sql") == {
        "lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}, {"id": 2, "scale": 0.0}]
    }
    # The base model: every adapter at 0, said explicitly.
    assert select(("support-bot", "sql"), None) == {
        "lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]
    }
    # vLLM and SGLang serve each adapter under its own name: the request's model selects it.
    assert registry.ENGINES["vllm"].select_adapter is None
    assert registry.ENGINES["sglang"].select_adapter is None


def test_vllms_cpu_build_runs_by_module_with_its_cache_and_threads_from_the_reservation() -> None:
    """What the real vllm-cpu 0.32.0 needed to serve (see llmgw.core.engines.vllm): the server
    by module (its console script fails), the KV cache in whole GiB from half the reserved memory,
    the reserved cores as its threads, unpinned; the key in the environment, not on argv."""
    cpu = spec(
        gpus=(),
        tensor_parallel=1,
        engine_version="0.32.0-cpu",
        cpu_threads=2,
        cpu_memory_mib=6144,
        dtype="float32",
        max_loaded_adapters=1,
        max_lora_rank=8,
    )
    (engine,) = build_plan(cpu, engine_key=KEY, binaries=BINARIES).commands
    assert engine.argv[:2] == (BINARIES.python, "-c") and engine.argv[3:5] == ("--model", cpu.model_path)
    assert "vllm.entrypoints.openai.api_server" in engine.argv[2]
    # vLLM checks its key under /v1 alone: a guard of every other path, by its --middleware hook.
    assert engine.argv[-2:] == ("--middleware", "llmgw_engine_guard.RequireKey")
    assert "--gpu-memory-utilization" not in engine.argv and KEY not in " ".join(engine.argv)
    assert engine.env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert engine.env["OMP_NUM_THREADS"] == "2" and engine.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert engine.env["CUDA_VISIBLE_DEVICES"] == "" and engine.env["VLLM_API_KEY"] == KEY
    assert engine.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # The least KV cache vLLM serves with: 1 GiB, however little was reserved above the minimum.
    small = attrs.evolve(cpu, cpu_memory_mib=2500)
    (engine,) = build_plan(small, engine_key=KEY, binaries=BINARIES).commands
    assert engine.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # A node's own vLLM (no pin) is started as `vllm serve`, on the CPU as on GPUs.
    (own,) = build_plan(attrs.evolve(cpu, engine_version=None), engine_key=KEY, binaries=BINARIES).commands
    assert own.argv[:3] == (BINARIES.vllm, "serve", cpu.model_path)


async def test_the_cpu_builds_key_guard_asks_for_the_key_on_every_path_but_health(monkeypatch) -> None:
    """GUARD_PROGRAM's middleware, run as an ASGI app in front of one that always answers 200
    (the real vLLM behind it is tests/e2e/test_vllm_cpu.py's)."""
    import sys

    from llmgw.core.engines import vllm

    assert f'types.ModuleType("{vllm.GUARD_MODULE}")' in vllm.GUARD_PROGRAM
    monkeypatch.setenv("VLLM_API_KEY", "sekrit")
    namespace: dict = {}
    # Everything but the last line, which would start vLLM.
    exec(vllm.GUARD_PROGRAM.replace("runpy.run_module(", "(lambda *a, **k: None)("), namespace)
    sys.modules.pop(vllm.GUARD_MODULE, None)  # the program registers it, for vLLM to import

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = namespace["RequireKey"](inner)

    async def status(path: str, authorization: str | None) -> int:
        headers = [] if authorization is None else [(b"authorization", authorization.encode())]
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        await guard({"type": "http", "path": path, "headers": headers}, None, send)
        return sent[0]["status"]

    for path in ("/v1/models", "/invocations", "/tokenize", "/pooling", "/metrics"):
        assert await status(path, None) == 401
        assert await status(path, "Bearer wrong") == 401
        assert await status(path, "Basic sekrit") == 401
        assert await status(path, "Bearer sekrit") == 200
    assert await status("/health", None) == 200
