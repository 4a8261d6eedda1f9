"""The admin API over real HTTP on 127.0.0.1, with a registry whose nodes have fake links."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import attrs
import pytest
import trio

import llmgw
from llmgw.core.liveness import Liveness
from llmgw.ctl.client import AdminClient, CtlError
from llmgw.server import api, tokens
from llmgw.server.api import serve_admin
from llmgw.server.nodes import NodeRegistry
from llmgw.server.store import AsyncStore
from llmgw.wire.messages import Gpu, Inventory, Ping, Pong, Register

ADMIN_TOKEN = "admin-secret"
ENGINE_SECRET = b"s" * 32

GPU_INVENTORY = Inventory(
    hostname="gpu-1",
    cpu_count=64,
    memory_total_mib=512_000,
    memory_available_mib=400_000,
    gpus=(
        Gpu(
            index=0,
            uuid="GPU-0",
            name="NVIDIA L40S",
            gpu_class="l40s-45g",
            memory_total_mib=46_068,
            memory_used_mib=1_000,
            compute_capability="8.9",
        ),
    ),
    fabric="ib-a",
)


class AnsweringSession:
    """A link whose agent answers every Ping with the same payload."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.closed: str | None = None

    async def call(self, command):
        assert isinstance(command, Ping)
        return Pong(reply_to=command.id, payload=command.payload, node=self.node)

    def close(self, reason: str) -> None:
        self.closed = reason


class SilentSession(AnsweringSession):
    """A link whose agent never answers."""

    async def call(self, command):
        await trio.sleep_forever()


class BrokenSession(AnsweringSession):
    """A link that fails in a way the API has no answer for."""

    async def call(self, command):
        raise RuntimeError("boom")


@attrs.frozen
class Api:
    url: str
    registry: NodeRegistry


@pytest.fixture
async def admin(tmp_path: Path, nursery):
    store = await AsyncStore.open(tmp_path / "data")
    registry = NodeRegistry(store, Liveness(interval=1.0, missed=3))
    await registry.attach(
        AnsweringSession("gpu-1"), Register(node="gpu-1", agent_version="0.1.0", inventory=GPU_INVENTORY)
    )
    await registry.attach(
        SilentSession("stuck-1"),
        Register(node="stuck-1", agent_version="0.1.0", inventory=attrs.evolve(GPU_INVENTORY, gpus=())),
    )
    port = await nursery.start(
        serve_admin, registry, tokens.digest(ADMIN_TOKEN), ENGINE_SECRET, "127.0.0.1", 0
    )
    yield Api(f"http://127.0.0.1:{port}", registry)
    nursery.cancel_scope.cancel()
    await store.aclose()


