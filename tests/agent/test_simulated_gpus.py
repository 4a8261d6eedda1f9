"""Simulated GPUs (agent.yaml's discovery.simulate): the file, strictly parsed; the inventory it
makes, shaped exactly as NVML discovery's; RDMA ports from its sysfs tree; NVML left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from llmgw.agent.discovery import discover
from llmgw.agent.discovery.infiniband import read_ib_ports
from llmgw.agent.discovery.nvml import MIB, gpu_memory_by_pid, read_gpus
from llmgw.agent.discovery.simulated import NvmlOff, read_simulated, simulated_gpus, simulated_uuid
from llmgw.cli import main
from llmgw.config import ConfigError, load_simulated_node, parse_simulated_node
from llmgw.ctl.inventory import render_inventory
from llmgw.wire.codec import converter, decode, encode
from llmgw.wire.messages import Heartbeat, Inventory
from tests.agent.test_discovery import fake_nvml, write_proc
from tests.helpers import TESTS

FIXTURES = TESTS / "fixtures"
SIMULATED = FIXTURES / "simulated"
SYSFS = FIXTURES / "sysfs"
H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "compute_capability": "9.0"}


def write_simulation(path: Path, gpus: list[dict], **top: Any) -> Path:
    path.write_text(yaml.safe_dump({"gpus": gpus, **top}))
    return path


class UntouchableNvml:
    """Fails the test on any use: a simulated node must not go near NVML."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"NVML was used: {name}")


# --- the file ----------------------------------------------------------------------------------


def test_two_h100_from_the_fixture() -> None:
    spec = load_simulated_node(SIMULATED / "h100-x2.yaml")
    first, second = simulated_gpus(spec, "node-a")
    assert (first.index, second.index) == (0, 1)
    assert first.gpu_class == second.gpu_class == "h100-80g"
    assert first.uuid == "GPU-sim-node-a-0" == simulated_uuid("node-a", 0)
    assert second.uuid == "GPU-a81c7e52-3f09-4d6a-b0e4-7c9d2f1e4001"
    assert (first.memory_total_mib, first.memory_used_mib) == (81559, 0)
    assert (second.memory_used_mib, second.memory_free_mib) == (1024, 80535)
    # Quoted or not, the compute capability reads the same.
    assert first.compute_capability == second.compute_capability == "9.0"
    assert first.healthy and second.healthy
    assert first.ecc_uncorrected == 0 and first.foreign_processes == ()


def test_made_up_uuids_are_stable_and_differ_between_nodes() -> None:
    spec = load_simulated_node(SIMULATED / "h100-x2.yaml")
    assert simulated_gpus(spec, "a") == simulated_gpus(spec, "a")
    assert simulated_gpus(spec, "a")[0].uuid != simulated_gpus(spec, "b")[0].uuid


def test_ecc_errors_make_a_gpu_unhealthy_and_minus_one_means_no_ecc(tmp_path: Path) -> None:
    path = write_simulation(
        tmp_path / "gpus.yaml",
        [{**H100, "ecc_errors": 3}, {**H100, "ecc_errors": -1}, {**H100, "ecc_errors": 0}],
    )
    bad, no_ecc, fine = simulated_gpus(load_simulated_node(path), "n")
    assert (bad.ecc_uncorrected, bad.problems) == (3, ("ecc-uncorrected",))
    assert (no_ecc.ecc_uncorrected, no_ecc.problems) == (-1, ())
    assert fine.problems == ()


@pytest.mark.parametrize(
    ("fixture", "own_pids", "indexes"),
    [
        # Eight idle H100, GPU 5 with uncorrected ECC errors.
        ("h100-x8-ecc.json", frozenset(), range(8)),
        # GPU 0's memory is held by an engine llmgw started; GPU 1's by a foreign process, which a
        # simulated GPU cannot have, so it is left out.
        ("l40s-x2.json", frozenset({4100}), range(1)),
    ],
)
def test_the_same_gpus_as_nvml_discovery_makes(
    tmp_path: Path, fixture: str, own_pids: frozenset[int], indexes: range
) -> None:
    machine = json.loads((FIXTURES / "nvml" / fixture).read_text())
    described = [
        {
            "name": gpu["name"],
            "memory_mib": gpu["memory_total"] // MIB,
            "compute_capability": "{}.{}".format(*gpu["cuda_compute_capability"]),
            "uuid": gpu["uuid"],
            "ecc_errors": gpu["ecc_uncorrected_volatile"],
            "used_mib": gpu["memory_used"] // MIB,
        }
        for gpu in (machine["gpus"][i] for i in indexes)
    ]
    simulated = simulated_gpus(load_simulated_node(write_simulation(tmp_path / "g.yaml", described)), "n")
    from_nvml, note = read_gpus(fake_nvml(fixture), own_pids)
    assert note == ""
    assert simulated == from_nvml[: len(indexes)]
    if fixture == "h100-x8-ecc.json":
        assert simulated[5].problems == ("ecc-uncorrected",)


