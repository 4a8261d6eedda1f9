"""``llmgw ctl tenants``, ``tenant create|limits|delete`` and ``keys [create|revoke]``: who may
call the gateway, and with what quota."""

from __future__ import annotations

import argparse
import sys
from urllib.parse import quote

from llmgw.ctl import render
from llmgw.ctl.subcommand import ClientFactory, add, add_json_flag, listing

KEYS_CREATE_EPILOG = """\
The key's secret is printed once, here, and never again: the server keeps only
its hash. Give it to the client now; if it is lost, revoke the key and make another.
"""


def add_parsers(commands, client: ClientFactory) -> None:
    tenants = add(commands, "tenants", "list the tenants, their limits and working keys", _tenants, client)
    add_json_flag(tenants)
    tenant = commands.add_parser(
        "tenant", help="one tenant: create, limits, delete", description="Commands about a single tenant."
    )
    tenant_commands = tenant.add_subparsers(dest="tenant_command", metavar="COMMAND", required=True)
    create = add(tenant_commands, "create", "create a tenant, with its quota", _tenant_create, client)
    create.add_argument("name", metavar="NAME", help="the tenant's name")
    _add_limit_flags(create, "the tenant's")
    add_json_flag(create)
    limits = add(
        tenant_commands,
        "limits",
        "replace a tenant's quota (a limit not given becomes unlimited)",
        _tenant_limits,
        client,
    )
    limits.add_argument("name", metavar="NAME", help="the tenant's name, as `llmgw ctl tenants` lists it")
    _add_limit_flags(limits, "the tenant's")
    add_json_flag(limits)
    delete = add(
        tenant_commands, "delete", "delete a tenant that has no working keys", _tenant_delete, client
    )
    delete.add_argument("name", metavar="NAME", help="the tenant's name, as `llmgw ctl tenants` lists it")
    add_json_flag(delete)

    keys = add(commands, "keys", "list the API keys (never their secrets); create, revoke", _keys, client)
    keys.add_argument("--tenant", metavar="TENANT", help="only this tenant's keys")
    add_json_flag(keys)
    key_commands = keys.add_subparsers(dest="keys_command", metavar="COMMAND")
    key_create = add(
        key_commands, "create", "make an API key and print its secret, once", _keys_create, client
    )
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
    add_json_flag(key_create)
    revoke = add(key_commands, "revoke", "revoke an API key: it fails from now on", _keys_revoke, client)
    revoke.add_argument("id", metavar="ID", help="the key's id, as `llmgw ctl keys` lists it")
    add_json_flag(revoke)


def _add_limit_flags(parser: argparse.ArgumentParser, whose: str) -> None:
    for flag, what in (
        ("--rpm", "requests per minute"),
        ("--tpm", "tokens per minute"),
        ("--tpd", "tokens per day"),
    ):
        parser.add_argument(flag, type=int, metavar="N", help=f"{whose} {what} (default: unlimited)")


def _limits_body(args: argparse.Namespace) -> dict:
    return {"rpm": args.rpm, "tpm": args.tpm, "tpd": args.tpd}


def _tenants(args: argparse.Namespace, client: ClientFactory) -> int:
    empty = "no tenants: make one with `llmgw ctl tenant create NAME`"
    return listing(client(args), args, "/admin/v1/tenants", "tenants", empty, render.tenants_table)


def _tenant_create(args: argparse.Namespace, client: ClientFactory) -> int:
    tenant = client(args).post("/admin/v1/tenants", {"name": args.name, "limits": _limits_body(args)})
    if args.json:
        render.print_json(tenant)
    else:
        print(f"tenant {tenant['name']}: created ({render.limits_text(tenant['limits'])})")
    return 0


def _tenant_limits(args: argparse.Namespace, client: ClientFactory) -> int:
    tenant = client(args).post(f"/admin/v1/tenants/{quote(args.name, safe='')}/limits", _limits_body(args))
    if args.json:
        render.print_json(tenant)
    else:
        print(f"tenant {tenant['name']}: {render.limits_text(tenant['limits'])}")
    return 0


def _tenant_delete(args: argparse.Namespace, client: ClientFactory) -> int:
    answer = client(args).delete(f"/admin/v1/tenants/{quote(args.name, safe='')}")
    if args.json:
        render.print_json(answer)
    else:
        print(f"tenant {args.name}: deleted")
    return 0


def _keys(args: argparse.Namespace, client: ClientFactory) -> int:
    path = "/admin/v1/keys" + ("" if args.tenant is None else f"?tenant={quote(args.tenant, safe='')}")
    empty = "no api keys: make one with `llmgw ctl keys create --tenant TENANT`"
    return listing(client(args), args, path, "keys", empty, render.keys_table)


def _keys_create(args: argparse.Namespace, client: ClientFactory) -> int:
    limits = _limits_body(args)
    body = {
        "tenant": args.tenant,
        "models": args.models,
        "band": args.band,
        "limits": limits if any(value is not None for value in limits.values()) else None,
    }
    key = client(args).post("/admin/v1/keys", body)
    if args.json:
        render.print_json(key)
        return 0
    print(f"api key {key['id']} for tenant {key['tenant']}: created")
    print(key["secret"])
    # On stderr, so that `ctl keys create ... > file` leaves only the secret in the file.
    print("warning: this secret will not be shown again; give it to the client now", file=sys.stderr)
    return 0


def _keys_revoke(args: argparse.Namespace, client: ClientFactory) -> int:
    key = client(args).delete(f"/admin/v1/keys/{quote(args.id, safe='')}")
    if args.json:
        render.print_json(key)
    else:
        print(f"api key {key['id']}: revoked")
    return 0
