"""The admin API over real HTTP on 127.0.0.1, with a registry whose nodes have fake links."""

from __future__ import annotations

import functools
import json
import urllib.error
import urllib.request
from pathlib import Path

import attrs
import pytest
import trio

import llmgw
from llmgw.config import converter
from llmgw.core.catalog import Model, Profile
from llmgw.core.liveness import Liveness
from llmgw.core.quota import Limits
from llmgw.ctl.client import AdminClient, CtlError
from llmgw.server import api, tokens
from llmgw.server import api as api_module
from llmgw.server.api import serve_admin
from llmgw.server.catalog import Catalog
from llmgw.server.nodes import NodeRegistry
from llmgw.server.store import UsageRecord, open_store
from llmgw.server.tenants import Tenants
from llmgw.server.usage_book import UsageRecorder
from llmgw.wire.messages import Gpu, Inventory, Ping, Pong, Register
from tests.helpers import admin_call

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


# What server.yaml declares in these tests: owned by the config, so the API may not change it.
CONFIG_MODEL = Model(name="smollm2-135m", path="/models/smollm2.gguf", format="gguf")
CONFIG_PROFILE = Profile(
    name="smollm2-cpu", model="smollm2-135m", engine="llamacpp", gpu_class=None, memory_mib=1024
)


@attrs.frozen
class Api:
    url: str
    registry: NodeRegistry
    catalog: Catalog


@pytest.fixture
async def admin(tmp_path: Path, nursery):
    store = await open_store(tmp_path / "data")
    registry = NodeRegistry(store, Liveness(interval=1.0, missed=3))
    await registry.attach(
        AnsweringSession("gpu-1"), Register(node="gpu-1", agent_version="0.1.0", inventory=GPU_INVENTORY)
    )
    await registry.attach(
        SilentSession("stuck-1"),
        Register(node="stuck-1", agent_version="0.1.0", inventory=attrs.evolve(GPU_INVENTORY, gpus=())),
    )
    catalog = await Catalog.load(store, [CONFIG_MODEL], [CONFIG_PROFILE])
    port = await nursery.start(
        serve_admin, registry, catalog, tokens.digest(ADMIN_TOKEN), ENGINE_SECRET, "127.0.0.1", 0
    )
    yield Api(f"http://127.0.0.1:{port}", registry, catalog)
    nursery.cancel_scope.cancel()
    await store.aclose()


async def fetch(
    method: str, url: str, token: str | None = ADMIN_TOKEN, body: object = None
) -> tuple[int, dict]:
    return await trio.to_thread.run_sync(admin_call, method, url, token, body)


@pytest.fixture
def short_admin_timeouts(monkeypatch):
    monkeypatch.setattr(api_module, "ADMIN_READ_TIMEOUT", 1)
    monkeypatch.setattr(api_module, "ADMIN_KEEP_ALIVE_TIMEOUT", 1.0)


async def read_until_closed(stream: trio.SocketStream, within: float) -> bytes:
    answer = b""
    with trio.fail_after(within):
        while data := await stream.receive_some(65536):
            answer += data
    return answer


async def test_a_half_sent_head_and_an_idle_keep_alive_are_closed(short_admin_timeouts, admin: Api):
    port = int(admin.url.rsplit(":", 1)[1])
    silent = await trio.open_tcp_stream("127.0.0.1", port)
    await silent.send_all(b"GET /healthz HTTP/1.1\r\nhost: admin\r\n")  # and never the rest
    await read_until_closed(silent, within=15.0)
    await silent.aclose()
    idle = await trio.open_tcp_stream("127.0.0.1", port)
    await idle.send_all(b"GET /healthz HTTP/1.1\r\nhost: admin\r\n\r\n")
    assert (await read_until_closed(idle, within=15.0)).startswith(b"HTTP/1.1 200")
    await idle.aclose()


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
    assert gpu["registrations"] == 1
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
    store = await open_store(tmp_path / "data")
    registry = NodeRegistry(store, Liveness(interval=1.0, missed=3))
    catalog = await Catalog.load(store, [], [])
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                serve_admin, registry, catalog, tokens.digest(ADMIN_TOKEN), ENGINE_SECRET, "127.0.0.1", 0
            )
            assert (await fetch("GET", f"http://127.0.0.1:{port}/healthz"))[0] == 200
            nursery.cancel_scope.cancel()
    await store.aclose()
    with pytest.raises(urllib.error.URLError):
        await fetch("GET", f"http://127.0.0.1:{port}/healthz")