def test_an_empty_list_is_a_node_without_gpus(tmp_path: Path, proc_root: Path) -> None:
    inv = discover(simulate=write_simulation(tmp_path / "g.yaml", []), node="n", proc_root=proc_root)
    assert (inv.gpus, inv.gpu_note, inv.simulated) == ((), "", True)
    console = Console(record=True, width=120)
    render_inventory(inv, console)
    assert "no GPUs (the simulation file lists none)" in console.export_text()


# --- errors name the file, the key and the problem -------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'gpus:\n  - {name: a, memory_mib: 1, compute_capability: "9.0"}\n'
            '  - {name: a, memory_mib: lots, compute_capability: "9.0"}\n',
            'gpus.yaml: gpus[1].memory_mib: expected an integer, got "lots"',
        ),
        (
            "gpus:\n  - {name: a, memory_mib: 0, compute_capability: 9.0}\n",
            "gpus.yaml: gpus[0].memory_mib: expected an integer >= 1, got 0",
        ),
        (
            "gpus:\n  - {name: a, memory_mib: 10.5, compute_capability: 9.0}\n",
            "gpus.yaml: gpus[0].memory_mib: expected an integer, got 10.5",
        ),
        (
            "gpus:\n  - {name: a, memory_mib: 10, compute_capability: 9}\n",
            'gpus.yaml: gpus[0].compute_capability: expected major.minor like "8.9", got 9',
        ),
        (
            "gpus:\n  - {name: a, memory_mib: 10, compute_capability: sm90}\n",
            'gpus.yaml: gpus[0].compute_capability: expected major.minor like "8.9", got "sm90"',
        ),
        (
            "gpus:\n  - {name: a, memory_mib: 10, compute_capability: 9.0, used_mib: 11}\n",
            "gpus.yaml: gpus[0].used_mib: expected an integer from 0 to memory_mib (10), got 11",
        ),
        (
            "gpus:\n  - {name: a, memory_mib: 10, compute_capability: 9.0, used_mib: -1}\n",
            "gpus.yaml: gpus[0].used_mib: expected an integer from 0 to memory_mib (10), got -1",
        ),
        (
            "gpus:\n  - {name: a, memory_mib: 10, compute_capability: 9.0, ecc_errors: -2}\n",
            "gpus.yaml: gpus[0].ecc_errors: expected an integer >= 0, or -1 for a GPU without ECC, got -2",
        ),
        (
            "gpus:\n  - {name: a, memory_mib: 10, compute_capability: 9.0, ecc_errors: true}\n",
            "gpus.yaml: gpus[0].ecc_errors: expected an integer, got true",
        ),
        (
            "gpus:\n  - {name: '', memory_mib: 10, compute_capability: 9.0}\n",
            'gpus.yaml: gpus[0].name: expected a product name like "NVIDIA L40S", got ""',
        ),
        (
            "gpus:\n  - {name: a, memory_mib: 10, compute_capability: 9.0, uuid: ''}\n",
            'gpus.yaml: gpus[0].uuid: expected a uuid, got ""',
        ),
        (
            "gpus:\n  - {name: a, memory_mib: 10, compute_capability: 9.0, uuid: GPU-x}\n"
            "  - {name: a, memory_mib: 10, compute_capability: 9.0}\n"
            "  - {name: a, memory_mib: 10, compute_capability: 9.0, uuid: GPU-x}\n",
            'gpus.yaml: gpus[2].uuid: "GPU-x" is already the uuid of gpus[0]',
        ),
        (
            "gpus:\n  - {name: a, compute_capability: 9.0}\n",
            "gpus.yaml: gpus[0].memory_mib: required option is missing",
        ),
        (
            "gpus:\n  - {name: a, memory_mib: 10, compute_capability: 9.0, memory_used: 1}\n",
            "gpus.yaml: gpus[0].memory_used: unknown key (expected one of: name, memory_mib,"
            " compute_capability, uuid, ecc_errors, used_mib)",
        ),
        ("gpus:\n  - NVIDIA L40S\n", 'gpus.yaml: gpus[0]: expected a mapping of options, got "NVIDIA L40S"'),
        ("gpus: {}\n", "gpus.yaml: gpus: expected a list, got a mapping"),
        ("", "gpus.yaml: gpus: required option is missing"),
        ("gpus: []\ngpu: []\n", "gpus.yaml: gpu: unknown key (expected one of: gpus, infiniband_sysfs)"),
        ("gpus: []\ninfiniband_sysfs: 5\n", "gpus.yaml: infiniband_sysfs: expected a path, got 5"),
        ("- a\n", "gpus.yaml: expected a mapping of options at the top level"),
        (
            "gpus: [\n",
            "gpus.yaml: line 2: while parsing a flow node, expected the node content, but found '<stream end>'",
        ),
    ],
)
def test_bad_files_are_refused_naming_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_simulated_node(text)
    assert str(info.value) == message


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^gone\.yaml: no such file$"):
        load_simulated_node(tmp_path / "gone.yaml")


