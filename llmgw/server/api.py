"""The admin API: what ``llmgw ctl`` talks to, served by quart-trio on hypercorn.

Request rates here are an operator's, so quart's routing is worth its cost (the data plane has
its own h11 listener). Everything under ``/admin/`` needs the admin token; ``/healthz`` does not,
so a supervisor or a packaging test can see that a binary started without holding secrets.
Every error is JSON of one shape, ``{"error": {"message": ..., "type": ...}}``, so that ctl can
show the server's own words to the operator.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from urllib.parse import urlsplit

import attrs
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from quart import Response, jsonify, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from llmgw import __version__
from llmgw.config import ServerTls, structure_catalog
from llmgw.core import jobs as core_jobs
from llmgw.core.catalog import Profile
from llmgw.core.keys import engine_key
from llmgw.core.replica import Replica
from llmgw.core.scaling import EngineLoad
from llmgw.server import tokens
from llmgw.server.catalog import Catalog, CatalogError, Entry, Invalid, NotFound, Refused, spec_options
from llmgw.server.jobs import Adapter, JobError, JobManager
from llmgw.server.jobs import Conflict as JobConflict
from llmgw.server.jobs import Invalid as JobInvalid
from llmgw.server.jobs import NotFound as JobNotFound
from llmgw.server.nodes import Node, NodeRegistry, NodeUnavailable
from llmgw.server.replicas import ReplicaManager
from llmgw.server.tenants import (
    Conflict,
    KeyRecord,
    Tenant,
    TenantError,
    Tenants,
    limits_from_json,
    limits_json,
)
from llmgw.server.tenants import Invalid as TenantInvalid
from llmgw.server.tenants import NotFound as TenantNotFound
from llmgw.server.ui import StatusPages, TrafficTotals, node_summary, replica_summary
from llmgw.server.usage_book import UsageRecorder, parse_group_by, parse_time
from llmgw.wire.codec import converter
from llmgw.wire.h2link import LinkClosed
from llmgw.wire.messages import Ping, Pong

log = logging.getLogger(__name__)
# hypercorn's errors, under our name. Its info lines only announce the bind, which run.py's
# "llmgw server up" line already says with the port resolved.
_hypercorn_log = log.getChild("hypercorn")
# A connection that sends nothing for this long is closed, mid-head or mid-body as well:
# hypercorn's keep-alive timeout runs only between requests, so without this a client that
# sent half a head held its connection (and a descriptor) forever.
ADMIN_READ_TIMEOUT = 30
# Between requests: ctl and a browser on the status pages reuse a connection between clicks.
ADMIN_KEEP_ALIVE_TIMEOUT = 30.0
_hypercorn_log.setLevel(logging.WARNING)

# Checked on the whole /admin/ tree, not just /admin/v1/, so that an unauthenticated client
# cannot tell which admin paths exist.
ADMIN_PREFIX = "/admin/"

# A healthy agent answers in milliseconds; after 5 s the link or the agent is stuck, and an
# operator waiting at a prompt should hear so rather than hang.
PING_TIMEOUT = 5.0

ROUTING_MESSAGES = {
    404: "no such endpoint (is ctl newer than this server?)",
    405: "this endpoint does not take that method",
}

UNAUTHORIZED_MESSAGE = (
    "missing or wrong admin token: pass --token, set LLMGW_TOKEN, or run `llmgw ctl context set` "
    "(the token is in the server's admin token file)"
)


async def serve_admin(
    registry: NodeRegistry,
    catalog: Catalog,
    admin_digest: bytes,
    engine_secret: bytes | None,
    host: str,
    port: int,
    *,
    replicas: ReplicaManager | None = None,
    tenants: Tenants | None = None,
    usage: UsageRecorder | None = None,
    jobs: JobManager | None = None,
    queued: Callable[[str], int] | None = None,
    queue_depths: Callable[[], Mapping[str, Mapping[int, int]]] | None = None,
    traffic: TrafficTotals | None = None,
    engine_load: Callable[[str], EngineLoad | None] | None = None,
    workers: Callable[[], list[dict]] | None = None,
    leadership: Callable[[], dict] | None = None,
    tls: ServerTls | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serves the admin API until cancelled (over HTTPS with ``tls``); reports the port it bound
    (the kernel's choice when ``port`` is 0)."""
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    if tls is not None:
        config.certfile, config.keyfile = str(tls.cert_file), str(tls.key_file)
    config.accesslog = None  # a line per request tells an operator nothing
    config.read_timeout = ADMIN_READ_TIMEOUT
    config.keep_alive_timeout = ADMIN_KEEP_ALIVE_TIMEOUT
    # Given a name instead of a Logger, hypercorn replaces that logger's handlers with its own
    # stderr handler; handing it ours keeps its messages in llmgw's logging setup.
    config.errorlog = _hypercorn_log
    async with trio.open_nursery() as nursery:
        # hypercorn reports its binds as URLs ("http://127.0.0.1:40313", "http://[::1]:40313")
        # made from getsockname(), so the port in them is the one actually bound.
        app = make_app(
            registry,
            catalog,
            admin_digest,
            engine_secret,
            replicas=replicas,
            tenants=tenants,
            usage=usage,
            jobs=jobs,
            queued=queued,
            queue_depths=queue_depths,
            traffic=traffic,
            engine_load=engine_load,
            workers=workers,
            leadership=leadership,
        )
        nursery.start_soon(app.status_pages.sample_forever)
        binds = await nursery.start(serve, app, config)
        task_status.started(urlsplit(binds[0]).port)


