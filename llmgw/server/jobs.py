"""Training jobs on the server: creation, sending, the agents' reports, the files coming back.

Decisions are :mod:`llmgw.core.jobs` and :mod:`llmgw.core.reassembly`; this is the shell around
them. Jobs live in memory and in the store: a change of state marks the job dirty and
:meth:`JobManager.run`'s pass writes every dirty job in one transaction before it sends anything,
so a StartJob never leaves before the Sent it follows from is durable. Progress inside a state
(step, loss, peak memory) stays in memory and is written with the next state change.

The files of a job arrive as pieces on its node's link into ``<data_dir>/adapters/.incoming/<job>/``
(0700, files 0600). When the last piece verifies, the directory is renamed into
``<data_dir>/adapters/<adapter>/`` and the adapter and the job's Succeeded are written in one
transaction; only then is the adapter listed. A crash between the rename and the commit leaves a
directory no row names, which the next start removes with whatever is in ``.incoming``.

Traced (when tracing is on): a job created by this server is a trace, ``train.job``, from its
creation to its end (failed with the reason when it fails), with a span per step as the server
sees it — ``job.queue`` (Pending), ``job.sent``, ``job.train``, ``job.convert``, ``job.upload`` —
and ``job.start``, the StartJob command, whose context the agent continues with the steps as
its node runs them. A job loaded from the store began its trace in an earlier server: untraced.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import trio

from llmgw import tracing
from llmgw.core import engines
from llmgw.core import jobs as core
from llmgw.core.liveness import NodeState
from llmgw.core.reassembly import Reassembly, ReassemblyError
from llmgw.core.training import (
    ADAPTER_NAME,
    FileDigest,
    JobState,
    PairsError,
    QaPair,
    TrainParams,
    TrainSpec,
    parse_pairs,
)
from llmgw.server.catalog import Catalog
from llmgw.server.changes import Changes
from llmgw.server.nodes import NodeRegistry, NodeUnavailable
from llmgw.server.store import AdapterRow, JobRow, Store, StoreError, adapter_files
from llmgw.wire.codec import converter
from llmgw.wire.h2link import LinkClosed
from llmgw.wire.messages import CancelJob, CommandResult, JobPiece, JobStatus, Message, Register, StartJob

log = logging.getLogger(__name__)

ADAPTERS_DIR = "adapters"
INCOMING_DIR = ".incoming"
# An agent answers a command in milliseconds; one that has not answered in this long is stuck.
COMMAND_TIMEOUT = 15.0
# The grace the agent gives the child between SIGTERM and SIGKILL on cancel.
CANCEL_GRACE = 10.0
REQUEST_FIELDS = ("model", "node", "adapter", "base_dir", "need_mib", "params", "gguf", "pairs")
# The span of each step of a job, as the server sees it (see the module's text).
STEP_SPANS = {
    JobState.PENDING: "job.queue",
    JobState.SENT: "job.sent",
    JobState.TRAINING: "job.train",
    JobState.CONVERTING: "job.convert",
    JobState.UPLOADING: "job.upload",
}


@attrs.define(eq=False)
class _JobTrace:
    root: object
    step: object = tracing.NO_SPAN


class JobError(Exception):
    """A request the manager did not carry out; each of ``problems`` names its field."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


class Invalid(JobError):
    """The request is wrong (a field's value, a model or node that does not exist)."""


class Conflict(JobError):
    """The request is sound but the state forbids it (a name taken, a job already ended)."""


class NotFound(JobError):
    """No job or adapter of that name."""


@attrs.frozen(kw_only=True)
class Adapter:
    name: str
    model: str
    job_id: str
    created: float
    files: tuple[FileDigest, ...]
    gguf: bool


