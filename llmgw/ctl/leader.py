"""``llmgw ctl leader``: which server leads the servers sharing a store (docs/ha.md)."""

from __future__ import annotations

import argparse

from llmgw.ctl import render
from llmgw.ctl.subcommand import ClientFactory, add, add_json_flag


def add_parsers(commands, client: ClientFactory) -> None:
    leader = add(
        commands,
        "leader",
        "which server leads (runs the reconciler and scaler), under which term, and the live servers",
        _leader,
        client,
    )
    add_json_flag(leader)


def _leader(args: argparse.Namespace, client: ClientFactory) -> int:
    answer = client(args).get("/admin/v1/leader")
    if args.json:
        render.print_json(answer)
    else:
        print(describe(answer))
    return 0


def describe(lease: dict) -> str:
    """The answer of GET /admin/v1/leader in a few lines (names printed as given: a terminal,
    not a page)."""
    live = lease.get("live_servers") or []
    if lease.get("leader"):
        head = f"this server ({lease.get('server') or 'its own store'}) leads, term {lease.get('term', 0)}"
    elif lease.get("holder"):
        head = (
            f"this server ({lease.get('server')}) follows {lease['holder']}"
            f" (agent link {lease.get('holder_address') or '?'}), term {lease.get('term', 0)}"
        )
    else:
        head = (
            f"nobody leads right now (term {lease.get('term', 0)}); a server takes the lease at its next look"
        )
    lines = [head]
    if live:
        lines.append(f"live servers: {', '.join(live)}")
    share = lease.get("quota_share")
    if share and share.get("servers", 1) > 1:
        lines.append(
            f"quotas: this server admits share {share['rank'] + 1} of {share['servers']} of every limit"
        )
    return "\n".join(lines)
