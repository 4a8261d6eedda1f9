"""``llmgw ctl``: the operator's commands against a running server's admin API.

:func:`add_ctl_parser` adds ``ctl`` and its subcommands to the top-level parser. Every
subcommand sets ``func``: a callable taking the parsed arguments and returning the exit code.
A :class:`~llmgw.ctl.client.CtlError` anywhere becomes ``error: <message>`` on stderr and exit
code 1; its message already says what to do about it.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, urlencode

from llmgw.config import ConfigError, converter, parse_catalog_file
from llmgw.core.training import ADAPTER_NAME, PairsError, TrainParams, parse_pairs
from llmgw.ctl import bench, engine_check, render
from llmgw.ctl.client import AdminClient, CtlError
from llmgw.ctl.context import context_path, resolve, save_context

EXIT_ERROR = 1
# A usage mistake caught before anything was sent (a bad line in the pairs file).
EXIT_USAGE = 2

NO_TOKEN_MESSAGE = (
    "no admin token: pass --token, set LLMGW_TOKEN, or run `llmgw ctl context set --server URL "
    "--token-file FILE` (the server writes the token to admin-token in its data directory)"
)

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
  llmgw ctl --json nodes | jq '.nodes[].name'
  llmgw ctl apply -f catalog.yaml
  llmgw ctl profiles
  llmgw ctl scale smollm2-cpu --replicas 2
  llmgw ctl train --model smollm2 --node gpu-node-07 --base-dir /models/smollm2-hf \\
      --data pairs.jsonl --name support-bot --need-mib 6000
  llmgw ctl jobs
"""

APPLY_DESCRIPTION = """\
Creates or replaces catalog entries from FILE, all of them or none. FILE has the
shape of server.yaml's catalog sections:

  models:
    NAME: {path: ..., format: gguf | safetensors}
  profiles:
    NAME: {model: ..., engine: ..., gpu_class: ..., memory_mib: ..., ...}

Entries declared in server.yaml cannot be changed here; edit server.yaml instead.
"""

NO_CATALOG_HINT = "declare them in server.yaml, or add them with `llmgw ctl apply -f FILE`"

CONTEXT_SET_DESCRIPTION = """\
Saves the server address and the admin token for later ctl commands, in the
context file ($LLMGW_CONTEXT, default ~/.config/llmgw/context.json, mode 0600).

The token is read from a file or from stdin, never from the command line, where
other users could see it in the process list and it would land in shell history.
"""

