"""Where ``llmgw ctl`` finds the server and the admin token.

Each of the two is looked up on its own, first match wins: the flag (``--server``, ``--token``),
the environment (``LLMGW_SERVER``, ``LLMGW_TOKEN``), then the context file that ``llmgw ctl
context set`` writes (``$LLMGW_CONTEXT``, else ``~/.config/llmgw/context.json``). The file holds
a token that administers the whole fleet, so it is written 0600 in a 0700 directory, and written
atomically so that an interrupted ``context set`` never leaves half a file.

``llmgw ctl context set|show``, the commands that write and explain this, are at the end.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import tempfile
from pathlib import Path

import attrs

from llmgw.ctl import render
from llmgw.ctl.client import CtlError
from llmgw.ctl.subcommand import add, add_json_flag

DEFAULT_SERVER = "http://127.0.0.1:7071"
SERVER_ENV = "LLMGW_SERVER"
TOKEN_ENV = "LLMGW_TOKEN"
CONTEXT_ENV = "LLMGW_CONTEXT"

NO_TOKEN_MESSAGE = (
    "no admin token: pass --token, set LLMGW_TOKEN, or run `llmgw ctl context set --server URL "
    "--token-file FILE` (the server writes the token to admin-token in its data directory)"
)

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


@attrs.frozen
class Context:
    server: str
    token: str | None  # None: no flag, variable or file gave one
    source: str  # where the token came from, for `ctl context show` (never the token itself)
    server_source: str


def context_path() -> Path:
    explicit = os.environ.get(CONTEXT_ENV)
    if explicit:
        return Path(explicit)
    return Path.home() / ".config" / "llmgw" / "context.json"


def resolve(server_flag: str | None, token_flag: str | None) -> Context:
    server, server_source = _first(server_flag, "--server", SERVER_ENV)
    token, source = _first(token_flag, "--token", TOKEN_ENV)
    if server is None or token is None:
        # Read only when needed: a broken file must not stop someone who passes both flags.
        path = context_path()
        saved = load_context(path)
        if server is None and saved.get("server"):
            server, server_source = saved["server"], str(path)
        if token is None and saved.get("token"):
            token, source = saved["token"], str(path)
    if server is None:
        server, server_source = DEFAULT_SERVER, "the built-in default"
    return Context(
        server=normalize_server(server), token=token, source=source or "none", server_source=server_source
    )


def normalize_server(server: str) -> str:
    """``host:port`` is taken to mean plain HTTP; a trailing slash would double up in paths."""
    server = server.strip()
    if "://" not in server:
        server = "http://" + server
    return server.rstrip("/")


def load_context(path: Path) -> dict[str, str]:
    """The saved context, or {} when there is no file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise CtlError(f"cannot read the context file {path}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise CtlError(
            f"the context file {path} is not valid JSON ({e}); fix it, or rewrite it with "
            "`llmgw ctl context set`"
        ) from None
    if not isinstance(data, dict) or not all(
        isinstance(data.get(key, ""), str) for key in ("server", "token")
    ):
        raise CtlError(
            f'the context file {path} should be a JSON object with string fields "server" and '
            '"token"; rewrite it with `llmgw ctl context set`'
        )
    return data


def save_context(server: str, token: str, path: Path | None = None) -> Path:
    """Writes the context file (0600, in a 0700 directory) and returns where."""
    path = path or context_path()
    try:
        if not path.parent.exists():
            path.parent.mkdir(parents=True, mode=0o700)
            os.chmod(path.parent, 0o700)  # mkdir's mode passes through the umask
        # mkstemp creates the file 0600 in the target's directory, so os.replace is atomic and the
        # token is never readable by others, not even for a moment.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".context-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"server": normalize_server(server), "token": token}, f, indent=2)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        raise CtlError(f"cannot write the context file {path}: {e}") from None
    return path


def _first(flag: str | None, flag_name: str, env_name: str) -> tuple[str | None, str]:
    if flag:
        return flag, flag_name
    value = os.environ.get(env_name)
    if value:
        return value, f"${env_name}"
    return None, ""


# --- `llmgw ctl context set|show` ------------------------------------------------------------


def add_parsers(commands) -> None:
    context = commands.add_parser(
        "context",
        help="save or show where ctl finds the server and the token",
        description="Where ctl finds the server and the admin token.",
    )
    context_commands = context.add_subparsers(dest="context_command", metavar="COMMAND", required=True)
    context_set = add(context_commands, "set", "save the server and the admin token", _context_set)
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
    context_show = add(
        context_commands,
        "show",
        "print the server and where the token comes from (never the token)",
        _context_show,
    )
    add_json_flag(context_show)


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
