"""How ctl shows the admin API's answers to people (``--json`` shows them to programs instead).

Functions here take the API's JSON as it came, so what a person sees and what ``--json`` prints
never drift apart. Colour is rich's decision: none when stdout is not a terminal or when
``NO_COLOR`` is set.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmgw.ctl.inventory import render_inventory
from llmgw.wire.codec import converter
from llmgw.wire.messages import Inventory

MIB_PER_GIB = 1024

STATE_STYLES = {"online": "green", "lost": "red"}
# Beside the GPUs of a node whose agent reads them from discovery.simulate, not from NVML.
SIMULATED_MARKER = "(simulated)"


# Piped output is for grep and awk: rich's 80-column default for a pipe would cut values short
# with "…", so a pipe gets room for any row.
PIPED_WIDTH = 1000


def make_console() -> Console:
    console = Console(no_color=bool(os.environ.get("NO_COLOR")))
    if not console.is_terminal:
        console.width = PIPED_WIDTH
    return console


def print_json(data: Any) -> None:
    # Plain print, not rich: the output is for jq and scripts, byte for byte.
    print(json.dumps(data, indent=2))


def nodes_table(nodes: list[dict], now: float) -> Table:
    """One row per node; ``now`` is wall-clock unix seconds, for the heartbeat's age."""
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "STATE", "GPUS", "FREE", "FABRIC", "HEARTBEAT", "VERSION"):
        table.add_column(column, justify="right" if column == "FREE" else "left")
    for node in nodes:
        inventory = node["inventory"]
        table.add_row(
            Text(node["name"]),
            state_text(node),
            gpus_text(inventory),
            Text(free_memory(inventory)),
            Text(inventory.get("fabric") or "-"),
            Text(age(now - node["last_seen"])),
            Text(node["agent_version"]),
        )
    return table


def state_text(node: dict) -> Text:
    state = node["state"]
    text = Text(state, style=STATE_STYLES.get(state, ""))
    if state == "online" and not node["connected"]:
        # Within the liveness window after a disconnect: the agent may be restarting.
        text.append(" (no link)", style="yellow")
    return text


def gpus_text(inventory: dict) -> Text:
    """The GPUS column: the summary, marked when the GPUs are simulated."""
    text = Text(gpu_summary(inventory.get("gpus", [])))
    if inventory.get("simulated"):
        text.append(f" {SIMULATED_MARKER}", style="yellow")
    return text


def gpu_summary(gpus: list[dict]) -> str:
    """``2× l40s-45g``, one entry per class in the order the node lists them; ``cpu`` for none."""
    if not gpus:
        return "cpu"
    counts = Counter(gpu["gpu_class"] for gpu in gpus)
    unhealthy = Counter(gpu["gpu_class"] for gpu in gpus if gpu.get("problems"))
    parts = []
    for gpu_class, count in counts.items():
        part = f"{count}× {gpu_class}"
        if unhealthy[gpu_class]:
            part += f" ({unhealthy[gpu_class]} unhealthy)"
        parts.append(part)
    return ", ".join(parts)


def free_memory(inventory: dict) -> str:
    """Free GPU memory summed over the node's GPUs; free host memory for a CPU-only node."""
    gpus = inventory.get("gpus", [])
    if gpus:
        free_mib = sum(max(0, gpu["memory_total_mib"] - gpu["memory_used_mib"]) for gpu in gpus)
    else:
        free_mib = inventory["memory_available_mib"]
    return f"{free_mib / MIB_PER_GIB:.1f} GiB"


def age(seconds: float) -> str:
    seconds = max(0, int(seconds))  # a server clock slightly ahead of ours is not the future
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def render_node(node: dict, now: float, console: Console) -> None:
    """A node's header line, then its inventory's GPU and RDMA tables."""
    header = Text()
    header.append(node["name"], style="bold")
    header.append("  ")
    header.append_text(state_text(node))
    header.append(f"  heartbeat {age(now - node['last_seen'])}  agent {node['agent_version']}")
    if node["inventory"].get("simulated"):
        header.append("  simulated GPUs", style="yellow")
    console.print(header)
    render_inventory(converter.structure(node["inventory"], Inventory), console)
    if node.get("shards"):
        console.print(shards_table(node["shards"]))


SHARD_STATE_STYLES = {"Ready": "green", "Failed": "red", "Loading": "yellow", "Starting": "yellow"}


def compute_text(compute: dict | None) -> str:
    """What a shard computes on: `gpu0 1,234 MiB, gpu1 ...`, `cpu`, or `-` while unknown."""
    if compute is None:
        return "-"
    if not compute["gpus"]:
        return "cpu"
    return ", ".join(f"gpu{g['index']} {g['used_mib']:,} MiB" for g in compute["gpus"])


