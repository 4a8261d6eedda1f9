"""``llmgw ctl nodes`` and ``llmgw ctl node show|ping|add``: the fleet's nodes (add is
:mod:`llmgw.ctl.node_add`)."""

from __future__ import annotations

import argparse
from urllib.parse import quote

from llmgw.ctl import node_add, render
from llmgw.ctl.subcommand import EXIT_ERROR, ClientFactory, add, add_json_flag, detail, listing


def add_parsers(commands, client: ClientFactory) -> None:
    nodes = add(commands, "nodes", "list the nodes and their GPUs", _nodes, client)
    add_json_flag(nodes)

    node = commands.add_parser(
        "node", help="one node: show, ping, add", description="Commands about a single node."
    )
    node_commands = node.add_subparsers(dest="node_command", metavar="COMMAND", required=True)
    show = add(node_commands, "show", "a node's details: GPUs, RDMA ports, state", _node_show, client)
    show.add_argument("name", metavar="NAME", help="the node's name, as `llmgw ctl nodes` lists it")
    add_json_flag(show)
    ping = add(
        node_commands,
        "ping",
        "check that the server can reach the node's agent and get an answer",
        _node_ping,
        client,
    )
    ping.add_argument("name", metavar="NAME", help="the node's name, as `llmgw ctl nodes` lists it")
    add_json_flag(ping)
    node_add.add_parser(node_commands, client)


def _nodes(args: argparse.Namespace, client: ClientFactory) -> int:
    empty = "no nodes have registered yet: start `llmgw agent` on a node"
    return listing(client(args), args, "/admin/v1/nodes", "nodes", empty, render.nodes_table)


def _node_show(args: argparse.Namespace, client: ClientFactory) -> int:
    return detail(client(args), args, f"/admin/v1/nodes/{quote(args.name, safe='')}", render.render_node)


def _node_ping(args: argparse.Namespace, client: ClientFactory) -> int:
    answer = client(args).post(f"/admin/v1/nodes/{quote(args.name, safe='')}/ping")
    if args.json:
        render.print_json(answer)
    elif answer["payload_ok"]:
        print(f"{answer['node']}: answered in {answer['rtt_ms']:.1f} ms")
    else:
        print(f"{answer['node']}: answered in {answer['rtt_ms']:.1f} ms, but with the wrong payload")
    # A wrong payload means the link mixes up replies: a bug worth a failing exit code.
    return 0 if answer["payload_ok"] else EXIT_ERROR