# --- the catalog ------------------------------------------------------------------------------

QWEN = {"name": "org/qwen", "path": "Qwen/Qwen2.5-7B-Instruct", "format": "safetensors"}
QWEN_PROFILE = {
    "name": "qwen-l40s",
    "model": "org/qwen",
    "engine": "vllm",
    "gpu_class": "l40s-45g",
    "gpus_per_node": 2,
    "tensor_parallel": 2,
    "memory_mib": 40_000,
    "max_replicas": 3,
    "startup_timeout": "15m",
}


async def apply(admin: Api, body: object) -> tuple[int, dict]:
    return await fetch("POST", admin.url + "/admin/v1/catalog", body=body)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/v1/models"),
        ("GET", "/admin/v1/profiles"),
        ("POST", "/admin/v1/catalog"),
        ("POST", "/admin/v1/profiles/smollm2-cpu/scale"),
        ("DELETE", "/admin/v1/models/smollm2-135m"),
        ("DELETE", "/admin/v1/profiles/smollm2-cpu"),
    ],
)
async def test_catalog_endpoints_need_the_token(admin: Api, method: str, path: str):
    status, body = await fetch(method, admin.url + path, token="wrong")
    assert (status, body["error"]["type"]) == (401, "unauthorized")
    assert len(admin.catalog.entries("profile")) == 1


async def test_listings_show_every_option_and_the_owner(admin: Api):
    status, body = await fetch("GET", admin.url + "/admin/v1/models")
    assert status == 200
    [model] = body["models"]
    assert {k: model[k] for k in ("name", "path", "format", "source", "used_by")} == {
        "name": "smollm2-135m",
        "path": "/models/smollm2.gguf",
        "format": "gguf",
        "source": "config",
        "used_by": ["smollm2-cpu"],
    }
    status, body = await fetch("GET", admin.url + "/admin/v1/profiles")
    [profile] = body["profiles"]
    assert profile["name"] == "smollm2-cpu"
    assert profile["gpu_class"] is None
    assert profile["startup_timeout"] == 600.0
    assert profile["flags"] == [] and profile["adapters"] == []
    assert profile["source"] == "config"
    assert isinstance(profile["updated"], float)
    # No scaler and no gateway behind this app: nothing is known of the wanted count yet.
    assert profile["scale"] == {"wanted": None, "reason": "", "waiting": 0}


async def test_apply_creates_then_reports_unchanged(admin: Api):
    status, body = await apply(admin, {"models": [QWEN], "profiles": [QWEN_PROFILE]})
    assert status == 200
    assert body["changes"] == [
        {"kind": "model", "name": "org/qwen", "change": "created"},
        {"kind": "profile", "name": "qwen-l40s", "change": "created"},
    ]
    assert admin.catalog.profiles()["qwen-l40s"].startup_timeout == 900.0

    status, body = await apply(admin, {"profiles": [{**QWEN_PROFILE, "band": 5}], "models": [QWEN]})
    assert [change["change"] for change in body["changes"]] == ["unchanged", "updated"]

    status, body = await fetch("GET", admin.url + "/admin/v1/profiles")
    assert [(p["name"], p["source"], p["band"]) for p in body["profiles"]] == [
        ("qwen-l40s", "api", 5),
        ("smollm2-cpu", "config", 0),
    ]