def shards_table(shards: list[dict]) -> Table:
    table = Table(box=None, pad_edge=False, title="shards", title_justify="left")
    for column in ("SHARD", "REPLICA", "STATE", "ENGINE", "MODEL", "PID", "ON", "REASON"):
        table.add_column(column, no_wrap=column != "REASON")
    for shard in sorted(shards, key=lambda s: s["shard_id"]):
        spec = shard.get("spec") or {}
        state = Text(shard["state"], style=SHARD_STATE_STYLES.get(shard["state"], ""))
        if shard.get("adopted"):
            state.append(" (adopted)")
        table.add_row(
            shard["shard_id"],
            shard["replica_id"],
            state,
            spec.get("engine", "-"),
            spec.get("model", "-"),
            str(shard["pid"] or "-"),
            compute_text(shard.get("compute")),
            shard.get("reason", ""),
        )
    return table


# --- the catalog ------------------------------------------------------------------------------


def models_table(models: list[dict]) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "FORMAT", "PATH", "PROFILES", "SOURCE"):
        table.add_column(column, no_wrap=column != "PATH")
    for model in models:
        table.add_row(
            Text(model["name"]),
            Text(model["format"]),
            Text(model["path"]),
            Text(", ".join(model["used_by"]) or "-"),
            Text(model["source"]),
        )
    return table


def profiles_table(profiles: list[dict]) -> Table:
    """One row per profile; WANT and WAIT are the scaler's count and the requests queued at the
    gateway for its model, SCALING the scaler's reason (why a profile is at zero, say)."""
    columns = (
        "NAME",
        "MODEL",
        "ENGINE",
        "ON",
        "TP×PP",
        "REPLICAS",
        "WANT",
        "WAIT",
        "ROUTING",
        "BAND",
        "SOURCE",
    )
    table = Table(box=None, pad_edge=False)
    for column in columns:
        table.add_column(
            column, no_wrap=True, justify="right" if column in ("BAND", "WANT", "WAIT") else "left"
        )
    table.add_column("SCALING", overflow="fold")
    for profile in profiles:
        scale = profile.get("scale") or {}  # a server from before scaling was shown has none
        wanted = scale.get("wanted")
        table.add_row(
            Text(profile["name"]),
            Text(profile["model"]),
            Text(profile["engine"]),
            Text(profile_on(profile)),
            Text(f"{profile['tensor_parallel']}×{profile['pipeline_parallel']}"),
            Text(f"{profile['min_replicas']}–{profile['max_replicas']}"),
            Text("-" if wanted is None else str(wanted)),
            Text(str(scale.get("waiting", 0))),
            Text(profile.get("routing", "-")),
            Text(str(profile["band"])),
            Text(profile["source"]),
            Text(scale.get("reason") or "-"),
        )
    return table


def profiles_without_replicas(profiles: list[dict]) -> list[Text]:
    """A line per profile that has no replica: the scaler's reason and the requests waiting."""
    lines = []
    for profile in profiles:
        scale = profile.get("scale") or {}
        waiting = scale.get("waiting", 0)
        line = Text(f"{profile['name']}: no replica")
        if scale.get("reason"):
            line.append(f" — {scale['reason']}")
        if waiting:
            line.append(f"; {waiting} request{'s' if waiting != 1 else ''} waiting", style="yellow")
        lines.append(line)
    return lines


def profile_on(profile: dict) -> str:
    """What one replica takes: ``2× h100-80g × 2 nodes``, ``1× l40s-45g``, or ``cpu 4 GiB``."""
    if profile["gpu_class"] is None:
        return f"cpu {gib(profile['memory_mib'])}"
    on = f"{profile['gpus_per_node']}× {profile['gpu_class']}"
    return on + (f" × {profile['nodes']} nodes" if profile["nodes"] > 1 else "")


def gib(mib: int) -> str:
    """``4 GiB`` for whole GiB, ``1.5 GiB`` otherwise."""
    whole, rest = divmod(mib, MIB_PER_GIB)
    return f"{whole} GiB" if not rest else f"{mib / MIB_PER_GIB:.1f} GiB"


REPLICA_STATE_STYLES = {**SHARD_STATE_STYLES, "Pending": "yellow", "Draining": "yellow"}


def replica_on(replica: dict) -> str:
    """The ON column: per node, the GPUs and MiB its shard holds, or `cpu`; `-` while unknown."""
    if not replica["shards"]:
        return "-"
    return "; ".join(f"{shard['node']}: {compute_text(shard.get('compute'))}" for shard in replica["shards"])


