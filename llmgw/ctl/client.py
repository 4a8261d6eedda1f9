"""A small synchronous client for the admin API.

ctl runs one or two requests and exits, so plain ``urllib`` is enough; no event loop needed. Every
failure becomes a :class:`CtlError` whose message tells the operator what to do next.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

# Long enough for a node ping (the server gives the agent 5 s), short enough that a wrong
# address does not leave the operator staring at a silent prompt.
TIMEOUT = 10.0


class CtlError(Exception):
    """A ctl command failed; the message is for the operator and says what to do."""


class AdminClient:
    def __init__(self, server: str, token: str | None) -> None:
        self.server = server.rstrip("/")
        self._token = token

    def get(self, path: str) -> Any:
        return self._request("GET", path, None)

    def post(self, path: str, body: Any = None) -> Any:
        return self._request("POST", path, body)

    def delete(self, path: str) -> Any:
        return self._request("DELETE", path, None)

    def _request(self, method: str, path: str, body: Any) -> Any:
        url = self.server + path
        headers = {"Accept": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            raise CtlError(self._http_error_message(e)) from None
        except urllib.error.URLError as e:
            raise CtlError(self._unreachable_message(e.reason)) from None
        except TimeoutError:
            raise CtlError(f"the llmgw server at {self.server} did not answer within {TIMEOUT:g} s") from None
        except OSError as e:
            raise CtlError(self._unreachable_message(e)) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise CtlError(
                f"{url} answered with something that is not JSON: is --server pointing at llmgw's admin API?"
            ) from None

    def _unreachable_message(self, reason: object) -> str:
        if isinstance(reason, ConnectionRefusedError):
            why = "is `llmgw server` running?"
        elif isinstance(reason, TimeoutError):
            why = f"no answer within {TIMEOUT:g} s"
        else:
            why = str(getattr(reason, "strerror", None) or reason)
        return f"cannot reach the llmgw server at {self.server}: {why} (set --server or LLMGW_SERVER)"

    def _http_error_message(self, e: urllib.error.HTTPError) -> str:
        message = _server_message(e)
        if e.code == 401:
            return message  # the server's text already says how to pass the token
        return f"server answered {e.code}: {message}"


def _server_message(e: urllib.error.HTTPError) -> str:
    """The message of the admin API's error shape, or whatever else came back."""
    try:
        raw = e.read()
    except OSError:
        raw = b""
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        text = raw.decode(errors="replace").strip()
        # Something else answered (a proxy, another service): show a little of it.
        return text[:200] if text else str(e.reason)