async def test_apply_reports_every_problem_by_field_and_changes_nothing(admin: Api):
    bad_profile = {**QWEN_PROFILE, "model": "nope", "memory_mib": 0, "tensor_parallel": "2"}
    status, body = await apply(
        admin, {"models": [{**QWEN, "format": "onnx"}, 7], "profiles": [bad_profile], "extra": []}
    )
    assert status == 400
    assert body["error"]["type"] == "invalid_request"
    assert body["error"]["problems"] == [
        "extra: unknown key (expected one of: models, profiles)",
        "models[1]: expected a mapping of options, got 7",
        'profiles.qwen-l40s.tensor_parallel: expected an integer, got "2"',
    ]
    assert body["error"]["message"].startswith("nothing was applied:\n  extra: unknown key")

    # Well-formed, but wrong against the catalog: every reason at once.
    bad_profile["tensor_parallel"] = 2
    status, body = await apply(admin, {"models": [{**QWEN, "format": "onnx"}], "profiles": [bad_profile]})
    assert status == 400
    assert body["error"]["problems"] == [
        "models.org/qwen.format: 'onnx' is not one of gguf, safetensors",
        "profiles.qwen-l40s.memory_mib: must be at least 1, not 0",
        "profiles.qwen-l40s.model: no model named 'nope' in the catalog",
    ]
    assert list(admin.catalog.models()) == ["smollm2-135m"]


async def test_apply_names_a_nameless_entry_by_its_place(admin: Api):
    status, body = await apply(admin, {"profiles": [QWEN_PROFILE, {"model": "x"}]})
    assert status == 400
    assert "profiles[1].name: expected the entry's name, got null" in body["error"]["problems"]


async def test_apply_refuses_entries_that_server_yaml_owns(admin: Api):
    status, body = await apply(admin, {"profiles": [{**converter.unstructure(CONFIG_PROFILE), "band": 3}]})
    assert status == 409
    assert body["error"]["type"] == "conflict"
    assert body["error"]["message"] == (
        "profiles.smollm2-cpu: declared in server.yaml; change it there and restart the server"
    )
    assert admin.catalog.profiles()["smollm2-cpu"].band == 0


async def test_apply_without_a_json_body(admin: Api):
    status, body = await fetch("POST", admin.url + "/admin/v1/catalog")
    assert status == 400
    assert body["error"]["message"] == "expected a JSON object with models and profiles, got null"


async def test_scale(admin: Api):
    await apply(admin, {"models": [QWEN], "profiles": [QWEN_PROFILE]})
    url = admin.url + "/admin/v1/profiles/qwen-l40s/scale"
    status, body = await fetch("POST", url, body={"replicas": 2})
    assert status == 200
    assert (body["name"], body["min_replicas"], body["max_replicas"]) == ("qwen-l40s", 2, 2)
    status, body = await fetch("POST", url, body={"max_replicas": 4})
    assert (body["min_replicas"], body["max_replicas"]) == (2, 4)
    assert admin.catalog.profiles()["qwen-l40s"].max_replicas == 4


@pytest.mark.parametrize(
    ("request_body", "problems"),
    [
        ({"min_replicas": 5}, ["profiles.qwen-l40s.min_replicas: 5 is above max_replicas 3"]),
        ({"replicas": -1}, ["profiles.qwen-l40s.min_replicas: must be at least 0, not -1",
                            "profiles.qwen-l40s.max_replicas: must be at least 0, not -1"]),
        ({"replicas": "2"}, ['replicas: expected an integer, got "2"']),
        ({"replicas": True}, ["replicas: expected an integer, got true"]),
        ({"replicas": 1, "max_replicas": 2},
         ["replicas: give replicas alone, or min_replicas and max_replicas, not both"]),
        ({"count": 1}, ["count: unknown key (expected one of: replicas, min_replicas, max_replicas)"]),
        ({}, ['expected a JSON object: {"replicas": n}, or {"min_replicas": n, "max_replicas": m}']),
    ],
)  # fmt: skip
async def test_scale_refuses_bad_bounds(admin: Api, request_body: dict, problems: list[str]):
    await apply(admin, {"models": [QWEN], "profiles": [QWEN_PROFILE]})
    status, body = await fetch("POST", admin.url + "/admin/v1/profiles/qwen-l40s/scale", body=request_body)
    assert status == 400
    assert body["error"]["problems"] == problems
    assert admin.catalog.profiles()["qwen-l40s"].max_replicas == 3


