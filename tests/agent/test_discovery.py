import errno
import json
import socket
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from llmgw.agent.discovery import discover, host
from llmgw.agent.discovery import nvml as nvml_module
from llmgw.agent.discovery.infiniband import fabric_name, read_ib_ports
from llmgw.agent.discovery.nvml import read_gpus
from llmgw.ctl.inventory import inventory_json, render_inventory
from llmgw.wire.codec import converter
from llmgw.wire.messages import ForeignProcess, IbPort, Inventory
from tests.helpers import TESTS

FIXTURES = TESTS / "fixtures"
SYSFS = FIXTURES / "sysfs"
MIB = 2**20

# --- a fake pynvml, built from a fixture machine ---------------------------------------------


class FakeNVMLError(Exception):
    """Plays pynvml.NVMLError: the base class of one subclass per NVML error code."""


# pynvml's subclass suffix → the text str() gives for it in pynvml.
NVML_ERROR_TEXTS = {
    "LibraryNotFound": "NVML Shared Library Not Found",
    "DriverNotLoaded": "Driver Not Loaded",
    "NotSupported": "Not Supported",
    "NotFound": "Not Found",
    "GpuIsLost": "GPU is lost",
}


def _error_class(suffix: str) -> type[FakeNVMLError]:
    text = NVML_ERROR_TEXTS[suffix]
    return type(f"NVMLError_{suffix}", (FakeNVMLError,), {"__str__": lambda self: text})


class FakeNvml:
    """The parts of pynvml that discovery uses, answering for one machine description."""

    NVMLError = FakeNVMLError
    NVMLError_LibraryNotFound = _error_class("LibraryNotFound")
    NVMLError_DriverNotLoaded = _error_class("DriverNotLoaded")
    NVMLError_NotSupported = _error_class("NotSupported")
    NVMLError_NotFound = _error_class("NotFound")
    NVMLError_GpuIsLost = _error_class("GpuIsLost")
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def __init__(self, machine: dict[str, Any]) -> None:
        self.machine = machine
        self.initialized = False
        self.shutdowns = 0

    def _str(self, value: str) -> str | bytes:
        return value.encode() if self.machine.get("strings_as_bytes") else value

    def _raise(self, suffix: str) -> None:
        raise getattr(self, f"NVMLError_{suffix}")()

    def _gpu(self, handle: int) -> dict[str, Any]:
        assert self.initialized
        return self.machine["gpus"][handle]

    def nvmlInit(self) -> None:
        if "init_error" in self.machine:
            self._raise(self.machine["init_error"])
        self.initialized = True

    def nvmlShutdown(self) -> None:
        assert self.initialized, "nvmlShutdown without a successful nvmlInit"
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        assert self.initialized
        return len(self.machine["gpus"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if "handle_error" in self._gpu(index):
            self._raise(self._gpu(index)["handle_error"])
        return index

    def nvmlDeviceGetName(self, handle: int) -> str | bytes:
        return self._str(self._gpu(handle)["name"])

    def nvmlDeviceGetUUID(self, handle: int) -> str | bytes:
        return self._str(self._gpu(handle)["uuid"])

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        gpu = self._gpu(handle)
        total, used = gpu["memory_total"], gpu["memory_used"]
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        major, minor = self._gpu(handle)["cuda_compute_capability"]
        return major, minor

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter_type: int) -> int:
        assert (error_type, counter_type) == (1, 0), "asked for another ECC counter"
        count = self._gpu(handle)["ecc_uncorrected_volatile"]
        if count == "NotSupported":
            self._raise("NotSupported")
        return count

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(pid=p["pid"], usedGpuMemory=p["used_gpu_memory"])
            for p in self._gpu(handle)["compute_processes"]
        ]

    def nvmlSystemGetProcessName(self, pid: int) -> str | bytes:
        assert self.initialized
        for gpu in self.machine["gpus"]:
            for process in gpu.get("compute_processes", ()):
                if process["pid"] == pid and process["name"] is not None:
                    return self._str(process["name"])
        self._raise("NotFound")


def fake_nvml(fixture: str) -> FakeNvml:
    return FakeNvml(json.loads((FIXTURES / "nvml" / fixture).read_text()))


