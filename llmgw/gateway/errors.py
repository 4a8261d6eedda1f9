"""Errors as OpenAI clients expect them: ``{"error": {"message", "type", "param", "code"}}`` and a
status."""

from __future__ import annotations

import json


class GatewayError(Exception):
    """A request the gateway answers itself, with `status` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        type: str | None = None,
        retry_after: float | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after  # seconds, sent as Retry-After (quota, full queue)
        self.message = message
        self.code = code
        self.param = param  # the request member at fault, as OpenAI's errors name it
        # OpenAI's SDKs only look at the status to pick an exception class; the type is for people.
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode()