CONTEXT_SET_EPILOG = """\
examples:
  llmgw ctl context set --server http://10.0.0.5:7071 --token-file ./admin-token
  ssh head-node cat .local/share/llmgw/server/admin-token | \\
      llmgw ctl context set --server http://head-node:7071 --token-stdin
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

    nodes = _add(commands, "nodes", "list the nodes and their GPUs", _nodes)
    _add_json_flag(nodes)

    node = commands.add_parser(
        "node", help="one node: show, ping", description="Commands about a single node."
    )
    node_commands = node.add_subparsers(dest="node_command", metavar="COMMAND", required=True)
    show = _add(node_commands, "show", "a node's details: GPUs, RDMA ports, state", _node_show)
    show.add_argument("name", metavar="NAME", help="the node's name, as `llmgw ctl nodes` lists it")
    _add_json_flag(show)
    ping = _add(
        node_commands,
        "ping",
        "check that the server can reach the node's agent and get an answer",
        _node_ping,
    )
    ping.add_argument("name", metavar="NAME", help="the node's name, as `llmgw ctl nodes` lists it")
    _add_json_flag(ping)

    replicas = _add(commands, "replicas", "list the replicas: state, where they run (ON), why", _replicas)
    _add_json_flag(replicas)
    replica = commands.add_parser(
        "replica", help="one replica: show", description="Commands about a single replica."
    )
    replica_commands = replica.add_subparsers(dest="replica_command", metavar="COMMAND", required=True)
    replica_show = _add(
        replica_commands,
        "show",
        "a replica's shards, and why it is where it is (every node's reason while Pending)",
        _replica_show,
    )
    replica_show.add_argument("id", metavar="ID", help="the replica's id, as `llmgw ctl replicas` lists it")
    _add_json_flag(replica_show)

    replica_key = _add(
        replica_commands,
        "key",
        "print a replica's engine key, to call its engine directly (keep it secret)",
        _replica_key,
    )
    replica_key.add_argument("id", metavar="ID", help="the replica's id, as `llmgw ctl replicas` lists it")

    models = _add(commands, "models", "list the catalog's models and the profiles using each", _models)
    _add_json_flag(models)
    profiles = _add(commands, "profiles", "list the catalog's profiles: how each model is served", _profiles)
    _add_json_flag(profiles)

    apply = _add(commands, "apply", "create or replace catalog entries from a YAML file", _apply)
    apply.description = APPLY_DESCRIPTION
    apply.add_argument("-f", "--file", type=Path, metavar="FILE", required=True, help="the catalog file")
    _add_json_flag(apply)

    scale = _add(commands, "scale", "set how many replicas a profile runs", _scale)
    scale.add_argument(
        "profile", metavar="PROFILE", help="the profile's name, as `llmgw ctl profiles` lists it"
    )
    scale.add_argument("--replicas", type=int, metavar="N", help="exactly N replicas (min and max both N)")
    scale.add_argument("--min", type=int, metavar="N", help="at least N replicas")
    scale.add_argument("--max", type=int, metavar="M", help="at most M replicas")
    _add_json_flag(scale)

    delete = _add(commands, "delete", "remove a model or a profile from the catalog", _delete)
    delete.add_argument("kind", choices=("model", "profile"), help="what to remove")
    delete.add_argument("name", metavar="NAME", help="its name, as `llmgw ctl models` or `profiles` lists it")
    _add_json_flag(delete)

    _add_tenant_parsers(commands)
    _add_training_parsers(commands)
    # Needs no server: it checks the engines installed on this machine.
    engine_check.add_parser(commands, _add)
    bench.add_parser(commands, _add, _client)

    context = commands.add_parser(
        "context",
        help="save or show where ctl finds the server and the token",
        description="Where ctl finds the server and the admin token.",
    )
    context_commands = context.add_subparsers(dest="context_command", metavar="COMMAND", required=True)
    context_set = _add(context_commands, "set", "save the server and the admin token", _context_set)
    context_set.description = CONTEXT_SET_DESCRIPTION
    context_set.epilog = CONTEXT_SET_EPILOG
    context_set.add_argument(
        "--server", dest="set_server", metavar="URL", required=True, help="admin API address"
    )
    source = context_set.add_mutually_exclusive_group(required=True)
    source.add_argument("--token-file", type=Path, metavar="FILE", help="read the admin token from FILE")
    source.add_argument(
        "--token-stdin", action="store_true", help="read the admin token from stdin (prompts on a terminal)"
    )
    context_show = _add(
        context_commands,
        "show",
        "print the server and where the token comes from (never the token)",
        _context_show,
    )
    _add_json_flag(context_show)


KEYS_CREATE_EPILOG = """\
The key's secret is printed once, here, and never again: the server keeps only
its hash. Give it to the client now; if it is lost, revoke the key and make another.
"""


def _add_tenant_parsers(commands) -> None:
    tenants = _add(commands, "tenants", "list the tenants, their limits and working keys", _tenants)
    _add_json_flag(tenants)
    tenant = commands.add_parser(
        "tenant", help="one tenant: create, limits, delete", description="Commands about a single tenant."
    )
    tenant_commands = tenant.add_subparsers(dest="tenant_command", metavar="COMMAND", required=True)
    create = _add(tenant_commands, "create", "create a tenant, with its quota", _tenant_create)
    create.add_argument("name", metavar="NAME", help="the tenant's name")
    _add_limit_flags(create, "the tenant's")
    _add_json_flag(create)
    limits = _add(
        tenant_commands,
        "limits",
        "replace a tenant's quota (a limit not given becomes unlimited)",
        _tenant_limits,
    )
    limits.add_argument("name", metavar="NAME", help="the tenant's name, as `llmgw ctl tenants` lists it")
    _add_limit_flags(limits, "the tenant's")
    _add_json_flag(limits)
    delete = _add(tenant_commands, "delete", "delete a tenant that has no working keys", _tenant_delete)
    delete.add_argument("name", metavar="NAME", help="the tenant's name, as `llmgw ctl tenants` lists it")
    _add_json_flag(delete)

    keys = _add(commands, "keys", "list the API keys (never their secrets); create, revoke", _keys)
    keys.add_argument("--tenant", metavar="TENANT", help="only this tenant's keys")
    _add_json_flag(keys)
    key_commands = keys.add_subparsers(dest="keys_command", metavar="COMMAND")
    key_create = _add(key_commands, "create", "make an API key and print its secret, once", _keys_create)
    key_create.epilog = KEYS_CREATE_EPILOG
    key_create.add_argument("--tenant", metavar="TENANT", required=True, help="the tenant it belongs to")
    key_create.add_argument(
        "--model",
        dest="models",
        action="append",
        default=[],
        metavar="MODEL",
        help="a model it may use (repeat for more; none given: every model)",
    )
    key_create.add_argument(
        "--band", type=int, default=0, metavar="N", help="priority band, higher first (default 0)"
    )
    _add_limit_flags(key_create, "the key's own (on top of its tenant's)")
    _add_json_flag(key_create)
    revoke = _add(key_commands, "revoke", "revoke an API key: it fails from now on", _keys_revoke)
    revoke.add_argument("id", metavar="ID", help="the key's id, as `llmgw ctl keys` lists it")
    _add_json_flag(revoke)

    usage = _add(commands, "usage", "summarise the usage account: requests and tokens", _usage)
    usage.add_argument(
        "--by",
        default="tenant,model,day",
        metavar="GROUPS",
        help="comma-separated, of tenant, model, day (UTC); empty for one total (default: tenant,model,day)",
    )
    usage.add_argument(
        "--since", metavar="DATE", help="from this date or time (UTC unless it says), inclusive"
    )
    usage.add_argument("--until", metavar="DATE", help="to this date (the whole day) or time, exclusive")
    _add_json_flag(usage)


TRAIN_DESCRIPTION = """\
Trains a LoRA adapter for a catalog model on one node, from question/answer
pairs, and keeps it on the server (converted to GGUF too when the model is
served by llama.cpp).

