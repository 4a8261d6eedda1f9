"""``llmgw ctl workers``: the gateway's worker processes, as the server last heard from them."""

from __future__ import annotations

import argparse

from rich.table import Table
from rich.text import Text

from llmgw.ctl import render
from llmgw.ctl.subcommand import ClientFactory, add, add_json_flag


def add_parsers(commands, client: ClientFactory) -> None:
    workers = add(
        commands,
        "workers",
        "list the gateway's worker processes: pid, connections, requests, lease",
        _workers,
        client,
    )
    add_json_flag(workers)


def _workers(args: argparse.Namespace, client: ClientFactory) -> int:
    answer = client(args).get("/admin/v1/workers")
    if args.json:
        render.print_json(answer)
    elif not answer["workers"]:
        print("no gateway workers: the gateway runs inside the server process (gateway.workers: 0)")
    else:
        render.make_console().print(workers_table(answer["workers"]))
    return 0


def workers_table(workers: list[dict]) -> Table:
    table = Table(box=None, pad_edge=False)
    columns = (
        "WORKER",
        "PID",
        "STATE",
        "CONNECTIONS",
        "REQUESTS",
        "IN FLIGHT",
        "QUEUED",
        "LEASE",
        "RESTARTS",
    )
    for column in columns:
        table.add_column(column, justify="right" if column not in ("WORKER", "STATE") else "left")
    for w in workers:
        state = "serving" if w["serving"] else ("connected" if w["connected"] else "not connected")
        if w.get("failure") and not w["serving"]:
            state = f"failing: {w['failure']}"  # its exit and last words, until it serves again
        if w["adopted"]:
            state += " (adopted)"
        lease = "-" if w["lease_left"] is None else f"{w['lease_left']:.0f} s"
        table.add_row(
            Text(w["id"]),
            Text(str(w["pid"] or "-")),
            Text(state, style="green" if w["serving"] else "red"),
            Text(str(w.get("connections", 0))),
            Text(f"{w['requests']:,}"),
            Text(str(w["in_flight"])),
            Text(str(w["queued"])),
            Text(lease),
            Text(str(w["restarts"])),
        )
    return table
