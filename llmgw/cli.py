"""The one executable: `llmgw server`, `llmgw agent`, `llmgw ctl ...`."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import trio

from llmgw import __version__

EXIT_CONFIG = 2  # bad configuration or setup: fix a file, then start again
EXIT_REFUSED = 3  # the server refused this agent (join token)

DESCRIPTION = """\
llmgw runs open-weight LLMs on a fleet of GPU nodes and serves them behind one
OpenAI-compatible endpoint. One executable, three roles:

  llmgw server   the control plane: catalog, store, gateway, reconciler, admin API
  llmgw agent    one per node: discovers GPUs, holds the link to the server, runs engines
  llmgw ctl      the operator's tool: listings and actions against a running server
"""

SERVER_HELP = """\
Runs the control plane. With no --config it listens on loopback only (agent link
127.0.0.1:7070, admin API 127.0.0.1:7071) and keeps its data under
$LLMGW_HOME/server (default ~/.local/share/llmgw/server).

On first start it writes two secrets into the data directory, each 0600:
  join-token    give it to agents (server.join_token_file in agent.yaml)
  admin-token   give it to ctl (`llmgw ctl context set --token-file ...`)
The server itself keeps only their SHA-256.
"""

AGENT_HELP = """\
Runs the node agent: discovers the node (GPUs through NVML, InfiniBand/RoCE from
sysfs, or both from the file that discovery.simulate names), connects to the
server's agent link and keeps that connection up, with capped, jittered backoff
between attempts.

The join token comes from server.join_token_file, else $LLMGW_JOIN_TOKEN, else
the token file of a server on this machine using the default data directory.

  llmgw agent --config agent.yaml
  llmgw agent inventory --json      what the scheduler will see of this node
"""


def build_parser() -> argparse.ArgumentParser:
    from llmgw.ctl.commands import add_ctl_parser
    from llmgw.server.store.command import add_store_parser

    parser = argparse.ArgumentParser(
        prog="llmgw", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"llmgw {__version__}")
    roles = parser.add_subparsers(dest="role", metavar="{server,agent,ctl}")
    roles.required = True

    server = roles.add_parser(
        "server",
        help="run the control plane",
        description=SERVER_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    server.add_argument(
        "--config", type=Path, metavar="FILE", help="server.yaml (default: built-in defaults)"
    )
    # The server starts its gateway workers as this program with this flag (llmgw.server.workers).
    server.add_argument("--gateway-worker", type=Path, metavar="SPEC", help=argparse.SUPPRESS)
    server.set_defaults(func=_cmd_server)
    server_actions = server.add_subparsers(dest="server_action", metavar="{store}")
    add_store_parser(server_actions)

    agent = roles.add_parser(
        "agent",
        help="run the node agent",
        description=AGENT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    agent.add_argument("--config", type=Path, metavar="FILE", help="agent.yaml (default: built-in defaults)")
    agent.set_defaults(func=_cmd_agent)
    agent_actions = agent.add_subparsers(dest="agent_action", metavar="{inventory}")
    inventory = agent_actions.add_parser(
        "inventory",
        help="print what the scheduler will see of this node",
        description="Discovers this node once and prints it: GPUs, classes, health, fabric.",
    )
    inventory.add_argument(
        "--config", type=Path, metavar="FILE", help="agent.yaml (for fabric and discovery.simulate)"
    )
    inventory.add_argument("--json", action="store_true", help="print JSON instead of tables")
    inventory.set_defaults(func=_cmd_inventory)

    add_ctl_parser(roles)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


# --- roles ------------------------------------------------------------------------------------


def _cmd_server(args: argparse.Namespace) -> int:
    if args.gateway_worker is not None:
        return _cmd_gateway_worker(args.gateway_worker)
    from llmgw.config import load_server_config
    from llmgw.server.run import run_server
    from llmgw.server.store import StoreError

    return _serve("server", load_server_config, run_server, args.config, {StoreError: EXIT_CONFIG})


def _cmd_gateway_worker(spec_file: Path) -> int:
    from llmgw.server.worker import load_spec, run_worker, worker_tracing

    _setup_logging("info")
    try:
        spec = load_spec(spec_file)
    except (OSError, ValueError) as exc:
        return _fail("gateway worker", exc, EXIT_CONFIG)
    from llmgw import tracing

    tracing.setup(worker_tracing(spec), "worker")
    try:
        return _run_role(run_worker, spec)
    except OSError as exc:  # the port taken by another program, the directory gone
        return _fail("gateway worker", exc, EXIT_CONFIG)
    finally:
        tracing.shutdown()  # sends the spans still waiting


def _cmd_agent(args: argparse.Namespace) -> int:
    from llmgw.agent.link import JoinRefused
    from llmgw.agent.run import AgentSetupError, run_agent
    from llmgw.config import load_agent_config

    failures = {AgentSetupError: EXIT_CONFIG, JoinRefused: EXIT_REFUSED}
    return _serve("agent", load_agent_config, run_agent, args.config, failures)


def _serve(role: str, load, run, config_path: Path | None, failures: dict[type, int]) -> int:
    """Loads a role's config, then runs it; a known failure exits with its status and one line."""
    from llmgw.config import ConfigError

    try:
        config = load(config_path)
    except ConfigError as exc:
        return _fail(role, exc, EXIT_CONFIG)
    _setup_logging(config.log_level)
    from llmgw import tracing

    tracing.setup(config.tracing, role)  # after logging: its ids go into the handlers' lines
    failures = {**failures, OSError: EXIT_CONFIG}  # a port taken, a directory not writable
    try:
        return _run_role(run, config)
    except tuple(failures) as exc:
        code = next(code for kind, code in failures.items() if isinstance(exc, kind))
        return _fail(role, exc, code)
    finally:
        tracing.shutdown()  # sends the spans still waiting