async def test_scale_unknown_and_config_owned_profiles(admin: Api):
    status, body = await fetch("POST", admin.url + "/admin/v1/profiles/nope/scale", body={"replicas": 1})
    assert (status, body["error"]["message"]) == (404, 'no profile named "nope"')
    status, body = await fetch(
        "POST", admin.url + "/admin/v1/profiles/smollm2-cpu/scale", body={"replicas": 2}
    )
    assert status == 409
    assert body["error"]["message"] == (
        'profile "smollm2-cpu" is declared in server.yaml; change min_replicas and max_replicas there '
        "and restart the server"
    )


async def test_delete(admin: Api):
    await apply(admin, {"models": [QWEN], "profiles": [QWEN_PROFILE]})
    # A model name with a slash travels percent-encoded, as ctl sends it.
    model_url = admin.url + "/admin/v1/models/org%2Fqwen"
    status, body = await fetch("DELETE", model_url)
    assert status == 409
    assert (
        body["error"]["message"]
        == 'model "org/qwen" is used by profile qwen-l40s; delete or change those first'
    )

    status, body = await fetch("DELETE", admin.url + "/admin/v1/profiles/qwen-l40s")
    assert (status, body) == (200, {"deleted": {"kind": "profile", "name": "qwen-l40s"}})
    status, body = await fetch("DELETE", model_url)
    assert (status, body) == (200, {"deleted": {"kind": "model", "name": "org/qwen"}})

    status, body = await fetch("DELETE", model_url)
    assert (status, body["error"]) == (
        404,
        {
            "message": 'no model named "org/qwen"',
            "type": "not_found",
            "problems": ['no model named "org/qwen"'],
        },
    )


async def test_delete_refuses_config_entries(admin: Api):
    status, body = await fetch("DELETE", admin.url + "/admin/v1/profiles/smollm2-cpu")
    assert (status, body["error"]["type"]) == (409, "conflict")
    assert body["error"]["message"] == (
        'profile "smollm2-cpu" is declared in server.yaml; remove it there and restart the server'
    )
    status, body = await fetch("DELETE", admin.url + "/admin/v1/models/smollm2-135m")
    assert status == 409
    assert list(admin.catalog.profiles()) == ["smollm2-cpu"]


# --- tenants, api keys and usage ----------------------------------------------------------------


@attrs.frozen
class TenantApi:
    url: str
    tenants: Tenants
    usage: UsageRecorder


@pytest.fixture
async def tenant_admin(tmp_path: Path, nursery):
    store = await open_store(tmp_path / "data")
    registry = NodeRegistry(store, Liveness(interval=1.0, missed=3))
    catalog = await Catalog.load(store, [], [])
    tenants = await Tenants.load(store)
    # Short, so a test waiting for a commit waits little; it waits for the commit, not the time.
    usage = UsageRecorder(store, flush_interval=0.05)
    await nursery.start(usage.run)
    port = await nursery.start(
        functools.partial(serve_admin, tenants=tenants, usage=usage),
        registry,
        catalog,
        tokens.digest(ADMIN_TOKEN),
        ENGINE_SECRET,
        "127.0.0.1",
        0,
    )
    yield TenantApi(f"http://127.0.0.1:{port}", tenants, usage)
    nursery.cancel_scope.cancel()
    await store.aclose()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/v1/tenants"),
        ("POST", "/admin/v1/tenants"),
        ("DELETE", "/admin/v1/tenants/acme"),
        ("POST", "/admin/v1/tenants/acme/limits"),
        ("GET", "/admin/v1/keys"),
        ("POST", "/admin/v1/keys"),
        ("DELETE", "/admin/v1/keys/k-00000000"),
        ("GET", "/admin/v1/usage"),
    ],
)
async def test_tenant_endpoints_need_the_token(tenant_admin: TenantApi, method: str, path: str):
    status, body = await fetch(method, tenant_admin.url + path, token=None, body={"name": "acme"})
    assert (status, body["error"]["type"]) == (401, "unauthorized")
    assert tenant_admin.tenants.list_tenants() == []


