"""The status pages: a read-only web view of the fleet on the admin listener.

The pages are static files shipped in this package (HTML, one hand-written script, one style
sheet; no CDN, no framework). The script reads the admin API's own JSON — the data ctl reads —
and polls it, so nothing is computed twice and the page updates without a reload. It builds the
DOM with ``textContent`` only, so every name (node, tenant, model, adapter) shows as text.

Access: ``GET /`` without a session shows a login form that posts the admin token to
``POST /login``; the answer is an HttpOnly, SameSite=Strict cookie holding a random session id,
of which the server keeps only the digest (core.sessions), for SESSION_LIFETIME. The session
lets a browser GET the API paths the pages read (READABLE) and nothing else; writes still need
the bearer token. Sessions live in memory: a server restart logs everyone out.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping
from importlib import resources

import trio
from quart import Response, jsonify, redirect, request
from quart_trio import QuartTrio

from llmgw.core.events import EventLog
from llmgw.core.overview import SAMPLE_INTERVAL, Sample, SampleRing, series, summarise
from llmgw.core.replica import Replica
from llmgw.core.sessions import SessionBook, session_digest
from llmgw.server import tokens
from llmgw.server.nodes import Node

log = logging.getLogger(__name__)

COOKIE = "llmgw_session"
SESSION_ID_BYTES = 32

# The pages, by path under /ui/ (the overview is also "/"); the name is also the script's switch.
PAGES = ("overview", "nodes", "replicas", "models", "queue", "jobs", "usage", "events")
STATIC = {
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
# The API paths a session may GET (exact paths): what the pages read. Not engine keys, adapter
# files or API keys; nothing that writes.
READABLE = frozenset(
    "/admin/v1/" + path
    for path in (
        "nodes",
        "replicas",
        "models",
        "profiles",
        "tenants",
        "jobs",
        "adapters",
        "usage",
        "overview",
        "events",
        "queue",
    )
)

# Only this machine's own files run or style the page; nothing is framed, nothing posts elsewhere.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # Not no-referrer: under it Chromium sends "Origin: null" with the login form's post, which
    # the same-origin check must refuse. Same-origin keeps the server's paths off other sites.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

# The overview lists this many replicas, the ones not Ready first; the replicas page has them all.
OVERVIEW_REPLICAS = 100

LOGIN_FAILED = "That is not the admin token (it is in the server's admin token file)."
LOGIN_REQUIRED = "Log in with the admin token to see this page."
TrafficTotals = Callable[[], tuple[float, float, float]]  # requests, errors, SLO violations


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


class StatusPages:
    """The pages' state (sessions, the overview's samples) and their routes on the admin app."""

    def __init__(
        self,
        admin_digest: bytes,
        *,
        nodes: Callable[[], list[dict]],
        replicas: Callable[[], list[dict]],
        queue_depths: Callable[[], Mapping[str, Mapping[int, int]]] | None = None,
        traffic: TrafficTotals | None = None,
        events: EventLog | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._admin_digest = admin_digest
        self._nodes = nodes
        self._replicas = replicas
        self._queue_depths = queue_depths or dict
        self._traffic = traffic
        self._events = events if events is not None else EventLog()
        self._clock = clock
        self.sessions = SessionBook()
        self.samples = SampleRing()
        self._assets = {name: _asset(name) for name in STATIC}
        self._page = _asset("page.html")
        self._login = _asset("login.html")

    # --- access --------------------------------------------------------------------------------

    def has_session(self) -> bool:
        cookie = request.cookies.get(COOKIE)
        return bool(cookie) and self.sessions.valid(session_digest(cookie), self._clock())

    def session_reads(self) -> bool:
        """Whether this request is a read the pages make, by a browser with a session."""
        return request.method in ("GET", "HEAD") and request.path in READABLE and self.has_session()

    # --- the overview's numbers ----------------------------------------------------------------

    def overview(self) -> dict:
        nodes, replicas = self._nodes(), self._replicas()
        # Not Ready first, then by profile and age: what an operator looks for on the overview.
        listed = sorted(replicas, key=lambda r: (r["state"] == "Ready", r["profile"], r["created"], r["id"]))
        return {
            **summarise(nodes, replicas, self._queue_depths()),
            "series": self._series(),
            "replica_rows": listed[:OVERVIEW_REPLICAS],
        }

    def take_sample(self) -> None:
        nodes, replicas = self._nodes(), self._replicas()
        counts = summarise(nodes, replicas, self._queue_depths())
        requests, errors, violations = self._traffic() if self._traffic is not None else (0.0, 0.0, 0.0)
        self.samples.add(
            Sample(
                at=self._clock(),
                requests=requests,
                errors=errors,
                slo_violations=violations,
                queue_depth=counts["queue_depth"],
                ready_replicas=counts["replicas"].get("Ready", 0),
                gpus_used=sum(row["used"] for row in counts["gpus"].values()),
            )
        )

    def _series(self) -> dict:
        samples = self.samples.samples()
        latest = samples[-1] if samples else None
        # No traffic source (the gateway runs in worker processes that do not report these
        # counters): the page says so instead of showing zeros.
        reported = self._traffic is not None
        return {
            "interval": SAMPLE_INTERVAL,
            "points": series(samples),
            "traffic_reported": reported,
            "totals": None
            if latest is None or not reported
            else {
                "requests": latest.requests,
                "errors": latest.errors,
                "slo_violations": latest.slo_violations,
            },
        }

    async def sample_forever(self, interval: float = SAMPLE_INTERVAL) -> None:
        while True:
            try:
                self.take_sample()
            except Exception:
                # A sample is a nicety: a bug in one must not take the admin listener down.
                log.exception("status pages: taking a sample failed")
            await trio.sleep(interval)

    # --- routes --------------------------------------------------------------------------------

    def install(self, app: QuartTrio) -> None:
        @app.after_request
        async def security_headers(response: Response) -> Response:
            for name, value in SECURITY_HEADERS.items():
                response.headers.setdefault(name, value)
            return response

        @app.get("/")
        async def index() -> Response:
            if not self.has_session():
                return self._login_form("", 200)
            return self._html(self._render("overview"))

        @app.post("/login")
        async def login() -> Response:
            if not _same_origin():
                return self._login_form("This form must be sent from the server's own page.", 403)
            form = await request.form
            token = (form.get("token") or "").strip()
            if not token or not tokens.matches(token, self._admin_digest):
                log.warning("status pages: a login with a wrong token from %s", request.remote_addr)
                return self._login_form(LOGIN_FAILED, 401)
            session_id = secrets.token_urlsafe(SESSION_ID_BYTES)
            now = self._clock()
            expires = self.sessions.open(session_digest(session_id), now)
            response = redirect("/", 303)
            response.set_cookie(
                COOKIE,
                session_id,
                max_age=round(expires - now),
                path="/",
                httponly=True,
                samesite="Strict",
                secure=request.scheme == "https",
            )
            log.info("status pages: a session opened from %s", request.remote_addr)
            return response

        @app.post("/logout")
        async def logout() -> Response:
            cookie = request.cookies.get(COOKIE)
            if cookie and _same_origin():
                self.sessions.close(session_digest(cookie))
            response = redirect("/", 303)
            response.delete_cookie(COOKIE, path="/", httponly=True, samesite="Strict")
            return response

        @app.get("/ui/<page>")
        async def page(page: str) -> Response:
            if not self.has_session():
                return self._login_form(LOGIN_REQUIRED, 401)
            if page not in PAGES:
                return self._html(f"<p>No such page; the pages are: {', '.join(PAGES)}</p>", 404)
            return self._html(self._render(page))

        @app.get("/ui/static/<name>")
        async def static_file(name: str) -> Response:
            # Public: the login form needs the style sheet, and neither file holds any data.
            if name not in STATIC:
                return Response("not found\n", 404, mimetype="text/plain")
            return Response(self._assets[name], 200, content_type=STATIC[name])

        @app.get("/admin/v1/overview")
        async def overview() -> Response:
            return jsonify(self.overview())

        @app.get("/admin/v1/events")
        async def events() -> Response:
            try:
                after = int(request.args.get("after", "0"))
            except ValueError:
                return _bad_request(
                    f"after: expected an event's sequence number, got {request.args['after']!r}"
                )
            listed = self._events.since(after)
            return jsonify(
                last=self._events.last_seq,
                events=[
                    {"seq": e.seq, "at": e.at, "kind": e.kind, "subject": e.subject, "reason": e.reason}
                    for e in listed
                ],
            )

        @app.get("/admin/v1/queue")
        async def queue() -> Response:
            depths = self._queue_depths()
            rows = [
                {"model": model, "band": band, "waiting": waiting}
                for model, bands in sorted(depths.items())
                for band, waiting in sorted(bands.items())
            ]
            return jsonify(queue=rows)

    def _render(self, page: str) -> str:
        # Only a name from PAGES goes into the page: the data arrive as JSON, shown as text.
        assert page in PAGES
        return self._page.replace("{{page}}", page)

    def _login_form(self, message: str, status: int) -> Response:
        # ``message`` is one of this module's constants, never anything the client sent.
        return self._html(self._login.replace("{{message}}", message), status)

    @staticmethod
    def _html(body: str, status: int = 200) -> Response:
        return Response(body, status, content_type="text/html; charset=utf-8")


def _same_origin() -> bool:
    """A form post from another site's page carries its Origin: refused (login CSRF). Browsers
    send Origin on every POST; a client that sends none is not a browser on another site."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    host = request.headers.get("Host", "")
    return origin in (f"http://{host}", f"https://{host}")


def _bad_request(message: str) -> Response:
    response = jsonify(error={"message": message, "type": "invalid_request"})
    response.status_code = 400
    return response


def node_summary(node: Node) -> dict:
    """The fields of the API's node object (api.node_json) that the overview counts, without
    converting the whole inventory: the overview of a large fleet stays cheap."""
    return {
        "name": node.name,
        "state": node.state.value,
        "inventory": {
            "gpus": [
                {"index": gpu.index, "gpu_class": gpu.gpu_class, "problems": gpu.problems}
                for gpu in node.inventory.gpus
            ]
        },
        "shards": [
            {
                "replica_id": shard.replica_id,
                "state": shard.state,
                "spec": None
                if shard.spec is None
                else {"gpus": [{"index": g.index} for g in shard.spec.gpus]},
            }
            for shard in node.shards.values()
        ],
    }


def replica_summary(record: Replica) -> dict:
    """The fields of the API's replica object (api.replica_json) the overview shows."""
    return {
        "id": record.id,
        "profile": record.profile,
        "model": record.model,
        "state": record.state.value,
        "nodes": [shard.node for shard in record.shards],
        "created": record.created,
        "reason": record.reason,
    }
