"""Where ``llmgw ctl`` finds the server and the admin token.

Each of the two is looked up on its own, first match wins: the flag (``--server``, ``--token``),
the environment (``LLMGW_SERVER``, ``LLMGW_TOKEN``), then the context file that ``llmgw ctl
context set`` writes (``$LLMGW_CONTEXT``, else ``~/.config/llmgw/context.json``). The file holds
a token that administers the whole fleet, so it is written 0600 in a 0700 directory, and written
atomically so that an interrupted ``context set`` never leaves half a file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import attrs

from llmgw.ctl.client import CtlError

DEFAULT_SERVER = "http://127.0.0.1:7071"
SERVER_ENV = "LLMGW_SERVER"
TOKEN_ENV = "LLMGW_TOKEN"
CONTEXT_ENV = "LLMGW_CONTEXT"


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