async def test_tenants_are_created_listed_limited_and_refused(tenant_admin: TenantApi):
    url = tenant_admin.url + "/admin/v1/tenants"
    status, tenant = await fetch("POST", url, body={"name": "acme", "limits": {"rpm": 60}})
    assert status == 201
    assert tenant == {
        "name": "acme",
        "limits": {"rpm": 60, "tpm": None, "tpd": None},
        "created": tenant["created"],
        "active_keys": 0,
    }
    assert await fetch("GET", url) == (200, {"tenants": [tenant]})

    status, body = await fetch("POST", url, body={"name": "acme"})
    assert (status, body["error"]["message"]) == (409, 'tenant "acme" already exists')
    status, body = await fetch("POST", url, body={"name": "acme", "limits": {"rpm": 0}, "colour": "red"})
    assert (status, body["error"]["message"]) == (
        400,
        "colour: unknown field (expected one of: name, limits)",
    )
    status, body = await fetch("POST", url, body={"name": "b", "limits": {"rpm": 0}})
    assert (status, body["error"]["message"]) == (
        400,
        "limits.rpm: expected a whole number of at least 1, or null, got 0",
    )
    status, body = await fetch("POST", url, body={"name": 5})
    assert (status, body["error"]["message"]) == (400, "name: expected a string, got 5")

    status, body = await fetch("POST", url + "/acme/limits", body={"tpm": 1000})
    assert (status, body["limits"]) == (200, {"rpm": None, "tpm": 1000, "tpd": None})
    status, _ = await fetch("POST", url + "/nobody/limits", body={})
    assert status == 404


async def test_a_key_secret_is_shown_once_and_works_until_revoked(tenant_admin: TenantApi):
    await fetch("POST", tenant_admin.url + "/admin/v1/tenants", body={"name": "acme"})
    status, created = await fetch(
        "POST",
        tenant_admin.url + "/admin/v1/keys",
        body={"tenant": "acme", "models": ["org/qwen"], "band": 1, "limits": {"tpd": 5000}},
    )
    assert status == 201
    secret = created.pop("secret")
    assert created == {
        "id": created["id"],
        "tenant": "acme",
        "models": ["org/qwen"],
        "band": 1,
        "limits": {"rpm": None, "tpm": None, "tpd": 5000},
        "created": created["created"],
        "revoked": None,
    }
    assert tenant_admin.tenants.authenticate(secret).id == created["id"]

    status, listing = await fetch("GET", tenant_admin.url + "/admin/v1/keys?tenant=acme")
    assert (status, listing) == (200, {"keys": [created]})
    assert secret not in json.dumps(listing)
    status, body = await fetch("GET", tenant_admin.url + "/admin/v1/keys?tenant=nobody")
    assert (status, body["error"]["message"]) == (404, 'tenant: no tenant "nobody"')

    status, body = await fetch("DELETE", tenant_admin.url + "/admin/v1/tenants/acme")
    assert status == 409
    assert (
        body["error"]["message"]
        == f'tenant "acme" still has working keys ({created["id"]}); revoke them first'
    )

    status, revoked = await fetch("DELETE", tenant_admin.url + f"/admin/v1/keys/{created['id']}")
    assert status == 200 and revoked["revoked"] is not None
    assert tenant_admin.tenants.authenticate(secret) is None
    assert (await fetch("DELETE", tenant_admin.url + "/admin/v1/keys/k-99999999"))[0] == 404

    status, body = await fetch("DELETE", tenant_admin.url + "/admin/v1/tenants/acme")
    assert (status, body) == (200, {"deleted": {"tenant": "acme"}})
    assert (await fetch("DELETE", tenant_admin.url + "/admin/v1/tenants/acme"))[0] == 404


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"models": []}, "tenant: expected a tenant's name, got null"),
        ({"tenant": "nobody"}, 'tenant: no tenant "nobody"'),
        ({"tenant": "acme", "models": "org/qwen"}, 'models: expected a list of model names, got "org/qwen"'),
        ({"tenant": "acme", "band": "high"}, 'band: expected an integer, got "high"'),
        ({"tenant": "acme", "limits": {"tpm": -1}}, "limits.tpm: expected a whole number of at least 1"),
        ([], 'expected a JSON object like {"tenant": "acme"}'),
    ],
)
async def test_bad_key_requests_name_the_field(tenant_admin: TenantApi, body, message):
    await tenant_admin.tenants.create_tenant("acme", Limits())
    status, answer = await fetch("POST", tenant_admin.url + "/admin/v1/keys", body=body)
    assert status in (400, 404)
    assert answer["error"]["message"].startswith(message)
    assert tenant_admin.tenants.list_keys() == []


