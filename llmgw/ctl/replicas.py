"""``llmgw ctl replicas`` and ``llmgw ctl replica show|key``: what runs where, and why."""

from __future__ import annotations

import argparse
import time
from urllib.parse import quote

from llmgw.ctl import render
from llmgw.ctl.catalog import NO_CATALOG_HINT
from llmgw.ctl.subcommand import ClientFactory, add, add_json_flag, detail


def add_parsers(commands, client: ClientFactory) -> None:
    replicas = add(
        commands, "replicas", "list the replicas: state, where they run (ON), why", _replicas, client
    )
    add_json_flag(replicas)
    replica = commands.add_parser(
        "replica", help="one replica: show", description="Commands about a single replica."
    )
    replica_commands = replica.add_subparsers(dest="replica_command", metavar="COMMAND", required=True)
    show = add(
        replica_commands,
        "show",
        "a replica's shards, and why it is where it is (every node's reason while Pending)",
        _replica_show,
        client,
    )
    show.add_argument("id", metavar="ID", help="the replica's id, as `llmgw ctl replicas` lists it")
    add_json_flag(show)

    key = add(
        replica_commands,
        "key",
        "print a replica's engine key, to call its engine directly (keep it secret)",
        _replica_key,
        client,
    )
    key.add_argument("id", metavar="ID", help="the replica's id, as `llmgw ctl replicas` lists it")


def _replicas(args: argparse.Namespace, client: ClientFactory) -> int:
    admin = client(args)
    answer = admin.get("/admin/v1/replicas")
    if args.json:
        render.print_json(answer)
        return 0
    console = render.make_console()
    if answer["replicas"]:
        console.print(render.replicas_table(answer["replicas"], time.time()))
    # A profile with no replica has no row above: say why it has none, and who waits for one.
    profiles = admin.get("/admin/v1/profiles")["profiles"]
    with_replicas = {replica["profile"] for replica in answer["replicas"]}
    idle = [p for p in profiles if p["name"] not in with_replicas]
    for line in render.profiles_without_replicas(idle):
        console.print(line)
    if not answer["replicas"] and not idle:
        console.print(f"no replicas: the catalog's profiles want none ({NO_CATALOG_HINT})")
    return 0


def _replica_show(args: argparse.Namespace, client: ClientFactory) -> int:
    return detail(client(args), args, f"/admin/v1/replicas/{quote(args.id, safe='')}", render.render_replica)


def _replica_key(args: argparse.Namespace, client: ClientFactory) -> int:
    answer = client(args).get(f"/admin/v1/replicas/{quote(args.id, safe='')}/engine-key")
    print(answer["key"])
    return 0