def replicas_table(replicas: list[dict], now: float) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("ID", "PROFILE", "MODEL", "STATE", "ON", "ENDPOINT", "AGE", "REASON"):
        table.add_column(column, no_wrap=column != "REASON", overflow="fold")
    for replica in replicas:
        # A replica on its way says nothing itself; its shards may (weights being fetched).
        reason = replica["reason"] or "; ".join(
            f"{shard['node']}: {shard['reason']}" for shard in replica["shards"] if shard.get("reason")
        )
        table.add_row(
            replica["id"],
            replica["profile"],
            replica["model"],
            Text(replica["state"], style=REPLICA_STATE_STYLES.get(replica["state"], "")),
            replica_on(replica),
            replica.get("endpoint") or "-",
            age(now - replica["created"]).removesuffix(" ago"),
            reason,
        )
    return table


def render_replica(replica: dict, now: float, console: Console) -> None:
    header = Text()
    header.append(replica["id"], style="bold")
    header.append("  ")
    header.append(replica["state"], style=REPLICA_STATE_STYLES.get(replica["state"], ""))
    header.append(
        f"  profile {replica['profile']}  model {replica['model']}  age {age(now - replica['created'])}"
    )
    if replica["failures"]:
        header.append(f"  failures {replica['failures']}")
    console.print(header)
    if replica["reason"]:
        console.print(replica["reason"])
    if replica.get("candidates"):
        table = Table(box=None, pad_edge=False, title="why no node takes it", title_justify="left")
        table.add_column("NODE")
        table.add_column("REASON")
        for candidate in replica["candidates"]:
            table.add_row(candidate["node"], candidate["reason"])
        console.print(table)
    if replica["shards"]:
        table = Table(box=None, pad_edge=False, title="shards", title_justify="left")
        for column in ("SHARD", "NODE", "RANK", "STATE", "PORT", "ON", "REASON"):
            table.add_column(column)
        for shard in replica["shards"]:
            table.add_row(
                shard["shard_id"],
                shard["node"],
                str(shard["rank"]),
                Text(shard["state"], style=SHARD_STATE_STYLES.get(shard["state"], "")),
                str(shard["port"]),
                compute_text(shard.get("compute")),
                shard.get("reason", ""),
            )
        console.print(table)


# --- tenants, api keys and usage --------------------------------------------------------------


def limits_text(limits: dict | None) -> str:
    """``rpm 60, tpm 100,000``; ``unlimited`` when none is set; ``-`` for no limits of its own."""
    if limits is None:
        return "-"
    parts = [f"{name} {value:,}" for name, value in limits.items() if value is not None]
    return ", ".join(parts) or "unlimited"


def date_text(when: float | None) -> str:
    """A wall-clock time as a UTC date and minute; ``-`` for none."""
    if when is None:
        return "-"
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%d %H:%M")


def tenants_table(tenants: list[dict], now: float) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "LIMITS", "KEYS", "CREATED"):
        table.add_column(column, no_wrap=True, justify="right" if column == "KEYS" else "left")
    for tenant in tenants:
        table.add_row(
            Text(tenant["name"]),
            Text(limits_text(tenant["limits"])),
            Text(str(tenant["active_keys"])),
            Text(date_text(tenant["created"])),
        )
    return table


def keys_table(keys: list[dict], now: float) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("ID", "TENANT", "MODELS", "BAND", "LIMITS", "CREATED", "REVOKED"):
        table.add_column(column, no_wrap=column != "MODELS", justify="right" if column == "BAND" else "left")
    for key in keys:
        revoked = Text(date_text(key["revoked"]), style="red" if key["revoked"] is not None else "")
        table.add_row(
            Text(key["id"]),
            Text(key["tenant"]),
            Text(", ".join(key["models"]) or "all"),
            Text(str(key["band"])),
            Text(limits_text(key["limits"])),
            Text(date_text(key["created"])),
            revoked,
        )
    return table


USAGE_COLUMNS = (
    ("REQUESTS", "requests"),
    ("PROMPT", "prompt_tokens"),
    ("COMPLETION", "completion_tokens"),
    ("TOTAL", "total_tokens"),
    ("ERRORS", "errors"),
)


def usage_table(group_by: list[str], rows: list[dict]) -> Table:
    table = Table(box=None, pad_edge=False)
    for name in group_by:
        table.add_column(name.upper(), no_wrap=True)
    for column, _ in USAGE_COLUMNS:
        table.add_column(column, justify="right")
    table.add_column("AVG LATENCY", justify="right")
    for row in rows:
        table.add_row(
            *(Text(str(row[name])) for name in group_by),
            *(Text(f"{row[field]:,}") for _, field in USAGE_COLUMNS),
            Text(f"{row['avg_latency_ms']:,.0f} ms"),
        )
    return table


# --- training jobs and adapters -----------------------------------------------------------------