class JobManager:
    def __init__(
        self,
        store: Store,
        registry: NodeRegistry,
        catalog: Catalog,
        data_dir: Path,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        # Wall-clock unix seconds, the one clock of every time a job records (shown to operators,
        # kept across restarts); a test passes its own. Command timeouts are trio's (fail_after).
        self._clock = clock
        self._registry = registry
        self._catalog = catalog
        self.adapters_dir = data_dir / ADAPTERS_DIR
        self.incoming_dir = self.adapters_dir / INCOMING_DIR
        self._jobs: dict[str, core.Job] = {}
        self._adapters: dict[str, Adapter] = {}
        self._uploads: dict[str, Reassembly] = {}
        self._dirty: set[str] = set()
        self._write_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._traces: dict[str, _JobTrace] = {}  # jobs this server created, while they last
        # Bumped when a job changes or a node comes or goes: the pass may have work.
        self.changes = Changes()
        registry.watchers.append(self)
        # Set: why no job may be created here (a store shared by several servers).
        self.refuse_new = ""

    # --- reading ----------------------------------------------------------------------------------

    def list(self) -> list[core.Job]:
        return sorted(self._jobs.values(), key=lambda j: (j.created, j.id))

    def get(self, job_id: str) -> core.Job | None:
        return self._jobs.get(job_id)

    def list_adapters(self) -> list[Adapter]:
        return [self._adapters[name] for name in sorted(self._adapters)]

    def adapter_file(self, name: str, file: str) -> tuple[Path, FileDigest]:
        adapter = self._adapters.get(name)
        if adapter is None:
            raise NotFound([f'adapter: no adapter "{name}"'])
        for digest in adapter.files:
            if digest.name == file:
                return self.adapters_dir / name / file, digest
        names = ", ".join(f.name for f in adapter.files)
        raise NotFound([f'file: adapter "{name}" has no file "{file}" (it has {names})'])

    def upload_progress(self, job_id: str) -> tuple[int, int] | None:
        """(bytes received, bytes announced) of a job's upload in progress."""
        upload = self._uploads.get(job_id)
        return None if upload is None else (upload.received_bytes, upload.total_bytes)

    # --- start ----------------------------------------------------------------------------------

    async def load(self, *, shared: bool = False) -> None:
        """Jobs and adapters from the store; call after the registry's load. Whatever a previous
        run left half-received is removed; jobs that cannot continue are failed. Each adapter's
        files are made whole from the store when this data_dir lacks them (and put into the
        store when only this data_dir has them). ``shared``: other servers use the store too."""
        await trio.to_thread.run_sync(self._prepare_dirs)
        for row in await self._store.list_adapters():
            files = converter.structure(json.loads(row.files), tuple[FileDigest, ...])
            self._adapters[row.name] = Adapter(
                name=row.name,
                model=row.model,
                job_id=row.job_id,
                created=row.created,
                files=files,
                gguf=bool(row.gguf),
            )
        await trio.to_thread.run_sync(self._remove_unlisted_adapter_dirs)
        if not shared:  # on a shared store another server's staged chunks may be on their way
            if removed := await self._store.delete_unlisted_chunks():
                log.warning("adapters: removed %d chunks of files no adapter in the store names", removed)
        await adapter_files.reconcile(
            self._store, self.adapters_dir, [(a.name, a.files) for a in self._adapters.values()]
        )
        now = self._clock()
        for row in await self._store.list_jobs():
            job = converter.structure(json.loads(row.record), core.Job)
            self._jobs[job.id] = job
            after = core.after_restart(job, now)
            node = self._registry.get(job.node)
            if after.active and (node is None or node.state is NodeState.LOST):
                after = core.fail(after, f"node {job.node} lost", now)
            self._set(after, job)
        await self.flush()

    def _prepare_dirs(self) -> None:
        for path in (self.adapters_dir, self.incoming_dir):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(path, 0o700)
        for child in self.incoming_dir.iterdir():
            _remove(child)

    def _remove_unlisted_adapter_dirs(self) -> None:
        for child in self.adapters_dir.iterdir():
            if child.name != INCOMING_DIR and child.name not in self._adapters:
                log.warning("adapters: removing %s, which no adapter in the store names", child)
                _remove(child)

    # --- the operator -----------------------------------------------------------------------------

    async def create(self, body: object) -> core.Job:
        """A new Pending job from the admin API's request body; raises Invalid or Conflict."""
        if self.refuse_new:
            raise Conflict([self.refuse_new])
        spec_fields, problems = parse_request(body)
        if problems:
            raise Invalid(problems)
        model, node = spec_fields["model"], spec_fields.pop("node")
        if model not in self._catalog.models():
            problems.append(f'model: no model "{model}" in the catalog')
        registered = self._registry.get(node)
        if registered is None:
            problems.append(f'node: no node "{node}" has registered')
        else:
            problems.extend(core.memory_problems(node, registered.inventory.gpus, spec_fields["need_mib"]))
        if problems:
            raise Invalid(problems)
        name = spec_fields["adapter"]
        if name in self._adapters:
            raise Conflict([f'adapter: "{name}" already exists (made by job {self._adapters[name].job_id})'])
        for other in self._jobs.values():
            if not other.terminal and other.spec.adapter == name:
                raise Conflict([f'adapter: job {other.id} ({other.state}) is already making "{name}"'])
        if spec_fields["gguf"] is None:
            spec_fields["gguf"] = any(
                p.model == model and engines.get(p.engine).loads_gguf_adapters
                for p in self._catalog.profiles().values()
            )
        job_id = _new_id(self._jobs)
        spec = TrainSpec(job_id=job_id, **spec_fields)
        job = core.Job(id=job_id, node=node, spec=spec, created=self._clock())
        self._set(job, None)
        await self.flush()
        return job

    async def cancel(self, job_id: str) -> core.Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound([f'job: no job "{job_id}"'])
        node = self._registry.get(job.node)
        try:
            decision = core.cancel(job, node is not None and node.connected, self._clock())
        except core.CancelRefused as e:
            raise Conflict([str(e)]) from None
        self._set(decision.job, job)
        if decision.send:
            self._spawn(self._send_cancel, job_id)
        await self.flush()
        return self._jobs[job_id]

    # --- the pass -------------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Sends what can be sent each time something changes; writes what changed."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                seen = -1
                while True:
                    seen = await self.changes.wait_past(seen)
                    await self.flush()
                    await self._send_pending()
        finally:
            self._nursery = None
            with trio.CancelScope(shield=True):
                await self.flush()  # a graceful stop loses nothing

    async def _send_pending(self) -> None:
        connected = [node.name for node in self._registry.list() if node.connected]
        chosen = core.to_send(self._jobs.values(), connected)
        if not chosen:
            return
        now = self._clock()
        for job in chosen:
            self._set(core.mark_sent(job, now), job)
        await self.flush()  # Sent is durable before StartJob leaves
        for job in chosen:
            self._spawn(self._send_start, job.id)

    async def _send_start(self, job_id: str) -> None:
        job = self._jobs[job_id]
        trace = self._traces.get(job_id)
        parent = trace.step if trace is not None else tracing.NO_SPAN
        try:
            with (
                trio.fail_after(COMMAND_TIMEOUT),
                tracing.use(parent),
                tracing.span("job.start", {"llmgw.node": job.node}, kind="client"),
            ):
                command = StartJob(id=0, spec=job.spec, trace=tracing.inject() if trace is not None else {})
                reply = await self._registry.call(job.node, command)
        except NodeUnavailable:
            self._set(core.unsend(self._jobs[job_id]), self._jobs[job_id])  # never left: try again
            return
        except LinkClosed:
            return  # the agent's next Register says whether it got it
        except trio.TooSlowError:
            self._fail(job_id, f"the agent did not answer StartJob within {COMMAND_TIMEOUT:g} s")
            return
        if isinstance(reply, CommandResult) and not reply.ok:
            self._fail(job_id, f"node {job.node} refused the job: {reply.message}")

    async def _send_cancel(self, job_id: str) -> None:
        job = self._jobs.get(job_id)
        node = job.node if job else "?"
        try:
            with trio.fail_after(COMMAND_TIMEOUT):
                reply = await self._registry.call(node, CancelJob(id=0, job_id=job_id, grace=CANCEL_GRACE))
        except (NodeUnavailable, LinkClosed):
            return  # the disconnect ends a requested cancel; a Register lists it if it still runs
        except trio.TooSlowError:
            log.warning("job %s: node %s did not answer CancelJob within %g s", job_id, node, COMMAND_TIMEOUT)
            return
        current = self._jobs.get(job_id)
        if current is not None and isinstance(reply, CommandResult):
            self._set(core.cancel_answered(current, reply.ok, reply.message, self._clock()), current)

    # --- the agents' reports --------------------------------------------------------------------

    async def on_message(self, node: str, message: Message) -> None:
        """A JobStatus or JobPiece from ``node``'s link, in the order the agent sent them."""
        if isinstance(message, JobStatus):
            self._on_status(node, message)
        elif isinstance(message, JobPiece):
            await self._on_piece(node, message)
        await self.flush()

    def _on_status(self, node: str, status: JobStatus) -> None:
        job = self._jobs.get(status.job_id)
        if job is not None and job.node != node:
            log.warning("node %s reported job %s, which belongs to node %s", node, status.job_id, job.node)
            return
        if core.agent_should_cancel(job, status):
            log.info("job %s: node %s still runs it; cancelling it there", status.job_id, node)
            self._spawn(self._send_cancel_to, node, status.job_id)
            return
        if job is None:
            return
        now = self._clock()
        after = core.apply_status(job, status, now)
        if after.state == JobState.UPLOADING and job.state != JobState.UPLOADING:
            try:
                self._uploads[job.id] = Reassembly(after.files)
            except ReassemblyError as e:
                after = core.fail(after, f"upload refused: {e}", now)
            else:
                path = self.incoming_dir / job.id
                try:
                    _remove(path)
                    path.mkdir(mode=0o700)
                except OSError as e:
                    after = core.fail(after, f"upload refused: cannot make {path}: {e.strerror}", now)
        self._set(after, job)
        if after.state == JobState.FAILED and after.reason.startswith("upload refused"):
            self._spawn(self._send_cancel_to, node, job.id)

    async def _on_piece(self, node: str, piece: JobPiece) -> None:
        job = self._jobs.get(piece.job_id)
        upload = self._uploads.get(piece.job_id)
        if job is None or job.node != node or upload is None or job.state != JobState.UPLOADING:
            return  # the job ended (its pieces still in flight) or never uploaded: nothing to keep
        try:
            data = upload.accept(piece)
        except ReassemblyError as e:
            self._fail(job.id, f"upload failed: {e}")
            self._spawn(self._send_cancel_to, node, job.id)  # stop sending pieces nobody keeps
            return
        path = self.incoming_dir / job.id / piece.file
        try:
            await trio.to_thread.run_sync(_append, path, data)
        except OSError as e:  # a full disk fails this job, not the node's link
            self._fail(job.id, f"upload failed: cannot write {path}: {e.strerror}")
            self._spawn(self._send_cancel_to, node, job.id)
            return
        current = self._jobs[job.id]
        if upload.done and current.state == JobState.UPLOADING and self._uploads.get(job.id) is upload:
            await self._keep(current)

    async def _keep(self, job: core.Job) -> None:
        """Every file verified: rename into place, then register the adapter and Succeeded."""
        self._uploads.pop(job.id, None)
        target = self.adapters_dir / job.spec.adapter
        source = self.incoming_dir / job.id
        try:
            await trio.to_thread.run_sync(_rename_new, source, target)
        except OSError as e:
            self._fail(job.id, f"cannot keep the adapter's files: {e}")
            return
        # The bytes go into the store too (staged, named in the finish's transaction): the
        # store, not this data_dir, is what a copy moves and other servers read.
        staged = adapter_files.job_staging(job.id)
        try:
            await self._store.delete_chunks(staged)  # a previous try's, cut short
            await adapter_files.put_files(self._store, staged, target, job.files)
        except StoreError as e:
            await trio.to_thread.run_sync(_remove, target)
            self._fail(job.id, f"cannot keep the adapter's files in the store: {e}")
            return
        now = self._clock()
        done = core.succeed(job, now)
        adapter = Adapter(
            name=job.spec.adapter,
            model=job.spec.model,
            job_id=job.id,
            created=now,
            files=job.files,
            gguf=any(f.name.endswith(".gguf") for f in job.files),
        )
        try:
            async with self._write_lock:
                await self._store.finish_job(_job_row(done), _adapter_row(adapter), staged)
        except StoreError as e:
            await trio.to_thread.run_sync(_remove, target)
            with trio.CancelScope(shield=True), contextlib.suppress(StoreError):
                await self._store.delete_chunks(staged)  # else the next start removes them
            self._fail(job.id, f"cannot register the adapter: {e}")
            return
        if self._jobs.get(job.id) is not job:
            # Ended meanwhile (the node was lost during the commit): the files are kept and the
            # adapter listed, since both are complete and written; the job says Succeeded.
            log.info("job %s: ended while its adapter was being kept; it succeeded", job.id)
        self._adapters[adapter.name] = adapter
        self._jobs[job.id] = done
        self._trace(done, job)
        self._dirty.discard(job.id)
        self.changes.bump()
        log.info(
            "job %s: Succeeded; adapter %s for %s kept (%s)",
            job.id,
            adapter.name,
            adapter.model,
            ", ".join(f"{f.name} {f.size} B" for f in adapter.files),
        )

    # --- the nodes' links (called by the registry) ----------------------------------------------

    def node_attached(self, node: str, register: Register) -> None:
        attached = core.attach(self._jobs, node, register.jobs, self._clock())
        for job in attached.changed:
            self._set(job, self._jobs[job.id])
        for job_id in attached.cancel:
            log.info("job %s: node %s still runs it; cancelling it there", job_id, node)
            self._spawn(self._send_cancel_to, node, job_id)
        self.changes.bump()  # a node to send to

    def node_detached(self, node: str) -> None:
        for job in core.disconnected(self._jobs.values(), node, self._clock()):
            self._set(job, self._jobs[job.id])
        self.changes.bump()

    def node_lost(self, node: str) -> None:
        for job in core.node_lost(self._jobs.values(), node, self._clock()):
            self._set(job, self._jobs[job.id])

    # --- internals --------------------------------------------------------------------------------

    async def _send_cancel_to(self, node: str, job_id: str) -> None:
        try:
            with trio.fail_after(COMMAND_TIMEOUT):
                await self._registry.call(node, CancelJob(id=0, job_id=job_id, grace=CANCEL_GRACE))
        except (NodeUnavailable, LinkClosed, trio.TooSlowError) as e:
            log.info("job %s: could not cancel it on node %s: %s", job_id, node, e or "timed out")

    def _fail(self, job_id: str, reason: str) -> None:
        job = self._jobs[job_id]
        self._set(core.fail(job, reason, self._clock()), job)

    def _set(self, after: core.Job, before: core.Job | None) -> None:
        """Records a job's new value; logs and marks it for writing when more than progress moved."""
        self._jobs[after.id] = after
        if before is not None and after == before:
            return
        self._trace(after, before)
        progress_only = (
            before is not None
            and attrs.evolve(
                after,
                step=before.step,
                loss=before.loss,
                peak_mib=before.peak_mib,
                total_steps=before.total_steps,
                device=before.device,
            )
            == before
        )
        if not progress_only:
            self._dirty.add(after.id)
        if before is None or after.state != before.state:
            why = f": {after.reason}" if after.reason and after.terminal else ""
            log.info("job %s (%s on %s): %s%s", after.id, after.spec.adapter, after.node, after.state, why)
            if after.state == JobState.FAILED and after.log_tail:
                log.warning(
                    "job %s: the child's last lines:\n  %s", after.id, "\n  ".join(after.log_tail[-8:])
                )
        if after.terminal and after.id in self._uploads:
            del self._uploads[after.id]
        if after.terminal and after.state != JobState.SUCCEEDED:
            path = self.incoming_dir / after.id
            if path.exists():
                _remove(path)  # nothing of a failed upload is kept
        self.changes.bump()

    def _trace(self, after: core.Job, before: core.Job | None) -> None:
        """Moves the job's trace on: a step's span ends when its state does."""
        if not tracing.enabled():
            return
        trace = self._traces.get(after.id)
        if trace is None:
            if before is not None:
                return  # loaded from the store, or created before tracing was on
            attributes = {
                "llmgw.job": after.id,
                "llmgw.adapter": after.spec.adapter,
                "llmgw.model": after.spec.model,
                "llmgw.node": after.node,
            }
            trace = self._traces[after.id] = _JobTrace(tracing.start("train.job", attributes))
        elif before is not None and after.state == before.state:
            return  # progress inside a step
        failed = after.reason if after.state == JobState.FAILED else None
        tracing.end(trace.step, error=failed)
        if after.terminal:
            trace.root.set_attribute("llmgw.state", str(after.state))
            del self._traces[after.id]
            tracing.end(trace.root, error=failed)
        else:
            trace.step = tracing.start(STEP_SPANS[after.state], parent=trace.root)

    def _spawn(self, fn, *args) -> None:
        if self._nursery is None:
            log.warning("job manager not running; %s%s dropped", fn.__name__, args)
            return
        self._nursery.start_soon(fn, *args)

    async def flush(self) -> None:
        """Writes every job changed since the last flush, in one transaction."""
        async with self._write_lock:
            ids, self._dirty = sorted(self._dirty), set()
            rows = [_job_row(self._jobs[i]) for i in ids if i in self._jobs]
            if rows:
                await self._store.save_jobs(rows)


# --- the request ------------------------------------------------------------------------------------


def parse_request(body: object) -> tuple[dict, list[str]]:
    """TrainSpec's fields (but job_id) and ``node`` from the admin API's JSON, and every problem
    by field."""
    if not isinstance(body, dict):
        return {}, ['expected a JSON object like {"model": ..., "node": ..., "adapter": ..., "pairs": ...}']
    problems = [
        f"{key}: unknown field (expected one of: {', '.join(REQUEST_FIELDS)})"
        for key in body
        if key not in REQUEST_FIELDS
    ]
    out: dict = {}
    for key in ("model", "node", "adapter", "base_dir"):
        value = body.get(key)
        if not isinstance(value, str) or not value:
            problems.append(f"{key}: expected a non-empty string, got {json.dumps(value)}")
        out[key] = value
    if isinstance(out["adapter"], str) and out["adapter"] and not ADAPTER_NAME.fullmatch(out["adapter"]):
        problems.append(
            f"adapter: {out['adapter']!r} must be 1-63 of a-z, 0-9, '.', '_', '-', starting with a letter or digit"
        )
    if isinstance(out["base_dir"], str) and out["base_dir"] and not os.path.isabs(out["base_dir"]):
        problems.append(f"base_dir: must be an absolute path on the node, got {out['base_dir']!r}")
    need = body.get("need_mib", 0)
    if isinstance(need, bool) or not isinstance(need, int) or need < 0:
        problems.append(f"need_mib: expected a whole number of MiB, 0 or more, got {json.dumps(need)}")
    out["need_mib"] = need
    gguf = body.get("gguf")
    if gguf is not None and not isinstance(gguf, bool):
        problems.append(f"gguf: expected true, false or null, got {json.dumps(gguf)}")
    out["gguf"] = gguf
    params, param_problems = _params(body.get("params") or {})
    problems += param_problems
    out["params"] = params
    pairs, pair_problems = _pairs(body.get("pairs"))
    problems += pair_problems
    out["pairs"] = pairs
    return out, problems


def _params(raw: object) -> tuple[TrainParams, list[str]]:
    if not isinstance(raw, dict):
        return TrainParams(), [f"params: expected an object, got {json.dumps(raw)}"]
    fields = {f.name: f for f in attrs.fields(TrainParams)}
    problems = []
    values: dict = {}
    for key, value in raw.items():
        if key not in fields:
            problems.append(f"params.{key}: unknown (expected one of: {', '.join(fields)})")
            continue
        default = fields[key].default
        if isinstance(default, tuple):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                problems.append(f"params.{key}: expected a list of names, got {json.dumps(value)}")
                continue
            value = tuple(value)
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, int | float):
                problems.append(f"params.{key}: expected a number, got {json.dumps(value)}")
                continue
            value = float(value)
        elif isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"params.{key}: expected an integer, got {json.dumps(value)}")
            continue
        values[key] = value
    params = TrainParams(**values)
    problems += [f"params.{problem}" for problem in params.problems()]
    return params, problems


