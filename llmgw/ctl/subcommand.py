"""What every ``llmgw ctl`` noun module shares: how a subcommand is added, its ``--json`` flag,
errors as exit codes, and the two shapes most commands print (a listing, one item).

A command is ``func(args)``, or ``func(args, client)`` when it talks to the server: ``client`` is
:mod:`llmgw.ctl.commands`' factory, so every command finds the server and the token one way.
A :class:`~llmgw.ctl.client.CtlError` anywhere becomes ``error: <message>`` on stderr and exit
code 1; its message already says what to do about it.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

from llmgw.ctl import render
from llmgw.ctl.client import AdminClient, CtlError

EXIT_ERROR = 1
# A usage mistake caught before anything was sent (a bad line in the pairs file).
EXIT_USAGE = 2

ClientFactory = Callable[[argparse.Namespace], AdminClient]


def add(commands, name: str, help_text: str, func: Callable[..., int], client: ClientFactory | None = None):
    """Adds one subcommand; its description is its help as a sentence. With ``client``, ``func`` is
    called as ``func(args, client)``."""
    parser = commands.add_parser(
        name,
        help=help_text,
        description=help_text[0].upper() + help_text[1:] + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command = func if client is None else functools.partial(func, client=client)
    parser.set_defaults(func=_reporting_errors(command))
    return parser


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a subcommand's default would overwrite `ctl --json` given before the subcommand.
    parser.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print the API's JSON instead of tables",
    )


def _reporting_errors(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except CtlError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_ERROR

    return run


def listing(client: AdminClient, args: argparse.Namespace, path: str, key: str, empty: str, table) -> int:
    """A list from the API: its JSON with --json, else a table, or what to do when it is empty."""
    answer = client.get(path)
    if args.json:
        render.print_json(answer)
        return 0
    console = render.make_console()
    console.print(table(answer[key], time.time()) if answer[key] else empty)
    return 0


def detail(client: AdminClient, args: argparse.Namespace, path: str, show) -> int:
    """One item from the API: its JSON with --json, else ``show(item, now, console)``."""
    item = client.get(path)
    if args.json:
        render.print_json(item)
    else:
        show(item, time.time(), render.make_console())
    return 0


def read_text(path: Path) -> str:
    """A file the operator named, as text; CtlError saying why not."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CtlError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