JOB_STATE_STYLES = {
    "Pending": "yellow",
    "Sent": "yellow",
    "Training": "cyan",
    "Converting": "cyan",
    "Uploading": "cyan",
    "Succeeded": "green",
    "Failed": "red",
    "Cancelled": "yellow",
}
JOB_PHASES = ("queue", "train", "convert", "upload", "total")


def job_state_text(job: dict) -> Text:
    text = Text(job["state"], style=JOB_STATE_STYLES.get(job["state"], ""))
    if job.get("cancel_requested") and job["state"] not in ("Succeeded", "Failed", "Cancelled"):
        text.append(" (cancelling)", style="yellow")
    return text


def steps_text(job: dict) -> str:
    return f"{job['step']}/{job['total_steps']}" if job["total_steps"] else "-"


def loss_text(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def seconds_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def jobs_table(jobs: list[dict], now: float) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("ID", "ADAPTER", "MODEL", "NODE", "STATE", "STEPS", "LOSS", "PEAK", "AGE", "REASON"):
        table.add_column(column, no_wrap=column != "REASON", overflow="fold")
    for job in jobs:
        table.add_row(
            job["id"],
            job["adapter"],
            job["model"],
            job["node"],
            job_state_text(job),
            steps_text(job),
            loss_text(job["loss"]),
            f"{job['peak_mib']:,} MiB" if job["peak_mib"] else "-",
            age(now - job["created"]).removesuffix(" ago"),
            job["reason"],
        )
    return table


def render_job(job: dict, now: float, console: Console) -> None:
    """A job's header, progress, the wall time of each phase, its files and its log tail."""
    header = Text()
    header.append(job["id"], style="bold")
    header.append("  ")
    header.append_text(job_state_text(job))
    header.append(f"  adapter {job['adapter']}  model {job['model']}  node {job['node']}")
    header.append(f"  age {age(now - job['created'])}")
    console.print(header)
    if job["reason"]:
        console.print(job["reason"])
    params = job["params"]
    console.print(
        f"weights {job['base_dir']}  pairs {job['pairs']}  gguf {'yes' if job['gguf'] else 'no'}"
        f"  needs {job['need_mib']:,} MiB" + ("" if job["need_mib"] else " (cpu)")
    )
    console.print(
        f"rank {params['rank']}  alpha {params['alpha']}  targets {','.join(params['target_modules'])}"
        f"  lr {params['learning_rate']:g}  batch {params['batch_size']}  max len {params['max_seq_len']}"
        f"  seed {params['seed']}  "
        + (f"steps {params['steps']}" if params["steps"] else f"epochs {params['epochs']}")
    )
    console.print(
        f"steps {steps_text(job)}  loss {loss_text(job['loss'])}  "
        f"peak {job['peak_mib']:,} MiB  device {job['device'] or '-'}"
    )
    if job.get("upload"):
        console.print(f"upload {job['upload']['received']:,} of {job['upload']['total']:,} bytes")
    timings = Table(box=None, pad_edge=False, title="wall time", title_justify="left")
    for phase in JOB_PHASES:
        timings.add_column(phase.upper(), justify="right")
    timings.add_row(*(seconds_text(job["timings"].get(phase)) for phase in JOB_PHASES))
    console.print(timings)
    if job["files"]:
        console.print(files_table(job["files"]))
    if job.get("log_tail"):
        console.print(Text("log tail", style="bold"))
        for line in job["log_tail"]:
            console.print(Text("  " + line))


def size_text(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def files_table(files: list[dict]) -> Table:
    table = Table(box=None, pad_edge=False, title="files", title_justify="left")
    for column in ("FILE", "SIZE", "SHA256"):
        table.add_column(column, no_wrap=True, justify="right" if column == "SIZE" else "left")
    for f in files:
        table.add_row(f["name"], size_text(f["size"]), f["sha256"])
    return table


def adapters_table(adapters: list[dict], now: float) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "MODEL", "FILES", "SIZE", "GGUF", "JOB", "CREATED"):
        table.add_column(column, no_wrap=column != "FILES", justify="right" if column == "SIZE" else "left")
    for adapter in adapters:
        table.add_row(
            Text(adapter["name"]),
            Text(adapter["model"]),
            Text(", ".join(f["name"] for f in adapter["files"])),
            Text(size_text(sum(f["size"] for f in adapter["files"]))),
            Text("yes" if adapter["gguf"] else "no"),
            Text(adapter["job_id"]),
            Text(date_text(adapter["created"])),
        )
    return table


def job_progress():
    """The live bar `ctl train` follows a job with: state, bar, steps, loss, peak memory, ETA."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.fields[state]:<10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("peak {task.fields[peak]}"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=make_console(),
    )


def progress_fields(job: dict) -> dict:
    return {
        "state": job["state"],
        "loss": loss_text(job["loss"]),
        "peak": f"{job['peak_mib']:,} MiB" if job["peak_mib"] else "-",
    }