The pairs file is JSONL: one {"question": "...", "answer": "..."} per line. It is
checked here first; bad lines are reported with their numbers (exit 2) and
nothing is sent. The weights (--base-dir) are a Hugging Face style directory ON
THE NODE: config.json, tokenizer files, *.safetensors.

The job waits until the node's agent is connected and nothing else trains there.
ctl prints the job id, then follows the job with a progress bar (steps, loss,
peak memory, ETA) until it ends: exit 0 only when it Succeeded. Ctrl-C stops
following, not the job (`llmgw ctl job cancel ID` does that).
"""

TRAIN_EPILOG = """\
examples:
  llmgw ctl train --model smollm2 --node cpu-1 --base-dir /models/smollm2-hf \\
      --data pairs.jsonl --name faq-v1 --steps 50
  llmgw ctl train ... --detach && llmgw ctl jobs
"""

# How often a followed job is looked at: the agent reports progress a few times a second.
FOLLOW_INTERVAL = 0.5
ENDED = ("Succeeded", "Failed", "Cancelled")


def _add_training_parsers(commands) -> None:
    defaults = TrainParams()
    train = _add(commands, "train", "train a LoRA adapter on a node and follow it", _train)
    train.description = TRAIN_DESCRIPTION
    train.epilog = TRAIN_EPILOG
    train.add_argument("--model", required=True, metavar="MODEL", help="the catalog model it is for")
    train.add_argument("--node", required=True, metavar="NODE", help="the node that trains it")
    train.add_argument(
        "--base-dir",
        required=True,
        metavar="DIR",
        help="the model's safetensors directory on the node (absolute)",
    )
    train.add_argument(
        "--data", required=True, type=Path, metavar="FILE", help="question/answer pairs, JSONL"
    )
    train.add_argument(
        "--name", required=True, metavar="ADAPTER", help="the adapter's name (a-z, 0-9, . _ -)"
    )
    train.add_argument(
        "--need-mib",
        type=int,
        default=0,
        metavar="N",
        help="MiB of one GPU the training needs; 0 trains on the CPU (default 0)",
    )
    train.add_argument("--rank", type=int, metavar="N", help=f"LoRA rank (default {defaults.rank})")
    train.add_argument("--alpha", type=int, metavar="N", help=f"LoRA alpha (default {defaults.alpha})")
    train.add_argument(
        "--target-modules",
        metavar="A,B",
        help=f"modules to adapt, comma-separated (default {','.join(defaults.target_modules)})",
    )
    train.add_argument("--steps", type=int, metavar="N", help="optimizer steps; overrides --epochs")
    train.add_argument(
        "--epochs",
        type=int,
        metavar="N",
        help=f"passes over the pairs when --steps is 0 (default {defaults.epochs})",
    )
    train.add_argument(
        "--lr", type=float, metavar="X", help=f"learning rate (default {defaults.learning_rate:g})"
    )
    train.add_argument(
        "--batch-size", type=int, metavar="N", help=f"pairs per step (default {defaults.batch_size})"
    )
    train.add_argument(
        "--max-seq-len",
        type=int,
        metavar="N",
        help=f"tokens per pair, longer are cut (default {defaults.max_seq_len})",
    )
    train.add_argument("--seed", type=int, metavar="N", help=f"random seed (default {defaults.seed})")
    gguf = train.add_mutually_exclusive_group()
    gguf.add_argument(
        "--gguf",
        dest="gguf",
        action="store_true",
        default=None,
        help="also convert to GGUF (default: when a llama.cpp profile serves the model)",
    )
    gguf.add_argument("--no-gguf", dest="gguf", action="store_false", help="do not convert to GGUF")
    train.add_argument("--detach", action="store_true", help="print the job id and return without following")
    _add_json_flag(train)

    jobs = _add(commands, "jobs", "list the training jobs: state, steps, loss, why", _jobs)
    _add_json_flag(jobs)
    job = commands.add_parser(
        "job", help="one training job: show, cancel", description="Commands about a single training job."
    )
    job_commands = job.add_subparsers(dest="job_command", metavar="COMMAND", required=True)
    show = _add(
        job_commands,
        "show",
        "a job's progress, wall time per phase (queue, train, convert, upload) and log tail",
        _job_show,
    )
    show.add_argument("id", metavar="ID", help="the job's id, as `llmgw ctl jobs` lists it")
    _add_json_flag(show)
    cancel = _add(job_commands, "cancel", "cancel a job: its child on the node is stopped", _job_cancel)
    cancel.add_argument("id", metavar="ID", help="the job's id, as `llmgw ctl jobs` lists it")
    _add_json_flag(cancel)

    adapters = _add(commands, "adapters", "list the adapters the server keeps; download", _adapters)
    _add_json_flag(adapters)
    adapter_commands = adapters.add_subparsers(dest="adapters_command", metavar="COMMAND")
    download = _add(
        adapter_commands,
        "download",
        "download an adapter's files into a directory, checking each file's sha256",
        _adapters_download,
    )
    download.add_argument("name", metavar="NAME", help="the adapter's name, as `llmgw ctl adapters` lists it")
    download.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        metavar="DIR",
        help="where to write them (made 0700 if new)",
    )
    _add_json_flag(download)


def _add_limit_flags(parser: argparse.ArgumentParser, whose: str) -> None:
    for flag, what in (
        ("--rpm", "requests per minute"),
        ("--tpm", "tokens per minute"),
        ("--tpd", "tokens per day"),
    ):
        parser.add_argument(flag, type=int, metavar="N", help=f"{whose} {what} (default: unlimited)")


def _limits_body(args: argparse.Namespace) -> dict:
    return {"rpm": args.rpm, "tpm": args.tpm, "tpd": args.tpd}


def _add(commands, name: str, help_text: str, func: Callable[[argparse.Namespace], int]):
    parser = commands.add_parser(
        name,
        help=help_text,
        description=help_text[0].upper() + help_text[1:] + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=_reporting_errors(func))
    return parser


def _add_json_flag(parser: argparse.ArgumentParser) -> None:
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


def _client(args: argparse.Namespace) -> AdminClient:
    context = resolve(args.server, args.token)
    if context.token is None:
        raise CtlError(NO_TOKEN_MESSAGE)
    return AdminClient(context.server, context.token)


# --- commands ---------------------------------------------------------------------------------


def _nodes(args: argparse.Namespace) -> int:
    empty = "no nodes have registered yet: start `llmgw agent` on a node"
    return _listing(args, "/admin/v1/nodes", "nodes", empty, render.nodes_table)


def _replicas(args: argparse.Namespace) -> int:
    client = _client(args)
    answer = client.get("/admin/v1/replicas")
    if args.json:
        render.print_json(answer)
        return 0
    console = render.make_console()
    if answer["replicas"]:
        console.print(render.replicas_table(answer["replicas"], time.time()))
    # A profile with no replica has no row above: say why it has none, and who waits for one.
    profiles = client.get("/admin/v1/profiles")["profiles"]
    with_replicas = {replica["profile"] for replica in answer["replicas"]}
    idle = [p for p in profiles if p["name"] not in with_replicas]
    for line in render.profiles_without_replicas(idle):
        console.print(line)
    if not answer["replicas"] and not idle:
        console.print(f"no replicas: the catalog's profiles want none ({NO_CATALOG_HINT})")
    return 0


def _replica_show(args: argparse.Namespace) -> int:
    return _detail(args, f"/admin/v1/replicas/{quote(args.id, safe='')}", render.render_replica)


def _replica_key(args: argparse.Namespace) -> int:
    answer = _client(args).get(f"/admin/v1/replicas/{quote(args.id, safe='')}/engine-key")
    print(answer["key"])
    return 0


def _node_show(args: argparse.Namespace) -> int:
    return _detail(args, f"/admin/v1/nodes/{quote(args.name, safe='')}", render.render_node)


def _listing(args: argparse.Namespace, path: str, key: str, empty: str, table) -> int:
    """A list from the API: its JSON with --json, else a table, or what to do when it is empty."""
    answer = _client(args).get(path)
    if args.json:
        render.print_json(answer)
        return 0
    console = render.make_console()
    console.print(table(answer[key], time.time()) if answer[key] else empty)
    return 0


def _detail(args: argparse.Namespace, path: str, show) -> int:
    """One item from the API: its JSON with --json, else ``show(item, now, console)``."""
    item = _client(args).get(path)
    if args.json:
        render.print_json(item)
    else:
        show(item, time.time(), render.make_console())
    return 0


def _node_ping(args: argparse.Namespace) -> int:
    answer = _client(args).post(f"/admin/v1/nodes/{quote(args.name, safe='')}/ping")
    if args.json:
        render.print_json(answer)
    elif answer["payload_ok"]:
        print(f"{answer['node']}: answered in {answer['rtt_ms']:.1f} ms")
    else:
        print(f"{answer['node']}: answered in {answer['rtt_ms']:.1f} ms, but with the wrong payload")
    # A wrong payload means the link mixes up replies: a bug worth a failing exit code.
    return 0 if answer["payload_ok"] else EXIT_ERROR


def _models(args: argparse.Namespace) -> int:
    answer = _client(args).get("/admin/v1/models")
    if args.json:
        render.print_json(answer)
    elif not answer["models"]:
        print(f"no models in the catalog: {NO_CATALOG_HINT}")
    else:
        render.make_console().print(render.models_table(answer["models"]))
    return 0


def _profiles(args: argparse.Namespace) -> int:
    answer = _client(args).get("/admin/v1/profiles")
    if args.json:
        render.print_json(answer)
    elif not answer["profiles"]:
        print(f"no profiles in the catalog: {NO_CATALOG_HINT}")
    else:
        render.make_console().print(render.profiles_table(answer["profiles"]))
    return 0


def _apply(args: argparse.Namespace) -> int:
    path: Path = args.file
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CtlError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    # Checked here first, so that a typo is reported against the file; what depends on the
    # catalog as it stands (does the model exist?) only the server can judge.
    try:
        catalog = parse_catalog_file(text, str(path))
    except ConfigError as e:
        raise CtlError(str(e)) from None
    if not catalog.models and not catalog.profiles:
        raise CtlError(f"{path}: no models or profiles to apply")
    body = {
        "models": converter.unstructure(catalog.models),
        "profiles": converter.unstructure(catalog.profiles),
    }
    answer = _client(args).post("/admin/v1/catalog", body)
    if args.json:
        render.print_json(answer)
    else:
        for change in answer["changes"]:
            print(f"{change['kind']} {change['name']}: {change['change']}")
    return 0


def _scale(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        if args.min is not None or args.max is not None:
            raise CtlError("give --replicas N, or --min N and/or --max M, not both")
        body = {"replicas": args.replicas}
    elif args.min is None and args.max is None:
        raise CtlError("give --replicas N, or --min N and/or --max M")
    else:
        body = {
            key: value
            for key, value in (("min_replicas", args.min), ("max_replicas", args.max))
            if value is not None
        }
    profile = _client(args).post(f"/admin/v1/profiles/{quote(args.profile, safe='')}/scale", body)
    if args.json:
        render.print_json(profile)
    else:
        print(f"profile {profile['name']}: {profile['min_replicas']}–{profile['max_replicas']} replicas")
    return 0


def _delete(args: argparse.Namespace) -> int:
    client = _client(args)
    answer = client.delete(f"/admin/v1/{args.kind}s/{quote(args.name, safe='')}")
    if args.json:
        render.print_json(answer)
    else:
        print(f"{args.kind} {args.name}: deleted")
    return 0


def _tenants(args: argparse.Namespace) -> int:
    empty = "no tenants: make one with `llmgw ctl tenant create NAME`"
    return _listing(args, "/admin/v1/tenants", "tenants", empty, render.tenants_table)


def _tenant_create(args: argparse.Namespace) -> int:
    tenant = _client(args).post("/admin/v1/tenants", {"name": args.name, "limits": _limits_body(args)})
    if args.json:
        render.print_json(tenant)
    else:
        print(f"tenant {tenant['name']}: created ({render.limits_text(tenant['limits'])})")
    return 0


def _tenant_limits(args: argparse.Namespace) -> int:
    tenant = _client(args).post(f"/admin/v1/tenants/{quote(args.name, safe='')}/limits", _limits_body(args))
    if args.json:
        render.print_json(tenant)
    else:
        print(f"tenant {tenant['name']}: {render.limits_text(tenant['limits'])}")
    return 0


def _tenant_delete(args: argparse.Namespace) -> int:
    answer = _client(args).delete(f"/admin/v1/tenants/{quote(args.name, safe='')}")
    if args.json:
        render.print_json(answer)
    else:
        print(f"tenant {args.name}: deleted")
    return 0


def _keys(args: argparse.Namespace) -> int:
    path = "/admin/v1/keys" + ("" if args.tenant is None else f"?tenant={quote(args.tenant, safe='')}")
    empty = "no api keys: make one with `llmgw ctl keys create --tenant TENANT`"
    return _listing(args, path, "keys", empty, render.keys_table)


def _keys_create(args: argparse.Namespace) -> int:
    limits = _limits_body(args)
    body = {
        "tenant": args.tenant,
        "models": args.models,
        "band": args.band,
        "limits": limits if any(value is not None for value in limits.values()) else None,
    }
    key = _client(args).post("/admin/v1/keys", body)
    if args.json:
        render.print_json(key)
        return 0
    print(f"api key {key['id']} for tenant {key['tenant']}: created")
    print(key["secret"])
    # On stderr, so that `ctl keys create ... > file` leaves only the secret in the file.
    print("warning: this secret will not be shown again; give it to the client now", file=sys.stderr)
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    key = _client(args).delete(f"/admin/v1/keys/{quote(args.id, safe='')}")
    if args.json:
        render.print_json(key)
    else:
        print(f"api key {key['id']}: revoked")
    return 0


def _usage(args: argparse.Namespace) -> int:
    query = {"by": args.by, "since": args.since, "until": args.until}
    path = "/admin/v1/usage?" + urlencode({name: value for name, value in query.items() if value is not None})
    answer = _client(args).get(path)
    if args.json:
        render.print_json(answer)
    elif not answer["usage"]:
        print("no usage recorded in that time")
    else:
        render.make_console().print(render.usage_table(answer["by"], answer["usage"]))
    return 0


def _train(args: argparse.Namespace) -> int:
    pairs = _read_pairs(args.data)
    if pairs is None:
        return EXIT_USAGE
    if not ADAPTER_NAME.fullmatch(args.name):
        raise CtlError(
            f"--name: {args.name!r} must be 1-63 of a-z, 0-9, '.', '_', '-', starting with a letter or digit"
        )
    params = {
        "rank": args.rank,
        "alpha": args.alpha,
        "target_modules": None if args.target_modules is None else args.target_modules.split(","),
        "steps": args.steps,
        "epochs": args.epochs,
        "learning_rate": args.lr,
        "batch_size": args.batch_size,
        "max_seq_len": args.max_seq_len,
        "seed": args.seed,
    }
    body = {
        "model": args.model,
        "node": args.node,
        "adapter": args.name,
        "base_dir": args.base_dir,
        "need_mib": args.need_mib,
        "params": {key: value for key, value in params.items() if value is not None},
        "gguf": args.gguf,
        "pairs": pairs,
    }
    client = _client(args)
    job = client.post("/admin/v1/jobs", body)
    if args.json and args.detach:
        render.print_json(job)
        return 0
    if not args.json:
        print(
            f"job {job['id']}: {job['state']} (adapter {job['adapter']} for {job['model']} on node {job['node']})"
        )
    if args.detach:
        return 0
    try:
        job = _follow(client, job, quiet=args.json)
    except KeyboardInterrupt:
        print(f"\nstopped following; the job goes on (`llmgw ctl job show {job['id']}`)", file=sys.stderr)
        return 130
    if args.json:
        render.print_json(job)
    else:
        _print_outcome(job)
    return 0 if job["state"] == "Succeeded" else EXIT_ERROR


def _read_pairs(path: Path) -> str | None:
    """The pairs file's text, once every line parses; None after printing each bad line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CtlError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        parse_pairs(text)
    except PairsError as e:
        for problem in e.problems:
            print(f"error: {path}: {problem}", file=sys.stderr)
        print(f"error: {path}: nothing was sent; fix the lines above", file=sys.stderr)
        return None
    return text