def _cmd_inventory(args: argparse.Namespace) -> int:
    from rich.console import Console

    from llmgw.agent.discovery import discover
    from llmgw.agent.run import AgentSetupError, check_simulation, node_name
    from llmgw.config import ConfigError, load_agent_config
    from llmgw.ctl.inventory import inventory_json, render_inventory

    try:
        config = load_agent_config(args.config)
        check_simulation(config)
    except (ConfigError, AgentSetupError) as exc:
        return _fail("agent", exc, EXIT_CONFIG)
    inventory = discover(
        fabric_override=config.fabric, simulate=config.discovery.simulate, node=node_name(config)
    )
    if args.json:
        print(inventory_json(inventory))
    else:
        render_inventory(inventory, Console())
    return 0


# --- plumbing ---------------------------------------------------------------------------------


def _run_role(role, config) -> int:
    """Runs a role until it ends, Ctrl-C or SIGTERM; either signal is a graceful stop."""

    async def until_signal() -> None:
        # A signal sent to the whole process group arrives twice under the frozen binary (once
        # directly, once forwarded by PyInstaller's launcher), and trio re-delivers what is
        # pending when the receiver closes. With "ignore" as the handler it restores, the repeat
        # cannot kill us halfway through cleanup. The first signal already starts the stop.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                await nursery.start(role, config)
                async for signum in signals:
                    logging.getLogger("llmgw").info("%s: stopping", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(_unwrap_single, until_signal)
    except KeyboardInterrupt:
        return 130
    return 0


async def _unwrap_single(fn) -> None:
    """Raises a lone exception out of trio's exception groups, so that callers can catch the
    errors they know (a refused join token, a bad store) by type."""
    try:
        await fn()
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if len(leaves) == 1 and not isinstance(leaves[0], trio.Cancelled):
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _fail(role: str, exc: BaseException, code: int) -> int:
    print(f"llmgw {role}: {exc}", file=sys.stderr)
    return code


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
