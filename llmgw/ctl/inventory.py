"""A node's inventory, for people and for jq: ``llmgw agent inventory`` and ``ctl node show``.

Here rather than in the agent because it is presentation (rich), which both the operator's tool
and the agent's own subcommand show; the agent itself never renders.
"""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmgw.wire.codec import converter
from llmgw.wire.messages import Gpu, Inventory


def render_inventory(inv: Inventory, console: Console) -> None:
    """A header line about the host, then a table of GPUs and one of RDMA ports."""
    mgmt = (
        f"{inv.mgmt_interface or 'unknown interface'} ({inv.mgmt_address})" if inv.mgmt_address else "unknown"
    )
    console.print(
        f"[bold]{escape(inv.hostname)}[/bold]  {inv.cpu_count} CPUs  "
        f"memory {inv.memory_total_mib:,} MiB ({inv.memory_available_mib:,} available)  "
        f"fabric {escape(inv.fabric) or 'none (single-node island)'}  mgmt {escape(mgmt)}"
    )
    if inv.gpus:
        console.print(_gpu_table(inv.gpus, simulated=inv.simulated))
    else:
        found_by = "the simulation file lists none" if inv.simulated else "NVML lists none"
        console.print(f"no GPUs ({escape(inv.gpu_note or found_by)})")
    if inv.ib_ports:
        console.print(_ib_table(inv))


def inventory_json(inv: Inventory) -> str:
    """The inventory exactly as it goes on the agent link, indented."""
    return json.dumps(converter.unstructure(inv), indent=2)


def _gpu_table(gpus: tuple[Gpu, ...], *, simulated: bool) -> Table:
    table = Table(title="GPUs (simulated)" if simulated else "GPUs", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("class")
    table.add_column("name")
    table.add_column("memory used / total MiB", justify="right")
    table.add_column("CC", justify="right")
    table.add_column("ECC", justify="right")
    table.add_column("problems")
    for gpu in gpus:
        table.add_row(
            str(gpu.index),
            escape(gpu.gpu_class),
            escape(gpu.name),
            f"{gpu.memory_used_mib:,} / {gpu.memory_total_mib:,}",
            gpu.compute_capability,
            "n/a" if gpu.ecc_uncorrected < 0 else str(gpu.ecc_uncorrected),
            escape(_problems(gpu)),
            style=None if gpu.healthy else "red",
        )
    return table


def _problems(gpu: Gpu) -> str:
    # Name the foreign processes: the operator's next step is to find and stop them.
    words = []
    for problem in gpu.problems:
        if problem == "foreign-memory":
            holders = ", ".join(
                f"pid {p.pid} {p.name or '?'} {p.used_mib:,} MiB" for p in gpu.foreign_processes
            )
            words.append(f"{problem} ({holders})")
        else:
            words.append(problem)
    return "; ".join(words)


def _ib_table(inv: Inventory) -> Table:
    table = Table(title="RDMA ports", title_justify="left")
    table.add_column("device")
    table.add_column("port", justify="right")
    table.add_column("state")
    table.add_column("rate Gb/s", justify="right")
    table.add_column("link layer")
    table.add_column("RoCE v2 GID", justify="right")
    table.add_column("subnet")
    for port in inv.ib_ports:
        table.add_row(
            escape(port.device),
            str(port.port),
            escape(port.state),
            f"{port.rate_gbps:g}",
            escape(port.link_layer),
            "" if port.roce_v2_gid_index is None else str(port.roce_v2_gid_index),
            escape(port.subnet),
            style=None if port.state == "ACTIVE" else "dim",
        )
    return table