def _follow(client: AdminClient, job: dict, *, quiet: bool) -> dict:
    """Polls the job until it ends; shows a progress bar unless ``quiet``."""
    path = f"/admin/v1/jobs/{quote(job['id'], safe='')}"
    if quiet:
        while job["state"] not in ENDED:
            time.sleep(FOLLOW_INTERVAL)
            job = client.get(path)
        return job
    with render.job_progress() as progress:
        task = progress.add_task("", total=None, **render.progress_fields(job))
        while True:
            progress.update(
                task,
                total=job["total_steps"] or None,
                completed=job["step"],
                **render.progress_fields(job),
            )
            if job["state"] in ENDED:
                return job
            time.sleep(FOLLOW_INTERVAL)
            job = client.get(path)


def _print_outcome(job: dict) -> None:
    timings = job["timings"]
    split = "  ".join(f"{phase} {render.seconds_text(timings.get(phase))}" for phase in render.JOB_PHASES)
    if job["state"] == "Succeeded":
        print(
            f"job {job['id']}: Succeeded; adapter {job['adapter']} kept (peak {job['peak_mib']:,} MiB; {split})"
        )
        return
    print(f"job {job['id']}: {job['state']}: {job['reason']}", file=sys.stderr)
    for line in job.get("log_tail") or []:
        print(f"  {line}", file=sys.stderr)


