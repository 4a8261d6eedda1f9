"""The status pages in process (quart's test client): login and sessions, what a session may
read, the security headers, and that names reach the browser only as data."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from quart_trio import QuartTrio

from llmgw.core.liveness import Liveness
from llmgw.core.sessions import SESSION_LIFETIME, session_digest
from llmgw.gateway import RequestRecord
from llmgw.gateway.metrics import GatewayMetrics, traffic_totals
from llmgw.server import tokens
from llmgw.server.api import make_app
from llmgw.server.catalog import Catalog
from llmgw.server.jobs import JobManager
from llmgw.server.nodes import NodeRegistry
from llmgw.server.store import UsageRecord, open_store
from llmgw.server.tenants import Tenants
from llmgw.server.ui import (
    CONTENT_SECURITY_POLICY,
    COOKIE,
    OVERVIEW_REPLICAS,
    PAGES,
    READABLE,
    STATIC,
    StatusPages,
)
from llmgw.server.usage_book import UsageRecorder
from llmgw.wire.messages import Register
from tests.helpers import wait_for
from tests.server.test_api import CONFIG_MODEL, CONFIG_PROFILE, GPU_INVENTORY, AnsweringSession

ADMIN_TOKEN = "admin-secret"
SCRIPT_TENANT = "<script>document.title='pwned'</script>"
UI_ROOT = Path(__file__).resolve().parents[2] / "llmgw" / "server" / "ui" / "static"


@pytest.fixture
async def app(tmp_path: Path, nursery):
    store = await open_store(tmp_path / "data")
    registry = NodeRegistry(store, Liveness(interval=1.0, missed=3))
    await registry.attach(
        AnsweringSession("gpu-1"), Register(node="gpu-1", agent_version="0.1.0", inventory=GPU_INVENTORY)
    )
    catalog = await Catalog.load(store, [CONFIG_MODEL], [CONFIG_PROFILE])
    usage = UsageRecorder(store, flush_interval=0.01)
    await nursery.start(usage.run)
    usage.record(UsageRecord(1.0e9, SCRIPT_TENANT, "k-1", "smollm2-135m", "", 3, 4, 5.0, 200))
    await wait_for(lambda: usage.written == 1, "the usage record written")
    jobs = JobManager(store, registry, catalog, tmp_path / "data")
    await jobs.load()
    yield make_app(
        registry,
        catalog,
        tokens.digest(ADMIN_TOKEN),
        usage=usage,
        tenants=await Tenants.load(store),
        jobs=jobs,
        queue_depths=lambda: {"smollm2-135m": {0: 2, 5: 1}},
        traffic=lambda: (10.0, 1.0, 2.0),
    )
    nursery.cancel_scope.cancel()
    await store.aclose()


async def login(client) -> str:
    response = await client.post("/login", form={"token": ADMIN_TOKEN})
    assert response.status_code == 303, await response.get_data(as_text=True)
    cookie = response.headers["Set-Cookie"]
    return re.match(rf"{COOKIE}=([^;]+);", cookie).group(1)


async def test_root_without_session_is_the_login_form(app):
    client = app.test_client()
    response = await client.get("/")
    body = await response.get_data(as_text=True)
    assert response.status_code == 200
    assert '<form method="post" action="/login"' in body
    assert 'name="token"' in body and 'type="password"' in body
    assert "data-page" not in body  # not the overview
    assert response.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY


async def test_login_with_the_token_gives_an_httponly_strict_cookie_that_the_server_keeps_hashed(app):
    client = app.test_client()
    response = await client.post("/login", form={"token": ADMIN_TOKEN})
    assert response.status_code == 303 and response.headers["Location"] == "/"
    cookie = response.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    assert f"Max-Age={int(SESSION_LIFETIME)}" in cookie
    session_id = re.match(rf"{COOKIE}=([^;]+);", cookie).group(1)
    assert ADMIN_TOKEN not in cookie and len(session_id) >= 40
    book = app.status_pages.sessions
    assert len(book) == 1
    # Only the digest is kept: nothing in the book is the id itself.
    assert book.valid(session_digest(session_id), 0.0)
    assert session_id not in repr(book)
    # The session's GET / is the overview page.
    page = await client.get("/")
    assert page.status_code == 200 and 'data-page="overview"' in await page.get_data(as_text=True)


@pytest.mark.parametrize("token", ["", "wrong", ADMIN_TOKEN + "x"])
async def test_a_wrong_token_opens_no_session(app, token):
    client = app.test_client()
    response = await client.post("/login", form={"token": token})
    assert response.status_code == 401
    assert "Set-Cookie" not in response.headers
    assert "not the admin token" in await response.get_data(as_text=True) or not token
    assert len(app.status_pages.sessions) == 0


@pytest.mark.parametrize("origin", ["http://evil.example", "null"])
async def test_a_login_posted_from_another_site_is_refused(app, origin):
    client = app.test_client()
    response = await client.post("/login", form={"token": ADMIN_TOKEN}, headers={"Origin": origin})
    assert response.status_code == 403
    assert "Set-Cookie" not in response.headers
    # The page's own origin is let in.
    own = await client.post("/login", form={"token": ADMIN_TOKEN}, headers={"Origin": "http://localhost"})
    assert own.status_code == 303


async def test_every_page_and_api_read_is_refused_without_a_session(app):
    client = app.test_client()
    for page in PAGES:
        response = await client.get(f"/ui/{page}")
        body = await response.get_data(as_text=True)
        assert response.status_code == 401, page
        assert "data-page" not in body and "Log in" in body
    for path in sorted(READABLE):
        response = await client.get(path)
        assert response.status_code == 401, path
    # A forged cookie is no session either.
    client = app.test_client()
    for path in ("/ui/nodes", "/admin/v1/overview"):
        response = await client.get(path, headers={"Cookie": f"{COOKIE}=made-up"})
        assert response.status_code == 401, path


async def test_a_session_reads_every_page_and_what_they_read_but_writes_nothing(app):
    client = app.test_client()
    await login(client)
    for page in PAGES:
        response = await client.get(f"/ui/{page}")
        body = await response.get_data(as_text=True)
        assert response.status_code == 200, page
        assert f'data-page="{page}"' in body
        assert response.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
        assert response.headers["X-Frame-Options"] == "DENY"
    for path in sorted(READABLE):
        response = await client.get(path)
        assert response.status_code == 200, (path, await response.get_data(as_text=True))
        assert response.content_type == "application/json"
    # Writes and secrets still need the bearer token.
    refused = [
        ("POST", "/admin/v1/tenants", {"name": "acme"}),
        ("POST", "/admin/v1/catalog", {}),
        ("GET", "/admin/v1/replicas/r-1/engine-key", None),
        ("GET", "/admin/v1/keys", None),
        ("DELETE", "/admin/v1/models/smollm2-135m", None),
    ]
    for method, path, body in refused:
        response = await client.open(path, method=method, json=body)
        assert response.status_code == 401, (method, path)
    assert (await client.get("/ui/no-such-page")).status_code == 404


async def test_logout_ends_the_session_even_for_a_kept_copy_of_the_cookie(app):
    client = app.test_client()
    session_id = await login(client)
    response = await client.post("/logout")
    assert response.status_code == 303
    assert f"{COOKIE}=;" in response.headers["Set-Cookie"]
    assert len(app.status_pages.sessions) == 0
    replay = app.test_client()
    response = await replay.get("/ui/nodes", headers={"Cookie": f"{COOKIE}={session_id}"})
    assert response.status_code == 401


async def test_a_session_expires():
    now = [1000.0]
    app = QuartTrio(__name__)
    pages = StatusPages(tokens.digest(ADMIN_TOKEN), nodes=list, replicas=list, clock=lambda: now[0])
    pages.install(app)
    client = app.test_client()
    await login(client)
    assert (await client.get("/ui/nodes")).status_code == 200
    now[0] += SESSION_LIFETIME - 1
    assert (await client.get("/ui/nodes")).status_code == 200
    now[0] += 1
    assert (await client.get("/ui/nodes")).status_code == 401
    assert len(pages.sessions) == 0  # the expired digest is dropped


async def test_names_reach_the_page_only_as_json_data(app):
    client = app.test_client()
    await login(client)
    for page in PAGES:
        body = await (await client.get(f"/ui/{page}")).get_data(as_text=True)
        assert "<script>document" not in body and "gpu-1" not in body, page
    usage = await (await client.get("/admin/v1/usage?by=tenant,model")).get_json()
    assert [row["tenant"] for row in usage["usage"]] == [SCRIPT_TENANT]
    # The script writes text, never markup: no API that parses a string as HTML or code.
    script = (UI_ROOT / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "Function("):
        assert sink not in script, sink
    # And no asset comes from anywhere but this server.
    for name in STATIC:
        text = (UI_ROOT / name).read_text()
        assert not re.search(
            r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", text.replace("http://www.w3.org/2000/svg", "")
        )


async def test_static_files_are_served_with_their_types_and_nothing_else(app):
    client = app.test_client()
    for name, content_type in STATIC.items():
        response = await client.get(f"/ui/static/{name}")
        assert response.status_code == 200 and response.content_type == content_type
        assert await response.get_data(as_text=True) == (UI_ROOT / name).read_text()
    for name in ("page.html", "..%2F__init__.py", "nope.js"):
        assert (await client.get(f"/ui/static/{name}")).status_code == 404


async def test_overview_queue_and_events_from_the_api_data(app):
    client = app.test_client()
    await login(client)
    app.status_pages.take_sample()
    overview = await (await client.get("/admin/v1/overview")).get_json()
    assert overview["nodes"] == {"total": 1, "online": 1}
    assert overview["gpus"] == {"l40s-45g": {"total": 1, "used": 0, "free": 1, "unhealthy": 0}}
    assert overview["replicas"] == {"total": 0}
    assert overview["queue_depth"] == 3
    assert overview["series"]["totals"] == {"requests": 10.0, "errors": 1.0, "slo_violations": 2.0}
    queue = await (await client.get("/admin/v1/queue")).get_json()
    assert queue["queue"] == [
        {"model": "smollm2-135m", "band": 0, "waiting": 2},
        {"model": "smollm2-135m", "band": 5, "waiting": 1},
    ]
    events = await client.get("/admin/v1/events?after=x")
    assert events.status_code == 400
    assert "after" in (await events.get_json())["error"]["message"]
    assert (await (await client.get("/admin/v1/events")).get_json()) == {"last": 0, "events": []}


async def test_the_overview_lists_replicas_not_ready_first_and_at_most_its_limit():
    def replica(i, state):
        return {
            "id": f"r-{i:04d}",
            "profile": "p",
            "model": "m",
            "state": state,
            "created": float(i),
            "nodes": [],
        }

    rows = [replica(i, "Ready") for i in range(OVERVIEW_REPLICAS + 5)] + [replica(9999, "Pending")]
    pages = StatusPages(tokens.digest(ADMIN_TOKEN), nodes=list, replicas=lambda: rows)
    overview = pages.overview()
    listed = overview["replica_rows"]
    assert len(listed) == OVERVIEW_REPLICAS and overview["replicas"]["total"] == OVERVIEW_REPLICAS + 6
    assert listed[0]["id"] == "r-9999" and listed[1]["id"] == "r-0000"


def test_traffic_totals_sum_the_gateway_metrics_over_models():
    metrics = GatewayMetrics(ttft_target=1.0)
    answers = [
        ("m1", 200, True, 0.5),
        ("m1", 200, True, 3.0),
        ("m2", 502, True, None),
        ("m2", 200, False, 0.1),
    ]
    for model, status, completed, first_byte in answers:
        metrics.on_done(
            RequestRecord(
                path="/v1/chat/completions", started=0.0, model=model, status=status, stream=True,
                completed=completed, finished=4.0, first_byte=first_byte,
            )
        )  # fmt: skip
    # 4 answered; the 502 and the cut-off answer failed; one first token took 3 s > 1 s.
    assert traffic_totals(metrics.registry) == (4.0, 2.0, 1.0)


async def test_without_a_traffic_source_the_overview_says_so():
    pages = StatusPages(tokens.digest(ADMIN_TOKEN), nodes=list, replicas=list)
    pages.take_sample()
    series = pages.overview()["series"]
    assert series["traffic_reported"] is False and series["totals"] is None


async def test_bearer_token_clients_read_the_new_endpoints_too(app):
    client = app.test_client()
    response = await client.get("/admin/v1/overview", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert response.status_code == 200
    assert json.loads(await response.get_data(as_text=True))["nodes"]["total"] == 1
