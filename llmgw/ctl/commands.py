"""``llmgw ctl``: the operator's commands against a running server's admin API.

:func:`add_ctl_parser` adds ``ctl``, its own flags, and each noun's subcommands, in the order
``ctl --help`` lists them. Each noun module owns its parser and its commands; what they share
(adding a subcommand, ``--json``, errors as exit codes) is :mod:`llmgw.ctl.subcommand`, and how
answers look is :mod:`llmgw.ctl.render`. Every subcommand sets ``func``: a callable taking the
parsed arguments and returning the exit code.
"""

from __future__ import annotations

import argparse

from llmgw.ctl import bench, catalog, engine_check, jobs, leader, nodes, replicas, tenants, usage, workers
from llmgw.ctl import context as context_commands
from llmgw.ctl.client import AdminClient, CtlError
from llmgw.ctl.context import NO_TOKEN_MESSAGE, resolve
from llmgw.ctl.subcommand import EXIT_ERROR, EXIT_USAGE, add

__all__ = ["EXIT_ERROR", "EXIT_USAGE", "add_ctl_parser"]

CTL_DESCRIPTION = """\
Talks to a running `llmgw server` through its admin API.

The server and the admin token are looked up in this order, each on its own:
  1. --server / --token
  2. $LLMGW_SERVER / $LLMGW_TOKEN
  3. the context file written by `llmgw ctl context set`
     ($LLMGW_CONTEXT, default ~/.config/llmgw/context.json)
The server defaults to http://127.0.0.1:7071. The token is in the file admin-token
in the server's data directory (default ~/.local/share/llmgw/server/admin-token).
"""

CTL_EPILOG = """\
examples:
  llmgw ctl context set --server http://10.0.0.5:7071 --token-file admin-token
  llmgw ctl nodes
  llmgw ctl node show gpu-node-07
  llmgw ctl node ping gpu-node-07
  llmgw ctl node add gpu-node-08 --server-address 10.0.0.5:7070 --join-token-file join-token
  llmgw ctl --json nodes | jq '.nodes[].name'
  llmgw ctl apply -f catalog.yaml
  llmgw ctl profiles
  llmgw ctl scale smollm2-cpu --replicas 2
  llmgw ctl train --model smollm2 --node gpu-node-07 --base-dir /models/smollm2-hf \\
      --data pairs.jsonl --name support-bot --need-mib 6000
  llmgw ctl jobs
"""


def add_ctl_parser(subparsers) -> None:
    ctl = subparsers.add_parser(
        "ctl",
        help="operate a running server: nodes, catalog, contexts",
        description=CTL_DESCRIPTION,
        epilog=CTL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ctl.add_argument("--server", metavar="URL", help="admin API address (default: see above)")
    ctl.add_argument(
        "--token",
        metavar="TOKEN",
        help="admin token; prefer $LLMGW_TOKEN or the context file, since other users can read argv",
    )
    ctl.add_argument("--json", action="store_true", help="print the API's JSON instead of tables")
    commands = ctl.add_subparsers(dest="ctl_command", metavar="COMMAND", required=True)

    for noun in (nodes, replicas, catalog, tenants, usage, workers, jobs, leader):
        noun.add_parsers(commands, _client)
    # Needs no server: it checks the engines installed on this machine.
    engine_check.add_parser(commands, add)
    bench.add_parser(commands, add, _client)
    context_commands.add_parsers(commands)


def _client(args: argparse.Namespace) -> AdminClient:
    """The admin API client every command uses: the server and token as ``resolve`` finds them."""
    context = resolve(args.server, args.token)
    if context.token is None:
        raise CtlError(NO_TOKEN_MESSAGE)
    return AdminClient(context.server, context.token)