def _jobs(args: argparse.Namespace) -> int:
    empty = "no training jobs: start one with `llmgw ctl train`"
    return _listing(args, "/admin/v1/jobs", "jobs", empty, render.jobs_table)


def _job_show(args: argparse.Namespace) -> int:
    return _detail(args, f"/admin/v1/jobs/{quote(args.id, safe='')}", render.render_job)


def _job_cancel(args: argparse.Namespace) -> int:
    job = _client(args).post(f"/admin/v1/jobs/{quote(args.id, safe='')}/cancel")
    if args.json:
        render.print_json(job)
    elif job["state"] == "Cancelled":
        print(f"job {job['id']}: Cancelled ({job['reason']})")
    else:
        print(f"job {job['id']}: cancelling; its node stops the child (`llmgw ctl job show {job['id']}`)")
    return 0


def _adapters(args: argparse.Namespace) -> int:
    empty = "no adapters yet: train one with `llmgw ctl train`"
    return _listing(args, "/admin/v1/adapters", "adapters", empty, render.adapters_table)


def _adapters_download(args: argparse.Namespace) -> int:
    client = _client(args)
    listing = client.get("/admin/v1/adapters")["adapters"]
    adapter = next((a for a in listing if a["name"] == args.name), None)
    if adapter is None:
        raise CtlError(f'no adapter "{args.name}" (see `llmgw ctl adapters`)')
    out: Path = args.output
    try:
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise CtlError(f"cannot make {out}: {e.strerror}") from None
    written = []
    for f in adapter["files"]:
        dest = out / f["name"]
        path = f"/admin/v1/adapters/{quote(args.name, safe='')}/files/{quote(f['name'], safe='')}"
        size, sha256 = client.download(path, dest)
        if (size, sha256) != (f["size"], f["sha256"]):
            os.unlink(dest)
            raise CtlError(
                f"{f['name']}: got {size} bytes with sha256 {sha256}, the server lists {f['size']} bytes "
                f"with {f['sha256']}; the file was removed"
            )
        written.append({**f, "path": str(dest)})
        if not args.json:
            print(f"{dest}: {render.size_text(size)}, sha256 ok")
    if args.json:
        render.print_json({"adapter": args.name, "files": written})
    return 0