def test_infiniband_sysfs_must_hold_the_tree(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    path = write_simulation(tmp_path / "gpus.yaml", [], infiniband_sysfs="empty")
    with pytest.raises(ConfigError) as info:
        load_simulated_node(path)
    assert str(info.value) == (
        f"gpus.yaml: infiniband_sysfs: no class/infiniband directory in {tmp_path / 'empty'}"
        " (expected a tree laid out like /sys)"
    )


# --- RDMA ports from the file's tree ----------------------------------------------------------


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    return write_proc(tmp_path / "proc")


def test_four_l40s_and_a_roce_port(proc_root: Path) -> None:
    inv = discover(
        local_address="127.0.0.1",
        simulate=SIMULATED / "l40s-x4-roce.yaml",
        node="node-b",
        proc_root=proc_root,
        nvml=UntouchableNvml(),
        # The real /sys is not read either: this tree would give two IB ports.
        sysfs_root=SYSFS / "ib-hdr-2port",
    )
    assert inv.simulated
    assert inv.gpu_note == ""
    assert [g.gpu_class for g in inv.gpus] == ["l40s-45g"] * 4
    assert [g.uuid for g in inv.gpus] == [f"GPU-sim-node-b-{i}" for i in range(4)]
    assert [g.problems for g in inv.gpus] == [(), (), (), ("ecc-uncorrected",)]
    # infiniband_sysfs is relative to the simulation file: ../sysfs/roce.
    assert inv.ib_ports == read_ib_ports(SYSFS / "roce")
    assert inv.ib_ports[0].roce_v2_gid_index == 3
    assert inv.fabric == "roce-10.0.0"
    # The host's own parts are still the host's.
    assert (inv.mgmt_interface, inv.mgmt_address) == ("lo", "127.0.0.1")
    assert inv.memory_total_mib > 0


def test_without_infiniband_sysfs_the_node_has_no_rdma_ports(proc_root: Path) -> None:
    inv = discover(
        simulate=SIMULATED / "h100-x2.yaml",
        node="a",
        proc_root=proc_root,
        nvml=UntouchableNvml(),
        sysfs_root=SYSFS / "ib-hdr-2port",
    )
    assert (inv.ib_ports, inv.fabric) == ((), "")
    assert len(inv.gpus) == 2


def test_fabric_override_applies_to_a_simulated_node(proc_root: Path) -> None:
    inv = discover(
        simulate=SIMULATED / "l40s-x4-roce.yaml", node="b", proc_root=proc_root, fabric_override="rack7"
    )
    assert inv.fabric == "rack7"


# --- read at every discovery ----------------------------------------------------------------


def test_edits_show_at_the_next_discovery_and_a_broken_file_shows_no_gpus(tmp_path: Path) -> None:
    path = write_simulation(tmp_path / "gpus.yaml", [H100])
    assert read_simulated(path, "n").gpus[0].memory_used_mib == 0

    write_simulation(path, [{**H100, "used_mib": 2048, "ecc_errors": 1}])
    (gpu,) = read_simulated(path, "n").gpus
    assert (gpu.memory_used_mib, gpu.problems) == (2048, ("ecc-uncorrected",))

    # As when NVML fails: no GPU to place on, and the reason where the operator looks.
    path.write_text("gpus:\n  - {name: x, memory_mib: lots, compute_capability: 9.0}\n")
    inv = discover(simulate=path, node="n", proc_root=write_proc(tmp_path / "proc"))
    assert inv.gpus == ()
    assert inv.simulated
    assert inv.gpu_note == 'simulated GPUs: gpus.yaml: gpus[0].memory_mib: expected an integer, got "lots"'


# --- NVML stays out of it --------------------------------------------------------------------


def test_nvml_off_shows_no_gpu_and_no_process() -> None:
    assert gpu_memory_by_pid(NvmlOff()) == {}
    assert read_gpus(NvmlOff()) == ((), "no NVML: NVML is not used: this agent's GPUs are simulated")


@pytest.fixture
def poisoned_pynvml(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose `import pynvml` leaves a mark (and fails), for child processes."""
    modules = tmp_path / "poison"
    modules.mkdir()
    marker = tmp_path / "pynvml-imported"
    (modules / "pynvml.py").write_text(
        f"open({str(marker)!r}, 'a').write('imported\\n')\nraise ImportError('poisoned for the test')\n"
    )
    path = os.pathsep.join(filter(None, [str(modules), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path}, marker


def test_agent_inventory_with_simulated_gpus_never_imports_pynvml(tmp_path: Path, poisoned_pynvml) -> None:
    env, marker = poisoned_pynvml
    agent_yaml = tmp_path / "agent.yaml"
    agent_yaml.write_text(f"node_name: lab-1\ndiscovery:\n  simulate: {SIMULATED / 'l40s-x4-roce.yaml'}\n")
    result = subprocess.run(
        [sys.executable, "-m", "llmgw", "agent", "inventory", "--json", "--config", str(agent_yaml)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["simulated"] is True
    assert [g["uuid"] for g in data["gpus"]] == [f"GPU-sim-lab-1-{i}" for i in range(4)]
    assert data["fabric"] == "roce-10.0.0"
    assert not marker.exists()

    # The poison works: the same command without the simulation does import it.
    agent_yaml.write_text("node_name: lab-1\n")
    result = subprocess.run(
        [sys.executable, "-m", "llmgw", "agent", "inventory", "--json", "--config", str(agent_yaml)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["simulated"] is False
    assert marker.exists()


# --- the command line -------------------------------------------------------------------------


def test_inventory_command_shows_the_simulated_gpus(tmp_path: Path, capsys) -> None:
    agent_yaml = tmp_path / "agent.yaml"
    (tmp_path / "sim").mkdir()
    write_simulation(tmp_path / "sim/gpus.yaml", [H100, H100])
    # Relative to agent.yaml, like every path in it.
    agent_yaml.write_text("node_name: lab-1\ndiscovery:\n  simulate: sim/gpus.yaml\n")
    assert main(["agent", "inventory", "--config", str(agent_yaml)]) == 0
    out = capsys.readouterr().out
    assert "GPUs (simulated)" in out and "h100-80g" in out


def test_inventory_command_refuses_a_bad_simulation_file(tmp_path: Path, capsys) -> None:
    write_simulation(tmp_path / "gpus.yaml", [{**H100, "memory_mib": "lots"}])
    agent_yaml = tmp_path / "agent.yaml"
    agent_yaml.write_text("discovery:\n  simulate: gpus.yaml\n")
    assert main(["agent", "inventory", "--config", str(agent_yaml)]) == 2
    assert capsys.readouterr().err == (
        'llmgw agent: gpus.yaml: gpus[0].memory_mib: expected an integer, got "lots"\n'
    )


# --- on the wire -----------------------------------------------------------------------------


def test_simulated_travels_on_the_link_and_older_agents_mean_real_hardware(tmp_path: Path) -> None:
    inv = discover(simulate=SIMULATED / "h100-x2.yaml", node="a", proc_root=write_proc(tmp_path / "proc"))
    assert decode(encode(Heartbeat(seq=1, inventory=inv))) == Heartbeat(seq=1, inventory=inv)
    # An agent from before this field sends none: its GPUs are real.
    data = converter.unstructure(inv)
    del data["simulated"]
    assert converter.structure(data, Inventory).simulated is False