def make_app(
    registry: NodeRegistry,
    catalog: Catalog,
    admin_digest: bytes,
    engine_secret: bytes | None = None,
    *,
    replicas: ReplicaManager | None = None,
    tenants: Tenants | None = None,
    usage: UsageRecorder | None = None,
    jobs: JobManager | None = None,
    queued: Callable[[str], int] | None = None,  # requests waiting at the gateway, per model
    queue_depths: Callable[[], Mapping[str, Mapping[int, int]]] | None = None,  # per model, band
    traffic: TrafficTotals | None = None,  # the gateway's requests, errors, SLO violations
    engine_load: Callable[[str], EngineLoad | None] | None = None,  # a replica's, from its /metrics
    workers: Callable[[], list[dict]] | None = None,  # the gateway workers, as JSON
    leadership: Callable[[], dict] | None = None,  # the leader lease as this server sees it
) -> QuartTrio:
    app = QuartTrio(__name__)
    # The status pages read this API's JSON; the overview counts the same records' fields.
    app.status_pages = StatusPages(
        admin_digest,
        nodes=lambda: [node_summary(node) for node in registry.list()],
        replicas=lambda: [replica_summary(record) for record in replicas.list()] if replicas else [],
        queue_depths=queue_depths,
        traffic=traffic,
        events=replicas.events if replicas is not None else None,
    )
    app.status_pages.install(app)
    if tenants is not None:
        _add_tenant_routes(app, tenants)
    if jobs is not None:
        _add_job_routes(app, jobs)
    if usage is not None:
        _add_usage_routes(app, usage)

    @app.before_request
    async def require_admin_token() -> Response | None:
        if not request.path.startswith(ADMIN_PREFIX):
            return None
        if app.status_pages.session_reads():
            return None  # a status page's read, with its session cookie
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer" and token and tokens.matches(token, admin_digest):
            return None
        return _error(401, "unauthorized", UNAUTHORIZED_MESSAGE)

    @app.get("/healthz")
    async def healthz() -> Response:
        """ok; or degraded, naming each gateway worker that ended before serving (with its last
        words) — 503 when no worker serves at all, so the gateway port has no one behind it."""
        listing = workers() if workers is not None else []
        failing = [
            f"gateway worker {w['id']} {w['failure']}" for w in listing if w["failure"] and not w["serving"]
        ]
        if not failing:
            return jsonify(status="ok", version=__version__)
        answer = jsonify(status="degraded", version=__version__, problems=failing)
        if not any(w["serving"] for w in listing):
            answer.status_code = 503
        return answer

    @app.get("/admin/v1/workers")
    async def list_workers() -> Response:
        return jsonify(workers=workers() if workers is not None else [])

    @app.get("/admin/v1/leader")
    async def leader() -> Response:
        """Which server leads the servers sharing this store, under which term, and whether this
        one does (docs/ha.md)."""
        if leadership is None:
            return jsonify(leader=True, term=0, server="", holder="", holder_address="", live_servers=1)
        return jsonify(leadership())

    @app.get("/admin/v1/nodes")
    async def list_nodes() -> Response:
        return jsonify(nodes=[node_json(node) for node in registry.list()])

    @app.get("/admin/v1/nodes/<name>")
    async def show_node(name: str) -> Response:
        node = registry.get(name)
        if node is None:
            return _node_not_found(name)
        return jsonify(node_json(node))

    @app.post("/admin/v1/nodes/<name>/ping")
    async def ping_node(name: str) -> Response:
        if registry.get(name) is None:
            return _node_not_found(name)
        payload = secrets.token_urlsafe(16)
        started = trio.current_time()
        try:
            with trio.fail_after(PING_TIMEOUT):
                # The session assigns the command id; 0 is a placeholder.
                reply = await registry.call(name, Ping(id=0, payload=payload))
        except NodeUnavailable:
            return _error(409, "node_unavailable", f'node "{name}" is not connected; is its agent running?')
        except LinkClosed as e:
            return _error(409, "node_unavailable", f'the link to node "{name}" closed during the ping: {e}')
        except trio.TooSlowError:
            return _error(504, "timeout", f'node "{name}" did not answer a ping within {PING_TIMEOUT:g} s')
        rtt_ms = (trio.current_time() - started) * 1000
        payload_ok = isinstance(reply, Pong) and reply.payload == payload
        return jsonify(node=name, rtt_ms=round(rtt_ms, 3), payload_ok=payload_ok)

    def key_of(replica_id: str) -> str | None:
        return None if engine_secret is None else engine_key(engine_secret, replica_id)

    @app.get("/admin/v1/replicas")
    async def list_replicas() -> Response:
        records = replicas.list() if replicas is not None else []
        return jsonify(replicas=[replica_json(record, registry, replicas, engine_load) for record in records])

    @app.get("/admin/v1/replicas/<replica_id>")
    async def show_replica(replica_id: str) -> Response:
        record = replicas.get(replica_id) if replicas is not None else None
        if record is None:
            return _error(404, "not_found", f'replica "{replica_id}" not found')
        return jsonify(replica_json(record, registry, replicas, engine_load))

    @app.get("/admin/v1/replicas/<replica_id>/engine-key")
    async def replica_engine_key(replica_id: str) -> Response:
        # For operators' tools (bench straight at an engine); the admin token guards it.
        key = key_of(replica_id)
        if key is None:
            return _error(409, "no_engine_keys", "this server has no store secret; engines run without a key")
        return jsonify(replica_id=replica_id, key=key)

    @app.get("/admin/v1/models")
    async def list_models() -> Response:
        profiles = catalog.profiles().values()
        return jsonify(models=[model_json(entry, profiles) for entry in catalog.entries("model")])

    @app.get("/admin/v1/profiles")
    async def list_profiles() -> Response:
        return jsonify(profiles=[profile_json(entry) for entry in catalog.entries("profile")])

    def profile_json(entry: Entry) -> dict:
        # What the scaler wants of it and why, and the gateway's waiters for its model: why a
        # profile is at zero (or anywhere else) and who is waiting for it to come up.
        wanted = replicas.wanted(entry.name) if replicas is not None else None
        scale = {
            "wanted": wanted[0] if wanted else None,
            "reason": wanted[1] if wanted else "",
            "waiting": queued(entry.spec.model) if queued is not None else 0,
        }
        return {**entry_json(entry), "scale": scale}

    @app.post("/admin/v1/catalog")
    async def apply_catalog() -> Response:
        models, profiles, problems = structure_catalog(await request.get_json(silent=True))
        try:
            if problems:
                raise Invalid(problems)
            changes = await catalog.apply(models, profiles)
        except CatalogError as e:
            return _catalog_error(e, "nothing was applied")
        for change in changes:
            if change.change != "unchanged":
                log.info("catalog: %s %s %s through the admin API", change.kind, change.name, change.change)
        return jsonify(changes=[attrs.asdict(change) for change in changes])

    @app.post("/admin/v1/profiles/<path:name>/scale")
    async def scale_profile(name: str) -> Response:
        try:
            low, high = _scale_bounds(await request.get_json(silent=True))
            entry = await catalog.scale(name, low, high)
        except CatalogError as e:
            return _catalog_error(e, "the profile is unchanged")
        log.info(
            "catalog: profile %s scaled to %d-%d replicas through the admin API",
            name,
            entry.spec.min_replicas,
            entry.spec.max_replicas,
        )
        return jsonify(entry_json(entry))

    @app.delete("/admin/v1/models/<path:name>")
    async def delete_model(name: str) -> Response:
        return await _remove("model", name)

    @app.delete("/admin/v1/profiles/<path:name>")
    async def delete_profile(name: str) -> Response:
        return await _remove("profile", name)

    async def _remove(kind: str, name: str) -> Response:
        try:
            await catalog.remove(kind, name)
        except CatalogError as e:
            return _catalog_error(e, f"the {kind} is still there")
        log.info("catalog: %s %s removed through the admin API", kind, name)
        return jsonify(deleted={"kind": kind, "name": name})

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException) -> Response:
        # Routing's 404 and 405; werkzeug's descriptions are written for browsers.
        code = e.code or 500
        kind = (e.name or "error").lower().replace(" ", "_")
        what = ROUTING_MESSAGES.get(code, e.description)
        return _error(code, kind, f"{request.method} {request.path}: {what}")

    @app.errorhandler(RecursionError)
    async def nested_too_deeply(e: RecursionError) -> Response:
        # json raises it, not ValueError, for a body nested past the recursion limit; quart's
        # get_json(silent=True) lets it through. The client's mistake, not the server's.
        return _error(
            400, "invalid_json", f"{request.method} {request.path}: the body's JSON is nested too deeply"
        )

    @app.errorhandler(Exception)
    async def unexpected_error(e: Exception) -> Response:
        log.exception("admin API: %s %s failed", request.method, request.path)
        return _error(500, "internal", f"internal error ({type(e).__name__}); the server log has details")

    return app