def test_fake_nvml_matches_pynvml_names() -> None:
    # The fake is only worth something if discovery, talking to it, talks to the real module.
    import pynvml

    for name in dir(FakeNvml):
        if name.startswith(("nvml", "NVML")):
            assert hasattr(pynvml, name), name
    for suffix in NVML_ERROR_TEXTS:
        real = getattr(pynvml, f"NVMLError_{suffix}")
        assert issubclass(real, pynvml.NVMLError)
        assert str(real()) == NVML_ERROR_TEXTS[suffix]
    assert pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED == FakeNvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    assert pynvml.NVML_VOLATILE_ECC == FakeNvml.NVML_VOLATILE_ECC


# --- GPUs -------------------------------------------------------------------------------------


def test_l40s_pair_flags_memory_held_by_a_process_llmgw_did_not_start() -> None:
    nvml = fake_nvml("l40s-x2.json")
    gpus, note = read_gpus(nvml, own_pids=frozenset({4100}))
    assert note == ""
    assert nvml.shutdowns == 1
    assert [g.gpu_class for g in gpus] == ["l40s-45g", "l40s-45g"]
    assert [g.index for g in gpus] == [0, 1]
    own, taken = gpus
    assert own.name == "NVIDIA L40S"
    assert own.uuid == "GPU-5f3c2a10-8d41-4b7e-9c2a-1e6f0b8d7a01"
    assert (own.memory_total_mib, own.memory_used_mib) == (46068, 41509)
    assert own.compute_capability == "8.9"
    assert own.ecc_uncorrected == 0
    assert own.foreign_processes == ()
    assert own.healthy
    assert taken.foreign_processes == (ForeignProcess(pid=31337, name="python3", used_mib=20480),)
    assert taken.problems == ("foreign-memory",)
    assert taken.memory_free_mib == 46068 - 20989


def test_without_own_pids_every_process_is_foreign() -> None:
    gpus, _ = read_gpus(fake_nvml("l40s-x2.json"))
    assert [g.problems for g in gpus] == [("foreign-memory",), ("foreign-memory",)]
    assert gpus[0].foreign_processes == (ForeignProcess(pid=4100, name="/usr/bin/python3", used_mib=41000),)


