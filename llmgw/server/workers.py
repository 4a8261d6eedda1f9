"""The server's gateway workers: started, adopted, kept up to date, restarted when they die.

Each worker (:mod:`llmgw.server.worker`) is a process of its own, in a session of its own: a kill
of the server — or Ctrl-C on its terminal — does not reach it, and it serves on with the state it
last had. A server starting finds the workers an earlier one left (``<id>.state.json``: the pid
and its start time, so a pid reused by another program is never taken for one), connects to
each on its socket and pushes the current state; it starts the ones missing. A worker that dies
is started again after a backoff. On a graceful stop the server stops its workers only when
``gateway.stop_workers_on_exit`` says so: by default they serve through a restart, as an agent's
engines do.

The pool also stands in, for the scaler and the admin API, for the gate the workers now hold: it
sums their reports (queued requests, in flight, how long a model has been idle).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import cattrs
import trio

from llmgw.config import TracingConfig
from llmgw.core.backoff import reconnect_delay
from llmgw.core.leases import LEASE_TTL, LeaseLedger, LeaseReport
from llmgw.core.listener_limits import ListenerLimits
from llmgw.core.quota import Limits
from llmgw.gateway.errors import GatewayError
from llmgw.procfs import start_time_of
from llmgw.server.changes import Changes
from llmgw.server.worker import WorkerSpec, load_spec, spec_path
from llmgw.server.worker_link import (
    LINK_ERRORS,
    AdapterAnswer,
    Keys,
    LineStream,
    LinkLost,
    NeedAdapter,
    PushedKey,
    PushedLimits,
    PushedModel,
    PushedReplica,
    PushedTenant,
    Report,
    Routes,
    Waiting,
)

log = logging.getLogger(__name__)

# A worker just started listens on its socket within this; one that does not is started again.
CONNECT_WITHIN = 30.0
# A report older than this no longer counts towards the scaler's view (a worker stuck or gone).
REPORT_STALE = 5.0
# SIGTERM, then SIGKILL after this long, when the server stops its workers.
STOP_GRACE = 10.0
RESTART_INITIAL, RESTART_MAX = 0.5, 30.0
# How long an adapter's unload waits for every worker to stop sending it requests: a worker
# reports at once when it takes new routes, so this only runs out on one that is stuck.
QUIESCE_TIMEOUT = 10.0


# The interpreter's program for a worker: `-P` keeps the working directory off sys.path (with
# `-m`, a folder named llmgw there — a checkout's parent, a folder of configs — shadowed this
# package and every worker died at import), and the package's own location is put first instead,
# unless the path already has it (an install's site-packages), so the worker runs this very llmgw.
_WORKER_MAIN = (
    "import sys; root = sys.argv.pop(1); "
    "sys.path.insert(0, root) if root not in sys.path else None; "
    "from llmgw.cli import main; sys.exit(main(sys.argv[1:]))"
)
# How much of a dead worker's own output the server's log and ctl quote.
FAILURE_TAIL_LINES = 5


def worker_command(spec_file: Path) -> list[str]:
    """This same program, as the worker: the frozen binary is its own interpreter."""
    if getattr(sys, "frozen", False):
        return [sys.executable, "server", "--gateway-worker", str(spec_file)]
    root = str(Path(__file__).resolve().parent.parent.parent)  # the folder holding llmgw/
    return [sys.executable, "-P", "-c", _WORKER_MAIN, root, "server", "--gateway-worker", str(spec_file)]


def last_lines(path: Path, count: int = FAILURE_TAIL_LINES, *, limit: int = 16 * 1024) -> str:
    """The last ``count`` non-empty lines of a worker's log (its last ``limit`` bytes at most)."""
    try:
        with open(path, "rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - limit))
            text = file.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join([line for line in text.splitlines() if line.strip()][-count:])


@attrs.define(eq=False)
class _Worker:
    id: str
    pid: int = 0
    start_time: int | None = None  # with the pid, names the process for good (llmgw.procfs)
    adopted: bool = False
    report: Report | None = None
    reported_at: float = -1e9  # trio time
    connected: bool = False
    restarts: int = 0
    process: trio.Process | None = None  # ours to reap when we started it
    serving: trio.Event = attrs.field(factory=trio.Event)  # set once it reported it serves
    settled: trio.Event = attrs.field(factory=trio.Event)  # set once it serves or has failed
    # Adopted, but started with settings this server would not give it (another port, its own
    # share of quotas or all of them, another queue timeout): replaced before anything else.
    outdated: bool = False
    # The ledger has had a lease report from it: a grant answers a report, so none is pushed
    # before the first (a restarted server's ledger has heard from nobody yet).
    lease_reported: bool = False
    # How its last process ended, with the end of its output; None once it serves again.
    failure: str | None = None
    # When this server last heard a lease report from it (or took it on): a worker silent for a
    # lease's length is killed, since only a worker known gone gives its shares back.
    heard_at: float = attrs.field(factory=trio.current_time)
    # Set when the ledger has changed shares for it: a grant goes at once (see _grant_when_due).
    grant_due: trio.Event = attrs.field(factory=trio.Event)


class WorkerPool:
    def __init__(
        self,
        directory: Path,
        *,
        count: int,
        host: str,
        port: int,
        queue_timeout: float,
        ttft_target: float,
        keys: Callable[[], Keys],
        routes: Callable[[], Routes],
        on_waiting: Callable[[str], None],
        keys_changed: Changes,
        stop_on_exit: bool = False,
        tracing: TracingConfig | None = None,
        lease_ttl: float = LEASE_TTL,
        tenant_metrics: bool = False,
        listener: ListenerLimits | None = None,
    ) -> None:
        self._listener = listener or ListenerLimits()  # the gateway's deadlines and caps, per worker
        self._tenant_metrics = tenant_metrics
        self._directory = directory
        self._lease_ttl = lease_ttl
        self._tracing = tracing or TracingConfig()
        self._count = count
        self._host = host
        self._port = port
        self._queue_timeout = queue_timeout
        self._ttft_target = ttft_target
        self._keys = keys
        self._routes = routes
        self._on_waiting = on_waiting
        self._stop_on_exit = stop_on_exit
        self.keys_changed = keys_changed  # the tenants' own: keys and limits changed
        self.routes_changed = Changes()  # bumped by the server when its routes change
        # A worker's NeedAdapter: the server's adapter loads (AdapterLoads.need), once for all.
        self.need_adapter: Callable[[str, str], Awaitable[None]] | None = None
        self._reported = trio.Event()  # set (and replaced) at each worker's report
        self._workers: dict[str, _Worker] = {}
        self._reserved: socket.socket | None = None
        # Several workers share each quota and each replica's slots by leases (core.leases).
        self._ledger: LeaseLedger | None = None
        self._subjects: set[tuple[str, str]] = set()  # those the ledger was given limits for

    # --- what the rest of the server reads --------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    def workers(self) -> list[_Worker]:
        return [self._workers[name] for name in sorted(self._workers)]

    def as_json(self) -> list[dict]:
        """The workers as the admin API and ctl show them."""
        now = trio.current_time()
        out = []
        for worker in self.workers():
            report = worker.report
            fresh = report is not None and now - worker.reported_at < REPORT_STALE
            out.append(
                {
                    "id": worker.id,
                    "pid": worker.pid or None,
                    "adopted": worker.adopted,
                    "connected": worker.connected,
                    "serving": bool(fresh and report.fresh),
                    "restarts": worker.restarts,
                    "failure": worker.failure,
                    "requests": report.requests if report else 0,
                    "connections": report.connections if fresh else 0,
                    "in_flight": sum(n for _, _, n in report.in_flight) if fresh else 0,
                    "queued": sum(n for _, _, n in report.queued) if fresh else 0,
                    "lease_left": report.lease_left if fresh else None,
                    # "tenant/acme/rpm": its share, for each quota it holds some of
                    "quota_shares": {f"{k}/{i}/{limit}": n for k, i, limit, n in report.quota_shares}
                    if fresh
                    else {},
                }
            )
        return out

    def traffic_totals(self) -> tuple[float, float, float]:
        """The workers' gateway counters, summed (each as of its last report)."""
        reports = [w.report for w in self._workers.values() if w.report is not None]
        return tuple(sum(r.traffic[i] for r in reports) for i in range(3))  # type: ignore[return-value]

    def queue_depths(self) -> dict[str, dict[int, int]]:
        depths: dict[str, dict[int, int]] = {}
        for report in self._fresh_reports():
            for model, band, n in report.queued:
                bands = depths.setdefault(model, {})
                bands[band] = bands.get(band, 0) + n
        return depths

    def idle_for(self, model: str) -> float:
        """The least any worker says: a model is idle only if it is idle everywhere."""
        idle = [dict(report.idle_for).get(model, 0.0) for report in self._fresh_reports()]
        return min(idle) if idle else 0.0

    def in_flight(self, model: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for report in self._fresh_reports():
            for m, replica, n in report.in_flight:
                if m == model:
                    counts[replica] = counts.get(replica, 0) + n
        return counts

    def adapters_in_flight(self) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = {}
        for report in self._fresh_reports():
            for replica, adapter, n in report.adapters_in_flight:
                counts[(replica, adapter)] = counts.get((replica, adapter), 0) + n
        return counts

    def adapters_waiting(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for report in self._fresh_reports():
            for adapter, n in report.adapters_waiting:
                counts[adapter] = counts.get(adapter, 0) + n
        return counts

    async def quiesce(self, replica: str, adapter: str) -> bool:
        """Once every connected worker has reported serving by the routes of now or later and
        has no request for ``adapter`` on ``replica``: True; False after QUIESCE_TIMEOUT. The
        routes pushed now no longer offer it, so none starts one after that report."""
        version = self.routes_changed.version
        with trio.move_on_after(QUIESCE_TIMEOUT):
            while True:
                pending = [
                    w
                    for w in self._workers.values()
                    if w.connected
                    and (
                        w.report is None
                        or w.report.routes_version < version
                        or any(r == replica and a == adapter and n for r, a, n in w.report.adapters_in_flight)
                    )
                ]
                if not pending:
                    return True
                await self._reported.wait()
        return False

    def _fresh_reports(self) -> list[Report]:
        now = trio.current_time()
        return [
            w.report
            for w in self._workers.values()
            if w.report is not None and now - w.reported_at < REPORT_STALE
        ]

    # --- the loop --------------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self._directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self._directory, 0o700)
        adopted = self._find_running()
        self._reserve_port()
        if self._count > 1:
            self._ledger = LeaseLedger(trio.current_time(), ttl=self._lease_ttl, awaiting=adopted)
        try:
            async with trio.open_nursery() as nursery:
                for index in range(self._count):
                    worker = adopted.pop(f"w{index}", None) or _Worker(id=f"w{index}")
                    self._workers[worker.id] = worker
                    nursery.start_soon(self._keep, worker)
                for extra in adopted.values():  # an earlier server ran more than this one wants
                    log.info(
                        "gateway worker %s (pid %d): not wanted any more, stopping it", extra.id, extra.pid
                    )
                    nursery.start_soon(self._retire, extra)
                if self._ledger is not None:
                    nursery.start_soon(self._kill_the_silent)
                # Up once every worker serves: a client told the port may use it at once. A
                # worker that ended first is no reason to wait on, nor to stop the server (the
                # admin API, the link and the reconciler serve on, and say what is wrong).
                with trio.move_on_after(CONNECT_WITHIN):
                    for worker in self._workers.values():
                        await worker.settled.wait()
                late = [w for w in self._workers.values() if not w.serving.is_set()]
                if late:
                    log.error(
                        "gateway worker(s) %s not serving: the gateway port has %s behind it; "
                        "each is started again with a backoff (ctl workers and /healthz say why)",
                        ", ".join(
                            f"{w.id} ({w.failure or f'not serving after {CONNECT_WITHIN:.0f} s'})"
                            for w in late
                        ),
                        "no one" if len(late) == len(self._workers) else "fewer workers",
                    )
                task_status.started(self._port)
        finally:
            if self._stop_on_exit:
                with trio.CancelScope(shield=True):
                    async with trio.open_nursery() as nursery:
                        for worker in self._workers.values():
                            nursery.start_soon(self._stop, worker)
            if self._reserved is not None:
                self._reserved.close()

    def _find_running(self) -> dict[str, _Worker]:
        """The workers an earlier server left running, by id; stale files of dead ones removed."""
        found = {}
        for state_file in sorted(self._directory.glob("*.state.json")):
            try:
                state = json.loads(state_file.read_text())
                worker_id, pid, started, port = state["id"], state["pid"], state["start_time"], state["port"]
            except (OSError, ValueError, KeyError) as exc:
                log.warning("ignoring %s: %s", state_file, exc)
                continue
            if started is not None and start_time_of(pid) == started:
                if self._port and port != self._port:
                    log.info(
                        "gateway worker %s (pid %d) listens on %d, not %d: stopping it",
                        worker_id,
                        pid,
                        port,
                        self._port,
                    )
                    _signal(_Worker(id=worker_id, pid=pid, start_time=started), signal.SIGTERM)
                    continue
                self._port = self._port or port
                found[worker_id] = _Worker(id=worker_id, pid=pid, start_time=started, adopted=True)
                log.info("gateway worker %s (pid %d) still serves: adopting it", worker_id, pid)
            else:
                state_file.unlink(missing_ok=True)
        for worker in found.values():
            try:
                worker.outdated = load_spec(spec_path(self._directory, worker.id)) != self._spec(worker.id)
            except (OSError, ValueError):
                worker.outdated = True
        return found

    def _reserve_port(self) -> None:
        """Binds (without listening: it takes no connections) the gateway port with SO_REUSEPORT:
        port 0 becomes a real port every worker then binds, and no other program can take it
        while the server runs."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((self._host, self._port))
        self._port = sock.getsockname()[1]
        self._reserved = sock

    async def _keep(self, worker: _Worker) -> None:
        """Keeps one worker running and up to date, for the life of the server."""
        if worker.outdated:
            log.info(
                "gateway worker %s (pid %d) runs with other settings: replacing it", worker.id, worker.pid
            )
            await self._retire(worker)
            worker.pid, worker.adopted, worker.outdated, worker.lease_reported = 0, False, False, False
        while True:
            if not _alive(worker):
                if worker.pid:
                    # A process of this id ended, however that was found: the ledger hears of it
                    # before the next one reports under the same id (else it would take the new
                    # one's reports, numbered from 1 again, for old ones and ignore them).
                    await self._ended(worker)
                await self._start(worker)
            try:
                await self._follow(worker)
            except (LinkLost, OSError, EOFError, trio.TooSlowError) as exc:
                log.warning("gateway worker %s (pid %d): %s", worker.id, worker.pid, exc)
            worker.connected = False
            if _alive(worker):
                await trio.sleep(0.2)  # alive: the link alone dropped, connect again

    async def _ended(self, worker: _Worker) -> None:
        """The worker's process ended: the ledger is told, the failure kept, the restart delayed."""
        if self._ledger is not None:
            self._ledger.gone(worker.id, trio.current_time())  # its requests died with it
        # The next process under this id is new to the ledger: no grant before its report.
        worker.lease_reported = False
        delay = reconnect_delay(
            worker.restarts, initial=RESTART_INITIAL, maximum=RESTART_MAX, draw=random.random()
        )
        worker.restarts += 1
        status = None
        if worker.process is not None:
            status = await worker.process.wait()  # ours: reaped, not left a zombie
        killed = status is not None and status < 0
        if status is None:
            ended = "died"  # adopted: not ours to reap
        elif killed:
            ended = f"was killed by signal {-status}"
        else:
            ended = f"exited with status {status}"
        # Shown by ctl workers and /healthz until it serves again: the gateway port may have
        # no one behind it, and the worker's own last words say why (a kill leaves none).
        output = "" if killed else last_lines(self._directory / f"{worker.id}.log")
        worker.failure = f"{ended}: {output}" if output else ended
        worker.settled.set()
        # A kill is the server's own (a silent worker) or an operator's; any other end is a fault.
        (log.warning if killed else log.error)(
            "gateway worker %s (pid %d) %s\n(its log: %s); starting it again in %.1f s",
            worker.id,
            worker.pid,
            worker.failure,
            self._directory / f"{worker.id}.log",
            delay,
        )
        worker.pid = 0
        await trio.sleep(delay)

    def _keys_now(self) -> Keys:
        keys = self._keys()
        if self._ledger is not None:
            subjects = {("tenant", t.name): t.limits for t in keys.tenants}
            subjects |= {("key", k.id): k.limits for k in keys.keys}
            for subject, limits in subjects.items():
                self._ledger.set_limits(subject, None if limits is None else limits.limits())
            for gone in self._subjects - subjects.keys():
                self._ledger.set_limits(gone, None)
            self._subjects = set(subjects)
        return keys

    def _routes_now(self) -> Routes:
        version = self.routes_changed.version  # before building: what they include at least
        routes = attrs.evolve(self._routes(), version=version)
        if self._ledger is not None:
            self._ledger.set_replicas(
                {r.replica: (m.model, r.slots) for m in routes.models for r in m.replicas}
            )
        return routes

    def _spec(self, worker_id: str) -> WorkerSpec:
        return WorkerSpec(
            id=worker_id,
            host=self._host,
            port=self._port,
            directory=str(self._directory),
            queue_timeout=self._queue_timeout,
            ttft_target=self._ttft_target,
            leased=self._count > 1,
            tenant_metrics=self._tenant_metrics,
            tracing=self._tracing,
            listener=self._listener,
        )

    async def _start(self, worker: _Worker) -> None:
        spec = self._spec(worker.id)
        path = spec_path(self._directory, worker.id)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            json.dump(cattrs.unstructure(spec), file)
        log_fd = os.open(self._directory / f"{worker.id}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            process = await trio.lowlevel.open_process(
                worker_command(path),
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                start_new_session=True,
            )
        finally:
            os.close(log_fd)
        worker.pid, worker.process, worker.adopted = process.pid, process, False
        worker.start_time, worker.heard_at = start_time_of(process.pid), trio.current_time()
        log.info("gateway worker %s started (pid %d)", worker.id, process.pid)

    async def _follow(self, worker: _Worker) -> None:
        """Connects to the worker, pushes the state, then every change; takes its reports."""
        spec_sock = self._directory / f"{worker.id}.sock"
        with trio.fail_after(CONNECT_WITHIN):
            while True:
                try:
                    stream = await trio.open_unix_socket(str(spec_sock))
                    break
                except OSError:
                    if worker.process is not None and worker.process.poll() is not None:
                        raise EOFError(f"exited with status {worker.process.returncode}") from None
                    await trio.sleep(0.05)
        link = LineStream(stream)
        worker.connected = True
        lost: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._push, link, worker, self.keys_changed, self._keys_now)
                nursery.start_soon(self._push, link, worker, self.routes_changed, self._routes_now)
                if self._ledger is not None:
                    nursery.start_soon(self._grant_when_due, link, worker)
                while True:
                    message = await link.receive()
                    if isinstance(message, Report):
                        worker.report, worker.reported_at = message, trio.current_time()
                        self._reported.set()
                        self._reported = trio.Event()
                        if message.fresh:
                            worker.restarts = 0  # it serves: the next death starts the backoff afresh
                            worker.failure = None
                            worker.serving.set()
                            worker.settled.set()
                    elif isinstance(message, Waiting):
                        self._on_waiting(message.model)
                    elif isinstance(message, NeedAdapter):
                        nursery.start_soon(self._answer_need, link, message)
                    elif isinstance(message, LeaseReport) and self._ledger is not None:
                        now = trio.current_time()
                        self._ledger.receive(message, now)
                        worker.lease_reported, worker.heard_at = True, now
                        await link.send(self._ledger.grant(worker.id, now))
                        # The report may have freed a share another worker waits for.
                        for name in self._ledger.due():
                            other = self._workers.get(name)
                            if other is not None and other is not worker:
                                other.grant_due.set()
        except* LINK_ERRORS as group:
            lost = group.exceptions[0]
        finally:
            with trio.CancelScope(shield=True):
                await link.aclose()
        raise LinkLost(str(lost))

    async def _answer_need(self, link: LineStream, need: NeedAdapter) -> None:
        answer = AdapterAnswer(ask=need.ask)
        if self.need_adapter is None:
            answer = AdapterAnswer(
                ask=need.ask, status=503, message="this server loads no adapters", code="adapter_unavailable"
            )
        else:
            try:
                await self.need_adapter(need.model, need.adapter)
            except GatewayError as e:
                answer = AdapterAnswer(ask=need.ask, status=e.status, message=e.message, code=e.code)
        # Read after the load: the routes that show it are of this version or later.
        answer = attrs.evolve(answer, routes_version=self.routes_changed.version)
        await link.send(answer)

    async def _push(
        self, link: LineStream, worker: _Worker, changes: Changes, build: Callable[[], Keys | Routes]
    ) -> None:
        seen = -1
        while True:
            version = changes.version
            if version != seen:
                seen = version
                await link.send(build())
                if self._ledger is not None and worker.lease_reported:
                    # New limits or replicas have shares now: the worker needs them before its
                    # next report's answer, or it refuses what it could already admit.
                    await link.send(self._ledger.grant(worker.id, trio.current_time()))
            await changes.wait_past(seen)

    async def _grant_when_due(self, link: LineStream, worker: _Worker) -> None:
        assert self._ledger is not None
        while True:
            await worker.grant_due.wait()
            worker.grant_due = trio.Event()
            if worker.lease_reported:
                await link.send(self._ledger.grant(worker.id, trio.current_time()))

    async def _stop(self, worker: _Worker) -> None:
        if not _alive(worker):
            return
        _signal(worker, signal.SIGTERM)
        with trio.move_on_after(STOP_GRACE):
            while _alive(worker):
                if worker.process is not None and worker.process.poll() is not None:
                    break
                await trio.sleep(0.05)
        if _alive(worker) and (worker.process is None or worker.process.poll() is None):
            _signal(worker, signal.SIGKILL)
        if worker.process is not None:
            await worker.process.wait()

    async def _retire(self, worker: _Worker) -> None:
        """Stops a worker for good, and tells the ledger it is gone (its shares come back)."""
        await self._stop(worker)
        if self._ledger is not None and not _alive(worker):
            self._ledger.gone(worker.id, trio.current_time())

    async def _kill_the_silent(self) -> None:
        """Kills each worker not heard from for a lease's length (see core.leases, Silence).

        A silent worker serves on with its last shares, and the ledger cannot give them to
        anyone else while it might; being this server's own process, it can be made gone. Its
        keeper then sees it die, tells the ledger, and starts it again.
        """
        assert self._ledger is not None
        while True:
            await trio.sleep(1.0)
            now = trio.current_time()
            for worker in list(self._workers.values()):
                if now - worker.heard_at > self._ledger.ttl and _alive(worker):
                    log.warning(
                        "gateway worker %s (pid %d) has not reported for %.0f s: killing it, so that "
                        "its shares of quotas and slots can be given out again",
                        worker.id,
                        worker.pid,
                        now - worker.heard_at,
                    )
                    _signal(worker, signal.SIGKILL)
                    worker.heard_at = now


def _alive(worker: _Worker) -> bool:
    """Whether the worker's process still runs: the pid, and the same process behind it."""
    if not worker.pid:
        return False
    if worker.process is not None and worker.process.poll() is not None:
        return False  # ours, and ended (reaped now: a zombie is no worker)
    started = start_time_of(worker.pid)
    return started is not None and (worker.start_time is None or started == worker.start_time)


def _signal(worker: _Worker, signum: int) -> None:
    if not _alive(worker):
        return  # gone, or its pid names another process now
    try:
        os.kill(worker.pid, signum)
    except ProcessLookupError:
        pass


# --- what the workers are told ------------------------------------------------------------------


def keys_message(tenants, share: Callable[[Limits], Limits] = lambda limits: limits) -> Keys:
    """server.tenants.Tenants as the workers need it: working keys as digests, tenants' limits —
    ``share`` of them, this server's part when servers sharing a store split the quotas."""
    return Keys(
        keys=tuple(
            PushedKey(
                id=record.id,
                tenant=record.tenant,
                digest=digest.hex(),
                models=record.models,
                band=record.band,
                limits=None if record.limits is None else PushedLimits.of(share(record.limits)),
            )
            for record, digest in tenants.working_keys()
        ),
        tenants=tuple(
            PushedTenant(name=t.name, limits=PushedLimits.of(share(t.limits))) for t in tenants.list_tenants()
        ),
    )


def routes_message(router, ttft_target: Callable[[str], float | None]) -> Routes:
    """server.routing.ReplicaRouter's routes for every served model."""
    models = []
    targets = []
    for model in router.models():
        if router.parent(model) is not None:
            continue  # an adapter: its base model's entry carries it
        routes = router.routes(model)
        if routes is None:
            continue
        models.append(
            PushedModel(
                model=model,
                policy=routes.policy,
                load_factor=routes.load_factor,
                prefix_chars=routes.prefix_chars,
                replicas=tuple(
                    PushedReplica(
                        replica=route.replica,
                        host=route.upstream.host,
                        port=route.upstream.port,
                        engine_key=route.upstream.engine_key,
                        slots=route.slots,
                        running=route.load.running if route.load is not None else None,
                        waiting=route.load.waiting if route.load is not None else 0,
                        saturation=route.load.saturation if route.load is not None else 0.0,
                        adapters=tuple((n, u.body_members.decode()) for n, u in route.adapters.items()),
                        body_members=route.upstream.body_members.decode(),
                    )
                    for route in routes.replicas
                ),
                adapters=tuple(name for name in router.models() if router.parent(name) == model),
                loads_adapters=routes.loads_adapters,
            )
        )
        target = ttft_target(model)
        if target is not None:
            targets.append((model, target))
    return Routes(models=tuple(models), ttft_targets=tuple(targets))