def _pairs(raw: object) -> tuple[tuple[QaPair, ...], list[str]]:
    """Pairs as JSONL text (what the operator's file holds) or as a list of objects."""
    if isinstance(raw, list):
        raw = "\n".join(json.dumps(item) for item in raw)
    if not isinstance(raw, str):
        return (), [f"pairs: expected JSONL text or a list of {{question, answer}}, got {json.dumps(raw)}"]
    try:
        return parse_pairs(raw), []
    except PairsError as e:
        return (), [f"pairs: {problem}" for problem in e.problems]


# --- files and rows -----------------------------------------------------------------------------------


def _new_id(taken: dict) -> str:
    while True:
        job_id = f"j-{secrets.token_hex(4)}"
        if job_id not in taken:
            return job_id


def _job_row(job: core.Job) -> JobRow:
    record = json.dumps(converter.unstructure(job), ensure_ascii=False)
    # str(): the column holds the state's plain string whatever the driver makes of an enum.
    return JobRow(job.id, job.node, str(job.state), job.created, record)


def _adapter_row(adapter: Adapter) -> AdapterRow:
    files = json.dumps(converter.unstructure(adapter.files))
    return AdapterRow(adapter.name, adapter.model, adapter.job_id, adapter.created, files, int(adapter.gguf))


def _append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _rename_new(source: Path, target: Path) -> None:
    """Renames a complete directory into place; refuses to replace one (rename would)."""
    if target.exists():
        raise FileExistsError(f"{target} already exists")
    for child in source.iterdir():
        os.chmod(child, 0o600)
    os.rename(source, target)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
