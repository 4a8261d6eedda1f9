"""A small synchronous client for the admin API.

ctl runs one or two requests and exits, so plain ``urllib`` is enough; no event loop needed. Every
failure becomes a :class:`CtlError` whose message tells the operator what to do next.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

# Bytes per read of a download: few reads, little memory.
DOWNLOAD_CHUNK = 256 * 1024

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

    def download(self, path: str, dest: Path) -> tuple[int, str]:
        """Streams ``path`` into the new file ``dest`` (0600; an existing file is not replaced);
        returns its size and sha256 (hex). A failed download leaves no file behind."""
        req = urllib.request.Request(self.server + path, headers=self._headers(), method="GET")
        digest, size = hashlib.sha256(), 0
        try:
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise CtlError(f"cannot write {dest}: {e.strerror}") from None
        try:
            with os.fdopen(fd, "wb") as out:
                try:
                    with urllib.request.urlopen(req, timeout=TIMEOUT) as response:
                        while chunk := response.read(DOWNLOAD_CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            size += len(chunk)
                except urllib.error.HTTPError as e:
                    raise CtlError(self._http_error_message(e)) from None
                except urllib.error.URLError as e:
                    raise CtlError(self._unreachable_message(e.reason)) from None
                except OSError as e:
                    raise CtlError(self._unreachable_message(e)) from None
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        return size, digest.hexdigest()

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _request(self, method: str, path: str, body: Any) -> Any:
        url = self.server + path
        headers = self._headers()
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
