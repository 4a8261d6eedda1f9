"""The gateway as an OpenAI client sees it: the official SDK against the relay and the control
plane's gate (keys, models, quotas, admission), with a fake engine behind. Each error case arrives
as the SDK's own exception class, which is what applications catch."""

from __future__ import annotations

from functools import partial

import attrs
import openai
import pytest
import trio

from llmgw.core.quota import Limits
from llmgw.gateway import StaticRouter, serve_gateway
from llmgw.server.gate import ControlPlaneGate
from llmgw.server.routing import FixedRoutes
from tests.gateway.test_gateway_relay import ANSWER, FakeEngine, silent_reply, streaming_reply


@attrs.frozen
class Key:
    id: str
    tenant: str
    models: tuple[str, ...] = ()
    band: int = 0
    limits: Limits | None = None


@attrs.frozen
class Tenant:
    limits: Limits


class Keys:
    KEYS = {
        "llmgw-good": Key(id="k-good", tenant="acme"),  # every model
        "llmgw-narrow": Key(id="k-narrow", tenant="acme", models=("m",)),
        "llmgw-poor": Key(id="k-poor", tenant="poor", models=("m",)),
    }

    def authenticate(self, secret):
        return self.KEYS.get(secret)

    def tenant(self, name):
        return Tenant(Limits(rpm=1)) if name == "poor" else None


async def start(nursery: trio.Nursery, **options) -> str:
    routes = {
        "m": [await FakeEngine().start(nursery)],
        "stream": [await FakeEngine(streaming_reply()).start(nursery)],
        "slow": [await FakeEngine(silent_reply).start(nursery)],
        "none": [],
        "big": [await FakeEngine().start(nursery)],
    }
    router = StaticRouter(routes)
    # "none" has no replica: its request waits this long for one, then it is a 503.
    gate = ControlPlaneGate(Keys(), FixedRoutes(routes), queue_timeout=0.5)
    port = await nursery.start(
        partial(serve_gateway, router, "127.0.0.1", 0, gate=gate, upstream_timeout=0.5, **options)
    )
    return f"http://127.0.0.1:{port}/v1"


def sdk(base_url: str, key: str = "llmgw-good") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=20)


def ask(client: openai.OpenAI, model: str = "m", **extra):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], **extra)


async def in_thread(fn, *args, **kwargs):
    return await trio.to_thread.run_sync(partial(fn, *args, **kwargs))


async def test_chat_completions_streaming_and_models(nursery):
    base = await start(nursery)
    client = sdk(base)
    answer = await in_thread(ask, client)
    assert answer.choices[0].message.content == ANSWER["choices"][0]["message"]["content"]
    assert answer.usage.total_tokens == ANSWER["usage"]["total_tokens"]
    completion = await in_thread(client.completions.create, model="m", prompt="hi")
    assert completion.model_dump()["usage"]["total_tokens"] == ANSWER["usage"]["total_tokens"]

    chunks = await in_thread(lambda: list(ask(client, "stream", stream=True)))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    models = await in_thread(lambda: [m.id for m in client.models.list()])
    assert models == ["m", "stream", "slow", "none", "big"]
    narrow = await in_thread(lambda: [m.id for m in sdk(base, "llmgw-narrow").models.list()])
    assert narrow == ["m"]


@pytest.mark.parametrize(
    ("key", "model", "error", "status"),
    [
        ("llmgw-unknown", "m", openai.AuthenticationError, 401),
        ("llmgw-narrow", "slow", openai.PermissionDeniedError, 403),
        ("llmgw-good", "no-such-model", openai.NotFoundError, 404),
        ("llmgw-good", "none", openai.InternalServerError, 503),
        ("llmgw-good", "slow", openai.InternalServerError, 504),
    ],
)
async def test_each_error_arrives_as_the_sdks_exception(nursery, key, model, error, status):
    base = await start(nursery)
    with pytest.raises(error) as raised:
        await in_thread(ask, sdk(base, key), model)
    assert raised.value.status_code == status
    assert raised.value.body["message"]  # OpenAI-shaped: {"error": {"message", "type", "code"}}


async def test_quota_exhaustion_is_429_with_retry_after(nursery):
    base = await start(nursery)
    client = sdk(base, "llmgw-poor")
    await in_thread(ask, client)  # the tenant's one request per minute
    with pytest.raises(openai.RateLimitError) as raised:
        await in_thread(ask, client)
    assert int(raised.value.response.headers["retry-after"]) >= 1


async def test_a_body_too_large_is_413(nursery):
    base = await start(nursery, max_body_bytes=1000)
    with pytest.raises(openai.APIStatusError) as raised:
        await in_thread(ask, sdk(base), "big", extra_body={"padding": "x" * 2000})
    assert raised.value.status_code == 413