async def test_a_body_nested_too_deeply_is_a_400_not_a_500(tenant_admin: TenantApi):
    """json raises RecursionError, not ValueError, past the recursion limit (found by fuzzing the
    gateway's bodies): the admin API answers the client's mistake as one."""

    def post() -> tuple[int, dict]:
        request = urllib.request.Request(
            tenant_admin.url + "/admin/v1/tenants",
            data=b"[" * 5000 + b"]" * 5000,
            method="POST",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as refused:
            return refused.code, json.loads(refused.read())

    status, answer = await trio.to_thread.run_sync(post)
    assert status == 400 and "nested too deeply" in answer["error"]["message"], answer
    assert tenant_admin.tenants.list_tenants() == []


async def test_usage_is_summarised(tenant_admin: TenantApi):
    day = 1_793_534_400.0  # 2026-11-01 12:00 UTC
    seen = tenant_admin.usage.flushes.version
    for tenant, model, status in (("acme", "a", 200), ("acme", "b", 500), ("beta", "a", 200)):
        tenant_admin.usage.record(UsageRecord(day, tenant, "k-00000001", model, "r-1", 10, 5, 20.0, status))
    with trio.fail_after(10):
        await tenant_admin.usage.flushes.wait_past(seen)

    status, body = await fetch("GET", tenant_admin.url + "/admin/v1/usage?by=tenant&since=2026-11-01")
    assert status == 200
    assert body["by"] == ["tenant"]
    assert [(r["tenant"], r["requests"], r["total_tokens"], r["errors"]) for r in body["usage"]] == [
        ("acme", 2, 30, 1),
        ("beta", 1, 15, 0),
    ]
    status, body = await fetch("GET", tenant_admin.url + "/admin/v1/usage")
    assert [(r["tenant"], r["model"], r["day"]) for r in body["usage"]] == [
        ("acme", "a", "2026-11-01"),
        ("acme", "b", "2026-11-01"),
        ("beta", "a", "2026-11-01"),
    ]
    status, body = await fetch("GET", tenant_admin.url + "/admin/v1/usage?until=2026-10-31")
    assert (status, body["usage"]) == (200, [])
    status, body = await fetch("GET", tenant_admin.url + "/admin/v1/usage?by=replica")
    assert status == 400
    assert body["error"]["message"].startswith("by: cannot group by replica")
    status, body = await fetch("GET", tenant_admin.url + "/admin/v1/usage?since=soon")
    assert (status, body["error"]["message"]) == (
        400,
        "since: expected a date (2026-11-01) or a date and time, got 'soon'",
    )