def _add_tenant_routes(app: QuartTrio, tenants: Tenants) -> None:
    @app.get("/admin/v1/tenants")
    async def list_tenants() -> Response:
        return jsonify(tenants=[tenant_json(tenant, tenants) for tenant in tenants.list_tenants()])

    @app.post("/admin/v1/tenants")
    async def create_tenant() -> Response:
        try:
            body = _object(await request.get_json(silent=True), ("name", "limits"), '{"name": "acme"}')
            name = body.get("name")
            if not isinstance(name, str):
                raise TenantInvalid(f"name: expected a string, got {json.dumps(name)}")
            tenant = await tenants.create_tenant(name, limits_from_json(body.get("limits")))
        except TenantError as e:
            return _tenant_error(e)
        log.info("tenants: %s created through the admin API", tenant.name)
        response = jsonify(tenant_json(tenant, tenants))
        response.status_code = 201
        return response

    @app.post("/admin/v1/tenants/<name>/limits")
    async def set_tenant_limits(name: str) -> Response:
        try:
            tenant = await tenants.set_limits(name, limits_from_json(await request.get_json(silent=True)))
        except TenantError as e:
            return _tenant_error(e)
        log.info("tenants: %s limits set to %s through the admin API", name, limits_json(tenant.limits))
        return jsonify(tenant_json(tenant, tenants))

    @app.delete("/admin/v1/tenants/<name>")
    async def delete_tenant(name: str) -> Response:
        try:
            await tenants.delete_tenant(name)
        except TenantError as e:
            return _tenant_error(e)
        log.info("tenants: %s deleted through the admin API", name)
        return jsonify(deleted={"tenant": name})

    @app.get("/admin/v1/keys")
    async def list_keys() -> Response:
        tenant = request.args.get("tenant")
        if tenant is not None and tenants.tenant(tenant) is None:
            return _tenant_error(TenantNotFound(f'tenant: no tenant "{tenant}"'))
        return jsonify(keys=[key_json(key) for key in tenants.list_keys(tenant)])

    @app.post("/admin/v1/keys")
    async def create_key() -> Response:
        try:
            fields = ("tenant", "models", "band", "limits")
            body = _object(await request.get_json(silent=True), fields, '{"tenant": "acme"}')
            tenant, models, band = body.get("tenant"), body.get("models", []), body.get("band", 0)
            if not isinstance(tenant, str):
                raise TenantInvalid(f"tenant: expected a tenant's name, got {json.dumps(tenant)}")
            if not isinstance(models, list):
                raise TenantInvalid(f"models: expected a list of model names, got {json.dumps(models)}")
            if isinstance(band, bool) or not isinstance(band, int):
                raise TenantInvalid(f"band: expected an integer, got {json.dumps(band)}")
            limits = body.get("limits")
            record, secret = await tenants.create_key(
                tenant, models, band, None if limits is None else limits_from_json(limits)
            )
        except TenantError as e:
            return _tenant_error(e)
        log.info("tenants: api key %s created for %s through the admin API", record.id, record.tenant)
        response = jsonify({**key_json(record), "secret": secret})
        response.status_code = 201
        return response

    @app.delete("/admin/v1/keys/<key_id>")
    async def revoke_key(key_id: str) -> Response:
        try:
            record = await tenants.revoke_key(key_id)
        except TenantError as e:
            return _tenant_error(e)
        log.info("tenants: api key %s revoked through the admin API", key_id)
        return jsonify(key_json(record))


