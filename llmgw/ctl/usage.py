"""``llmgw ctl usage``: the usage account summarised, requests and tokens by tenant, model, adapter, day."""

from __future__ import annotations

import argparse
from urllib.parse import urlencode

from llmgw.ctl import render
from llmgw.ctl.subcommand import ClientFactory, add, add_json_flag


def add_parsers(commands, client: ClientFactory) -> None:
    usage = add(commands, "usage", "summarise the usage account: requests and tokens", _usage, client)
    usage.add_argument(
        "--by",
        default="tenant,model,day",
        metavar="GROUPS",
        help="comma-separated, of tenant, model, adapter, day (UTC); empty for one total "
        "(default: tenant,model,day)",
    )
    usage.add_argument(
        "--since", metavar="DATE", help="from this date or time (UTC unless it says), inclusive"
    )
    usage.add_argument("--until", metavar="DATE", help="to this date (the whole day) or time, exclusive")
    add_json_flag(usage)


def _usage(args: argparse.Namespace, client: ClientFactory) -> int:
    query = {"by": args.by, "since": args.since, "until": args.until}
    path = "/admin/v1/usage?" + urlencode({name: value for name, value in query.items() if value is not None})
    answer = client(args).get(path)
    if args.json:
        render.print_json(answer)
    elif not answer["usage"]:
        print("no usage recorded in that time")
    else:
        render.make_console().print(render.usage_table(answer["by"], answer["usage"]))
    return 0