def _context_set(args: argparse.Namespace) -> int:
    token = _read_token(args)
    path = save_context(args.set_server, token)
    print(f"saved to {path}; try `llmgw ctl nodes`")
    return 0


def _read_token(args: argparse.Namespace) -> str:
    if args.token_file is not None:
        try:
            token = args.token_file.read_text()
        except OSError as e:
            raise CtlError(f"cannot read the token file {args.token_file}: {e.strerror}") from None
        where = str(args.token_file)
    elif sys.stdin.isatty():
        token = getpass.getpass("admin token: ")  # not echoed
        where = "the terminal"
    else:
        token = sys.stdin.read()
        where = "stdin"
    token = token.strip()
    if not token:
        raise CtlError(f"no token in {where}")
    return token


def _context_show(args: argparse.Namespace) -> int:
    context = resolve(args.server, args.token)
    path = context_path()
    if args.json:
        render.print_json(
            {
                "server": context.server,
                "server_source": context.server_source,
                "token_source": context.source,
                "context_file": str(path),
            }
        )
        return 0
    print(f"server:       {context.server} (from {context.server_source})")
    if context.token is None:
        print(f"token:        none; {NO_TOKEN_MESSAGE.removeprefix('no admin token: ')}")
    else:
        print(f"token:        from {context.source}")
    print(f"context file: {path}" + ("" if path.exists() else " (none yet)"))
    return 0