def _add_usage_routes(app: QuartTrio, usage: UsageRecorder) -> None:
    @app.get("/admin/v1/usage")
    async def summarise_usage() -> Response:
        args = request.args
        try:
            group_by = parse_group_by(args.get("by", DEFAULT_USAGE_GROUPS))
            since = None if not args.get("since") else parse_time(args["since"], "since")
            until = None if not args.get("until") else parse_time(args["until"], "until", end_of_day=True)
        except ValueError as e:
            return _error(400, "invalid_request", str(e))
        rows = await usage.summarise(group_by, since, until)
        return jsonify(by=group_by, since=since, until=until, usage=rows)


DEFAULT_USAGE_GROUPS = "tenant,model,day"

# Bytes per read of an adapter file being downloaded: big enough for few reads, small in memory.
DOWNLOAD_CHUNK = 256 * 1024


def _add_job_routes(app: QuartTrio, jobs: JobManager) -> None:
    @app.post("/admin/v1/jobs")
    async def create_job() -> Response:
        try:
            job = await jobs.create(await request.get_json(silent=True))
        except JobError as e:
            return _job_error(e, "no job was created")
        log.info(
            "jobs: %s created through the admin API (adapter %s for %s on node %s, %d pairs)",
            job.id,
            job.spec.adapter,
            job.spec.model,
            job.node,
            len(job.spec.pairs),
        )
        response = jsonify(job_json(job, jobs, time.time()))
        response.status_code = 201
        return response

    @app.get("/admin/v1/jobs")
    async def list_jobs() -> Response:
        now = time.time()
        return jsonify(jobs=[job_json(job, jobs, now, with_log=False) for job in jobs.list()])

    @app.get("/admin/v1/jobs/<job_id>")
    async def show_job(job_id: str) -> Response:
        job = jobs.get(job_id)
        if job is None:
            return _error(404, "not_found", f'job "{job_id}" not found')
        return jsonify(job_json(job, jobs, time.time()))

    @app.post("/admin/v1/jobs/<job_id>/cancel")
    async def cancel_job(job_id: str) -> Response:
        try:
            job = await jobs.cancel(job_id)
        except JobError as e:
            return _job_error(e, "the job is unchanged")
        log.info("jobs: %s cancel requested through the admin API (now %s)", job_id, job.state)
        return jsonify(job_json(job, jobs, time.time()))

    @app.get("/admin/v1/adapters")
    async def list_adapters() -> Response:
        return jsonify(adapters=[adapter_json(adapter) for adapter in jobs.list_adapters()])

    @app.get("/admin/v1/adapters/<name>/files/<file>")
    async def download_adapter_file(name: str, file: str) -> Response:
        try:
            path, digest = jobs.adapter_file(name, file)
        except JobError as e:
            return _job_error(e, "")

        async def chunks():
            async with await trio.open_file(path, "rb") as f:
                while chunk := await f.read(DOWNLOAD_CHUNK):
                    yield chunk

        response = Response(chunks(), mimetype="application/octet-stream")
        response.headers["Content-Length"] = str(digest.size)
        response.headers["X-Llmgw-Sha256"] = digest.sha256
        response.timeout = None  # a big file on a slow link takes as long as it takes
        return response


