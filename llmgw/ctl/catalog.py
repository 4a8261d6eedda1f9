"""``llmgw ctl models|profiles|apply|scale|delete``: the catalog, what it serves and how."""

from __future__ import annotations

import argparse
from pathlib import Path
from urllib.parse import quote

from llmgw.config import ConfigError, converter, parse_catalog_file
from llmgw.ctl import render
from llmgw.ctl.client import CtlError
from llmgw.ctl.subcommand import ClientFactory, add, add_json_flag, read_text

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


def add_parsers(commands, client: ClientFactory) -> None:
    models = add(commands, "models", "list the catalog's models and the profiles using each", _models, client)
    add_json_flag(models)
    profiles = add(
        commands, "profiles", "list the catalog's profiles: how each model is served", _profiles, client
    )
    add_json_flag(profiles)

    apply = add(commands, "apply", "create or replace catalog entries from a YAML file", _apply, client)
    apply.description = APPLY_DESCRIPTION
    apply.add_argument("-f", "--file", type=Path, metavar="FILE", required=True, help="the catalog file")
    add_json_flag(apply)

    scale = add(commands, "scale", "set how many replicas a profile runs", _scale, client)
    scale.add_argument(
        "profile", metavar="PROFILE", help="the profile's name, as `llmgw ctl profiles` lists it"
    )
    scale.add_argument("--replicas", type=int, metavar="N", help="exactly N replicas (min and max both N)")
    scale.add_argument("--min", type=int, metavar="N", help="at least N replicas")
    scale.add_argument("--max", type=int, metavar="M", help="at most M replicas")
    add_json_flag(scale)

    delete = add(commands, "delete", "remove a model or a profile from the catalog", _delete, client)
    delete.add_argument("kind", choices=("model", "profile"), help="what to remove")
    delete.add_argument("name", metavar="NAME", help="its name, as `llmgw ctl models` or `profiles` lists it")
    add_json_flag(delete)


def _models(args: argparse.Namespace, client: ClientFactory) -> int:
    answer = client(args).get("/admin/v1/models")
    if args.json:
        render.print_json(answer)
    elif not answer["models"]:
        print(f"no models in the catalog: {NO_CATALOG_HINT}")
    else:
        render.make_console().print(render.models_table(answer["models"]))
    return 0


def _profiles(args: argparse.Namespace, client: ClientFactory) -> int:
    answer = client(args).get("/admin/v1/profiles")
    if args.json:
        render.print_json(answer)
    elif not answer["profiles"]:
        print(f"no profiles in the catalog: {NO_CATALOG_HINT}")
    else:
        render.make_console().print(render.profiles_table(answer["profiles"]))
    return 0


def _apply(args: argparse.Namespace, client: ClientFactory) -> int:
    path: Path = args.file
    text = read_text(path)
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
    answer = client(args).post("/admin/v1/catalog", body)
    if args.json:
        render.print_json(answer)
    else:
        for change in answer["changes"]:
            print(f"{change['kind']} {change['name']}: {change['change']}")
    return 0


def _scale(args: argparse.Namespace, client: ClientFactory) -> int:
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
    profile = client(args).post(f"/admin/v1/profiles/{quote(args.profile, safe='')}/scale", body)
    if args.json:
        render.print_json(profile)
    else:
        print(f"profile {profile['name']}: {profile['min_replicas']}–{profile['max_replicas']} replicas")
    return 0


def _delete(args: argparse.Namespace, client: ClientFactory) -> int:
    answer = client(args).delete(f"/admin/v1/{args.kind}s/{quote(args.name, safe='')}")
    if args.json:
        render.print_json(answer)
    else:
        print(f"{args.kind} {args.name}: deleted")
    return 0