def test_in_a_pid_namespace_of_its_own_no_gpu_process_is_foreign(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a container, NVML's pids are the host's and ours are not: pid 4100 (our engine, as the
    host numbers it) would be foreign to an agent that knows it as, say, 57. Nothing is judged
    foreign there, so our engines' GPUs stay healthy and their replicas are not evicted."""
    container_pids = frozenset({57})
    gpus, note = read_gpus(fake_nvml("l40s-x2.json"), own_pids=container_pids, host_pids=False)
    assert note == ""
    assert [g.problems for g in gpus] == [(), ()]
    assert [g.foreign_processes for g in gpus] == [(), ()]
    # Found out by itself when not told: the pid namespace's inode is not the initial one.
    monkeypatch.setattr(nvml_module, "in_initial_pid_namespace", lambda: False)
    gpus, _ = read_gpus(fake_nvml("l40s-x2.json"), own_pids=container_pids)
    assert [g.healthy for g in gpus] == [True, True]
    monkeypatch.setattr(nvml_module, "in_initial_pid_namespace", lambda: True)
    gpus, _ = read_gpus(fake_nvml("l40s-x2.json"), own_pids=container_pids)
    assert [g.problems for g in gpus] == [("foreign-memory",), ("foreign-memory",)]


def test_h100_node_flags_the_gpu_with_uncorrected_ecc_errors() -> None:
    gpus, note = read_gpus(fake_nvml("h100-x8-ecc.json"))
    assert note == ""
    assert len(gpus) == 8
    assert {g.gpu_class for g in gpus} == {"h100-80g"}
    assert {g.memory_total_mib for g in gpus} == {81559}
    assert {g.compute_capability for g in gpus} == {"9.0"}
    assert [g.index for g in gpus if not g.healthy] == [5]
    assert gpus[5].ecc_uncorrected == 2
    assert gpus[5].problems == ("ecc-uncorrected",)


def test_t4_without_ecc_reports_minus_one_and_decodes_bytes() -> None:
    (gpu,), note = read_gpus(fake_nvml("t4-no-ecc.json"))
    assert note == ""
    assert gpu.ecc_uncorrected == -1
    assert gpu.name == "Tesla T4"
    assert gpu.uuid == "GPU-0e9b4d27-61c5-4f38-8a17-d2c3b5e6f7a8"
    assert gpu.gpu_class == "t4-15g"
    assert gpu.compute_capability == "7.5"
    # ECC that cannot be counted is not a fault; the foreign process is, name or no name.
    assert gpu.problems == ("foreign-memory",)
    assert gpu.foreign_processes == (ForeignProcess(pid=2051, name="", used_mib=1104),)


def test_node_without_nvml_library_is_cpu_only() -> None:
    nvml = fake_nvml("no-library.json")
    assert read_gpus(nvml) == ((), "no NVML: NVML Shared Library Not Found")
    assert nvml.shutdowns == 0


def test_node_without_driver_is_cpu_only() -> None:
    nvml = FakeNvml({"init_error": "DriverNotLoaded", "gpus": []})
    assert read_gpus(nvml) == ((), "no NVML: Driver Not Loaded")


def test_lost_gpu_hides_the_node_s_gpus_and_says_why() -> None:
    nvml = fake_nvml("gpu-lost.json")
    assert read_gpus(nvml) == ((), "NVML failed: GPU is lost")
    assert nvml.shutdowns == 1


def test_process_memory_unknown_to_the_driver_still_counts_as_taken() -> None:
    machine = json.loads((FIXTURES / "nvml" / "t4-no-ecc.json").read_text())
    machine["gpus"][0]["compute_processes"] = [
        {"pid": 7, "used_gpu_memory": None, "name": "a"},
        {"pid": 8, "used_gpu_memory": 0, "name": "b"},
    ]
    (gpu,), _ = read_gpus(FakeNvml(machine))
    assert gpu.foreign_processes == (ForeignProcess(pid=7, name="a"), ForeignProcess(pid=8, name="b"))
    assert gpu.problems == ("foreign-memory",)
    machine["gpus"][0]["compute_processes"] = [{"pid": 8, "used_gpu_memory": 0, "name": "b"}]
    (gpu,), _ = read_gpus(FakeNvml(machine))
    assert gpu.healthy


def test_missing_pynvml_package_is_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    gpus, note = read_gpus()
    assert gpus == ()
    assert note.startswith("no NVML: ")


# --- InfiniBand / RoCE ------------------------------------------------------------------------


def test_two_port_hdr_node() -> None:
    ports = read_ib_ports(SYSFS / "ib-hdr-2port")
    assert ports == (
        IbPort(
            device="mlx5_0",
            port=1,
            state="ACTIVE",
            rate_gbps=200.0,
            link_layer="InfiniBand",
            subnet="fe80:0000:0000:0000",
        ),
        IbPort(
            device="mlx5_1",
            port=1,
            state="ACTIVE",
            rate_gbps=200.0,
            link_layer="InfiniBand",
            subnet="fe80:0000:0000:0000",
        ),
    )
    assert fabric_name(ports) == "ib-fe80::"


def test_roce_node_picks_the_v2_gid_holding_ipv4() -> None:
    (port,) = read_ib_ports(SYSFS / "roce")
    assert port == IbPort(
        device="mlx5_0",
        port=1,
        state="ACTIVE",
        rate_gbps=100.0,
        link_layer="Ethernet",
        roce_v2_gid_index=3,
        subnet="10.0.0.5",
    )
    assert port.is_roce
    assert fabric_name((port,)) == "roce-10.0.0"


def test_unreadable_gid_type_is_an_unused_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    read_text = Path.read_text

    def einval_for_gid_3(path: Path, *args: Any, **kwargs: Any) -> str:
        if path.parts[-3:] == ("gid_attrs", "types", "3"):
            raise OSError(errno.EINVAL, "Invalid argument")
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", einval_for_gid_3)
    (port,) = read_ib_ports(SYSFS / "roce")
    # Only link-local v2 remains (GID 1), which does not route: no index, no fabric.
    assert (port.roce_v2_gid_index, port.subnet) == (None, "")
    assert fabric_name((port,)) == ""


def test_down_port_is_listed_and_the_active_one_names_the_fabric() -> None:
    down, up = read_ib_ports(SYSFS / "ib-port-down")
    assert (down.device, down.state, down.rate_gbps) == ("mlx5_0", "DOWN", 10.0)
    assert (up.device, up.state, up.rate_gbps, up.subnet) == (
        "mlx5_1",
        "ACTIVE",
        400.0,
        "fec0:0000:0000:0001",
    )
    assert fabric_name((down, up)) == "ib-fec0:0:0:1::"


def test_no_infiniband_directory_is_a_single_node_island(tmp_path: Path) -> None:
    assert read_ib_ports(tmp_path) == ()
    assert fabric_name(()) == ""


def test_fabric_name_needs_an_active_port_with_a_subnet() -> None:
    down = IbPort(
        device="mlx5_0",
        port=1,
        state="DOWN",
        rate_gbps=200.0,
        link_layer="InfiniBand",
        subnet="fe80:0000:0000:0000",
    )
    init = IbPort(
        device="mlx5_1",
        port=1,
        state="INIT",
        rate_gbps=200.0,
        link_layer="InfiniBand",
        subnet="fe80:0000:0000:0000",
    )
    roce_without_ipv4 = IbPort(
        device="mlx5_2", port=1, state="ACTIVE", rate_gbps=100.0, link_layer="Ethernet"
    )
    roce = IbPort(
        device="mlx5_3",
        port=1,
        state="ACTIVE",
        rate_gbps=100.0,
        link_layer="Ethernet",
        roce_v2_gid_index=3,
        subnet="192.168.7.20",
    )
    assert fabric_name((down, init)) == ""
    assert fabric_name((down, roce_without_ipv4, roce)) == "roce-192.168.7"


# --- host -------------------------------------------------------------------------------------

MEMINFO = """\
MemTotal:       2113534976 kB
MemFree:         101234560 kB
MemAvailable:   1987654321 kB
Buffers:           5123456 kB
Cached:         1800000000 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""


def write_proc(root: Path, *, if_inet6: str = "") -> Path:
    (root / "net").mkdir(parents=True)
    (root / "meminfo").write_text(MEMINFO)
    (root / "net" / "if_inet6").write_text(if_inet6)
    return root


# Two listeners (0.0.0.0:8080, [::]:31000), one established connection to 8080, and a socket
# listening on 127.0.0.1:31277 only: as the kernel writes /proc/net/tcp and tcp6.
PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 2 1
   2: 0100007F:7A2D 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3 1
"""
PROC_NET_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue
   0: 00000000000000000000000000000000:7918 00000000000000000000000000000000:0000 0A 00000000:00000000
"""


def test_listening_ports_from_proc_net_tcp(tmp_path: Path) -> None:
    root = write_proc(tmp_path)
    (root / "net" / "tcp").write_text(PROC_NET_TCP)
    assert host.listening_ports(root) == {8080, 31277}  # tcp6 missing: IPv4 alone
    (root / "net" / "tcp6").write_text(PROC_NET_TCP6)
    assert host.listening_ports(root) == {8080, 31277, 31000}


def test_ports_in_use_are_the_listeners_that_are_not_our_shards(tmp_path: Path) -> None:
    inv = fixture_inventory(tmp_path / "a")
    assert inv.ports_in_use == ()  # the fixture /proc has no sockets
    root = write_proc(tmp_path / "b")
    (root / "net" / "tcp").write_text(PROC_NET_TCP)
    (root / "net" / "tcp6").write_text(PROC_NET_TCP6)
    inv = discover(
        local_address="127.0.0.1", nvml=fake_nvml("l40s-x2.json"), proc_root=root, own_ports={31000}
    )
    assert inv.ports_in_use == (8080, 31277)


def test_memory_from_meminfo(tmp_path: Path) -> None:
    assert host.memory_mib(write_proc(tmp_path)) == (2113534976 // 1024, 1987654321 // 1024)


def test_loopback_address_is_on_lo() -> None:
    assert host.interface_for_address("127.0.0.1") == "lo"
    # What a dual-stack socket reports for the same address.
    assert host.interface_for_address("::ffff:127.0.0.1") == "lo"


def test_addresses_not_held_here_have_no_interface() -> None:
    assert host.interface_for_address("198.51.100.77") == ""
    assert host.interface_for_address("not an address") == ""
    assert host.interface_for_address("") == ""


def test_ipv6_address_from_if_inet6(tmp_path: Path) -> None:
    proc = write_proc(
        tmp_path,
        if_inet6=(
            "fe8000000000000000fc00fffe000001 04 40 20 80     eth0\n"
            "00000000000000000000000000000001 01 80 10 80       lo\n"
            "fd000000000000000000000000000002 07 40 00 82   ib0\n"
        ),
    )
    assert host.interface_for_address("::1", proc_root=proc) == "lo"
    assert host.interface_for_address("fd00::2", proc_root=proc) == "ib0"
    assert host.interface_for_address("fe80::fc:ff:fe00:1%eth0", proc_root=proc) == "eth0"
    assert host.interface_for_address("fd00::3", proc_root=proc) == ""


def test_cpus_and_hostname() -> None:
    assert host.cpu_count() >= 1
    assert host.hostname() == socket.gethostname()


# --- the whole inventory, and how it is shown ---------------------------------------------------


def fixture_inventory(tmp_path: Path, **kwargs: Any) -> Inventory:
    return discover(
        local_address="127.0.0.1",
        nvml=fake_nvml("l40s-x2.json"),
        sysfs_root=SYSFS / "roce",
        proc_root=write_proc(tmp_path),
        own_pids=frozenset({4100}),
        **kwargs,
    )


def test_discover_assembles_the_inventory(tmp_path: Path) -> None:
    inv = fixture_inventory(tmp_path)
    assert inv.hostname == socket.gethostname()
    assert (inv.memory_total_mib, inv.memory_available_mib) == (2113534976 // 1024, 1987654321 // 1024)
    assert [g.gpu_class for g in inv.gpus] == ["l40s-45g", "l40s-45g"]
    assert [g.healthy for g in inv.gpus] == [True, False]
    assert inv.ib_ports[0].roce_v2_gid_index == 3
    assert inv.fabric == "roce-10.0.0"
    assert (inv.mgmt_interface, inv.mgmt_address) == ("lo", "127.0.0.1")
    assert inv.gpu_note == ""


def test_fabric_override_replaces_the_discovered_name(tmp_path: Path) -> None:
    assert fixture_inventory(tmp_path / "a", fabric_override="rack7").fabric == "rack7"
    # "" in agent.yaml: this node stays a single-node island even with RDMA ports.
    assert fixture_inventory(tmp_path / "b", fabric_override="").fabric == ""


def test_discover_on_this_machine_does_not_raise() -> None:
    inv = discover()
    assert inv.cpu_count >= 1
    assert inv.memory_total_mib > 0
    assert (inv.mgmt_interface, inv.mgmt_address) == ("", "")
    if not inv.gpus:  # the usual case here: a CPU-only test machine
        assert inv.gpu_note.startswith("no NVML")


def test_render_shows_classes_problems_and_ports(tmp_path: Path) -> None:
    console = Console(record=True, width=120)
    render_inventory(fixture_inventory(tmp_path), console)
    text = console.export_text()
    assert "l40s-45g" in text
    assert "foreign-memory (pid 31337 python3 20,480 MiB)" in text
    assert "46,068" in text
    assert "mlx5_0" in text
    assert "roce-10.0.0" in text


def test_render_cpu_only_node() -> None:
    inv = Inventory(
        hostname="cpu-1",
        cpu_count=4,
        memory_total_mib=8192,
        memory_available_mib=4096,
        gpu_note="no NVML: NVML Shared Library Not Found",
    )
    console = Console(record=True, width=120)
    render_inventory(inv, console)
    text = console.export_text()
    assert "no GPUs (no NVML: NVML Shared Library Not Found)" in text
    assert "single-node island" in text


def test_inventory_json_is_the_wire_form(tmp_path: Path) -> None:
    inv = fixture_inventory(tmp_path)
    data = json.loads(inventory_json(inv))
    assert data["gpus"][1]["problems"] == ["foreign-memory"]
    assert converter.structure(data, Inventory) == inv