_JOB_STATUS = {
    JobInvalid: (400, "invalid_request"),
    JobConflict: (409, "conflict"),
    JobNotFound: (404, "not_found"),
}


def _job_error(e: JobError, outcome: str) -> Response:
    status, kind = _JOB_STATUS[type(e)]
    if len(e.problems) == 1:
        message = e.problems[0]
    else:
        message = f"{outcome}:" + "".join(f"\n  {problem}" for problem in e.problems)
    response = jsonify(error={"message": message, "type": kind, "problems": e.problems})
    response.status_code = status
    return response


def job_json(job: core_jobs.Job, jobs: JobManager, now: float, *, with_log: bool = True) -> dict:
    """A job as the API shows it: its spec without the pairs (their count instead), its state and
    progress, and the wall time of each phase."""
    spec = job.spec
    data = {
        "id": job.id,
        "node": job.node,
        "model": spec.model,
        "adapter": spec.adapter,
        "base_dir": spec.base_dir,
        "need_mib": spec.need_mib,
        "gguf": spec.gguf,
        "params": converter.unstructure(spec.params),
        "pairs": len(spec.pairs),
        "state": job.state,
        "reason": job.reason,
        "cancel_requested": job.cancel_requested,
        "created": job.created,
        "sent": job.sent,
        "training": job.training,
        "converting": job.converting,
        "uploading": job.uploading,
        "finished": job.finished,
        "step": job.step,
        "total_steps": job.total_steps,
        "loss": job.loss,
        "peak_mib": job.peak_mib,
        "device": job.device,
        "files": [converter.unstructure(f) for f in job.files],
        "timings": core_jobs.timings(job, now),
    }
    upload = jobs.upload_progress(job.id)
    data["upload"] = None if upload is None else {"received": upload[0], "total": upload[1]}
    if with_log:
        data["log_tail"] = list(job.log_tail)
    return data