def _fetch(method: str, url: str, token: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def fetch(method: str, url: str, token: str | None = ADMIN_TOKEN) -> tuple[int, dict]:
    return await trio.to_thread.run_sync(_fetch, method, url, token)


async def test_healthz_needs_no_token(admin: Api):
    assert await fetch("GET", admin.url + "/healthz", token=None) == (
        200,
        {"status": "ok", "version": llmgw.__version__},
    )


@pytest.mark.parametrize("token", [None, "wrong-token"])
async def test_admin_paths_refuse_missing_or_wrong_token(admin: Api, token):
    for path in ("/admin/v1/nodes", "/admin/v1/nodes/gpu-1", "/admin/v1/no-such-thing"):
        status, body = await fetch("GET", admin.url + path, token=token)
        assert status == 401
        assert body["error"]["type"] == "unauthorized"
        assert "LLMGW_TOKEN" in body["error"]["message"]


async def test_unknown_path_is_a_json_404(admin: Api):
    status, body = await fetch("GET", admin.url + "/admin/v1/no-such-thing")
    assert status == 404
    assert body["error"]["type"] == "not_found"
    assert "/admin/v1/no-such-thing" in body["error"]["message"]


async def test_wrong_method_is_a_json_405(admin: Api):
    status, body = await fetch("DELETE", admin.url + "/admin/v1/nodes")
    assert status == 405
    assert body["error"]["type"] == "method_not_allowed"


async def test_nodes_lists_every_node_with_its_inventory(admin: Api):
    status, body = await fetch("GET", admin.url + "/admin/v1/nodes")
    assert status == 200
    assert [node["name"] for node in body["nodes"]] == ["gpu-1", "stuck-1"]
    gpu = body["nodes"][0]
    assert gpu["state"] == "online"
    assert gpu["connected"] is True
    assert gpu["agent_version"] == "0.1.0"
    assert gpu["first_seen"] <= gpu["last_seen"]
    assert isinstance(gpu["state_since"], float)
    assert gpu["inventory"]["fabric"] == "ib-a"
    assert gpu["inventory"]["gpus"][0]["gpu_class"] == "l40s-45g"
    assert body["nodes"][1]["inventory"]["gpus"] == []


async def test_one_node_and_an_unknown_one(admin: Api):
    status, body = await fetch("GET", admin.url + "/admin/v1/nodes/gpu-1")
    assert status == 200
    assert body["name"] == "gpu-1"
    assert body["inventory"]["hostname"] == "gpu-1"

    status, body = await fetch("GET", admin.url + "/admin/v1/nodes/nope")
    assert status == 404
    assert body["error"] == {"message": 'node "nope" not found', "type": "not_found"}


async def test_ping_gets_the_payload_back(admin: Api):
    status, body = await fetch("POST", admin.url + "/admin/v1/nodes/gpu-1/ping")
    assert status == 200
    assert body["node"] == "gpu-1"
    assert body["payload_ok"] is True
    assert body["rtt_ms"] >= 0


async def test_ping_of_unknown_node_is_404(admin: Api):
    status, body = await fetch("POST", admin.url + "/admin/v1/nodes/nope/ping")
    assert status == 404
    assert body["error"]["type"] == "not_found"


async def test_ping_of_disconnected_node_is_409(admin: Api):
    node = admin.registry.get("gpu-1")
    admin.registry.detach(node.session, "test")
    status, body = await fetch("POST", admin.url + "/admin/v1/nodes/gpu-1/ping")
    assert status == 409
    assert body["error"]["type"] == "node_unavailable"
    assert "not connected" in body["error"]["message"]


async def test_ping_that_gets_no_answer_is_504(admin: Api, monkeypatch):
    monkeypatch.setattr(api, "PING_TIMEOUT", 0.2)
    status, body = await fetch("POST", admin.url + "/admin/v1/nodes/stuck-1/ping")
    assert status == 504
    assert body["error"]["type"] == "timeout"
    assert "stuck-1" in body["error"]["message"]


async def test_unexpected_failure_is_a_json_500(admin: Api):
    await admin.registry.attach(
        BrokenSession("broken-1"), Register(node="broken-1", agent_version="0.1.0", inventory=GPU_INVENTORY)
    )
    status, body = await fetch("POST", admin.url + "/admin/v1/nodes/broken-1/ping")
    assert status == 500
    assert body["error"]["type"] == "internal"
    assert "RuntimeError" in body["error"]["message"]


async def test_ctl_client_against_the_api(admin: Api):
    client = AdminClient(admin.url, ADMIN_TOKEN)
    nodes = await trio.to_thread.run_sync(client.get, "/admin/v1/nodes")
    assert len(nodes["nodes"]) == 2
    pong = await trio.to_thread.run_sync(client.post, "/admin/v1/nodes/gpu-1/ping")
    assert pong["payload_ok"] is True

    with pytest.raises(CtlError) as refused:
        await trio.to_thread.run_sync(AdminClient(admin.url, "wrong").get, "/admin/v1/nodes")
    assert str(refused.value).startswith("missing or wrong admin token")
    with pytest.raises(CtlError) as missing:
        await trio.to_thread.run_sync(client.get, "/admin/v1/nodes/nope")
    assert str(missing.value) == 'server answered 404: node "nope" not found'


async def test_serve_admin_stops_when_cancelled(tmp_path: Path):
    store = await AsyncStore.open(tmp_path / "data")
    registry = NodeRegistry(store, Liveness(interval=1.0, missed=3))
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                serve_admin, registry, tokens.digest(ADMIN_TOKEN), ENGINE_SECRET, "127.0.0.1", 0
            )
            assert (await fetch("GET", f"http://127.0.0.1:{port}/healthz"))[0] == 200
            nursery.cancel_scope.cancel()
    await store.aclose()
    with pytest.raises(urllib.error.URLError):
        await fetch("GET", f"http://127.0.0.1:{port}/healthz")