def adapter_json(adapter: Adapter) -> dict:
    return {
        "name": adapter.name,
        "model": adapter.model,
        "job_id": adapter.job_id,
        "created": adapter.created,
        "gguf": adapter.gguf,
        "files": [converter.unstructure(f) for f in adapter.files],
    }


def tenant_json(tenant: Tenant, tenants: Tenants) -> dict:
    return {
        "name": tenant.name,
        "limits": limits_json(tenant.limits),
        "created": tenant.created,
        "active_keys": len(tenants.active_keys(tenant.name)),
    }


def key_json(key: KeyRecord) -> dict:
    """A key as listings show it: never its secret or digest."""
    return {
        "id": key.id,
        "tenant": key.tenant,
        "models": list(key.models),
        "band": key.band,
        "limits": None if key.limits is None else limits_json(key.limits),
        "created": key.created,
        "revoked": key.revoked,
    }


def _object(body: object, fields: tuple[str, ...], example: str) -> dict:
    if not isinstance(body, dict):
        raise TenantInvalid(f"expected a JSON object like {example}")
    unknown = [key for key in body if key not in fields]
    if unknown:
        raise TenantInvalid(
            "; ".join(f"{key}: unknown field (expected one of: {', '.join(fields)})" for key in unknown)
        )
    return body


_TENANT_STATUS = {
    TenantInvalid: (400, "invalid_request"),
    Conflict: (409, "conflict"),
    TenantNotFound: (404, "not_found"),
}


def _tenant_error(e: TenantError) -> Response:
    status, kind = _TENANT_STATUS[type(e)]
    return _error(status, kind, str(e))


def node_json(node: Node) -> dict:
    return {
        "name": node.name,
        "state": node.state.value,
        "connected": node.connected,
        "agent_version": node.agent_version,
        "first_seen": node.first_seen,
        "last_seen": node.last_seen,
        "state_since": node.state_since,
        # Registrations since this server started: a tool that restarted the agent waits for a
        # newer one (ctl node add), not for the old link's "connected".
        "registrations": node.registrations,
        "inventory": converter.unstructure(node.inventory),
        "shards": [converter.unstructure(shard) for shard in node.shards.values()],
    }


def entry_json(entry: Entry) -> dict:
    return {"name": entry.name, **spec_options(entry.spec), "source": entry.source, "updated": entry.updated}


def model_json(entry: Entry, profiles: Iterable[Profile]) -> dict:
    used_by = sorted(profile.name for profile in profiles if profile.model == entry.name)
    return {**entry_json(entry), "used_by": used_by}


SCALE_KEYS = ("replicas", "min_replicas", "max_replicas")


def _scale_bounds(body: object) -> tuple[int | None, int | None]:
    """(min_replicas, max_replicas) from ``{"replicas": n}`` (both n) or either or both bounds."""
    if not isinstance(body, dict) or not body:
        raise Invalid(['expected a JSON object: {"replicas": n}, or {"min_replicas": n, "max_replicas": m}'])
    problems = [
        f"{key}: unknown key (expected one of: {', '.join(SCALE_KEYS)})"
        for key in body
        if key not in SCALE_KEYS
    ]
    problems += [
        f"{key}: expected an integer, got {json.dumps(value)}"
        for key, value in body.items()
        if key in SCALE_KEYS and (isinstance(value, bool) or not isinstance(value, int))
    ]
    if "replicas" in body and len(body) > 1:
        problems.append("replicas: give replicas alone, or min_replicas and max_replicas, not both")
    if problems:
        raise Invalid(problems)
    if "replicas" in body:
        return body["replicas"], body["replicas"]
    return body.get("min_replicas"), body.get("max_replicas")


_CATALOG_STATUS = {
    Invalid: (400, "invalid_request"),
    Refused: (409, "conflict"),
    NotFound: (404, "not_found"),
}


def _catalog_error(e: CatalogError, outcome: str) -> Response:
    """One problem reads as one line; several as ``outcome:`` and then one per line, so that ctl
    can print the server's message as it is. ``problems`` keeps them apart for programs."""
    status, kind = _CATALOG_STATUS[type(e)]
    if len(e.problems) == 1:
        message = e.problems[0]
    else:
        message = f"{outcome}:" + "".join(f"\n  {problem}" for problem in e.problems)
    response = jsonify(error={"message": message, "type": kind, "problems": e.problems})
    response.status_code = status
    return response


def replica_json(
    record: Replica,
    registry: NodeRegistry,
    replicas: ReplicaManager,
    engine_load: Callable[[str], EngineLoad | None] | None = None,
) -> dict:
    """A replica record, plus where its engine answers (rank 0's node address and port), its
    engine's last scraped load (None until it answers), and while Pending every node's reason
    for not taking it."""
    data = converter.unstructure(record)
    data["candidates"] = [{"node": node, "reason": why} for node, why in replicas.candidates(record.id)]
    endpoint = None
    if record.shards:
        leader = record.shards[0]
        node = registry.get(leader.node)
        if node is not None:
            endpoint = f"{node.inventory.reached_at}:{leader.port}"
    data["endpoint"] = endpoint
    load = engine_load(record.id) if engine_load is not None else None
    data["load"] = None if load is None else attrs.asdict(load)
    return data


def _node_not_found(name: str) -> Response:
    return _error(404, "not_found", f'node "{name}" not found')


def _error(status: int, kind: str, message: str) -> Response:
    response = jsonify(error={"message": message, "type": kind})
    response.status_code = status
    return response
