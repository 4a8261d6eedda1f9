"""The agent's shard supervisor: runs shards' processes, reports their states, adopts survivors.

A shard is one task of the supervisor's nursery; inside it, one nursery (the shard's scope) holds
the launch, a watcher per process, a follower per output file and the readiness check. The shard
ends on the first of: its engine exits, a sidecar exits, it cannot start (the leader never
listened, a program would not run), or a stop. Ending cancels the shard's scope and runs its
teardown: signal each process group (engine first), SIGKILL what is left after the grace, take
the last output into the tail, remove the state and output files, report Stopped or Failed.

Cancelling ``run()`` — the agent stopping or restarting — cancels these tasks *without* a
teardown: engines keep running, their state files stay, and the next agent adopts them, so an
agent restart costs no model reload. ``stop_all()`` is how engines are stopped on purpose.

States only move forward: Starting → Loading → Ready → Draining, then Stopped or Failed; every
change goes through :data:`~llmgw.core.reports.SHARD_LIFECYCLE`.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from llmgw import tracing
from llmgw.agent import runas, shard_state
from llmgw.agent.adapters import AdapterCache, NotDelivered
from llmgw.agent.discovery.nvml import gpu_memory_by_pid
from llmgw.agent.installs import EngineInstalls, InstallFailed
from llmgw.agent.processes import (
    KILL_WAIT,
    OutputFollower,
    ProcessRecord,
    base_environment,
    describe_exit,
    group_is_ours,
    in_initial_pid_namespace,
    members,
    open_pidfd,
    process_table,
    read_cmdline,
    read_stat,
    spawn,
    stop_groups,
    wait_for_exit,
)
from llmgw.agent.shard_state import ShardRecord
from llmgw.agent.weights import FetchFailed, WeightsCache
from llmgw.core.engines import EngineBinaries, InvalidShard, build_plan
from llmgw.core.engines.common import listen_address
from llmgw.core.engines.load_metrics import busy_requests
from llmgw.core.engines.tracing import EngineTracing, traced_plan
from llmgw.core.reports import SHARD_LIFECYCLE
from llmgw.core.shard import LaunchPlan, ShardSpec
from llmgw.core.weights import WeightsError
from llmgw.http_probe import ProbeFailed, http_get
from llmgw.wire.messages import Compute, GpuUse, RunningShard, ShardState, ShardStatus

log = logging.getLogger(__name__)

# Lines of output kept per shard and sent with a failure: enough for a traceback.
TAIL_LINES = 50
# How often output files are read into the tail.
FOLLOW_INTERVAL = 0.2
# One readiness or metrics request; a loaded engine still answers within this.
PROBE_TIMEOUT = 5.0
# Between attempts to reach the leader's rendezvous port, and the most one attempt may take (an
# address that drops packets would otherwise hold a connect for minutes).
LEADER_POLL = 0.5
LEADER_CONNECT_TIMEOUT = 5.0
# After Ready, how long a GPU shard's memory may take to show in NVML: engines allocate their KV
# cache right around the moment they first answer.
COMPUTE_WAIT = 30.0
# Grace for what is left of a shard whose engine or sidecar failed (a Ray head, forked workers).
FAILED_GRACE = 10.0
# How often fetched weights are checked for removal: often enough that max_idle is kept to within
# this, rarely enough that listing the cache costs nothing.
WEIGHTS_SWEEP_INTERVAL = 600.0


@attrs.define(eq=False)
class _Shard:
    spec: ShardSpec
    engine_key: str | None = attrs.field(repr=False)
    commands: tuple[str, ...]  # the plan's command names; the last is the engine
    health_port: int | None
    directory: Path
    adopted: bool
    state: ShardState = ShardState.STARTING  # changed only through SHARD_LIFECYCLE
    compute: Compute | None = None
    processes: list[ProcessRecord] = attrs.field(factory=list)
    children: list[trio.Process] = attrs.field(factory=list)  # the ones this agent started
    pidfds: dict[int, int] = attrs.field(factory=dict)  # adopted processes: pid → pidfd
    tail: collections.deque[str] = attrs.field(factory=lambda: collections.deque(maxlen=TAIL_LINES))
    followers: list[OutputFollower] = attrs.field(factory=list)
    launched: trio.Event = attrs.field(factory=trio.Event)  # every command runs
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    # From the start command until Ready or the end (the server's trace, continued); NO_SPAN off.
    span: Any = tracing.NO_SPAN
    ended: tuple[ShardState, str] | None = None  # (Stopped or Failed, reason), set once
    grace: float = FAILED_GRACE  # for what is left at the end; a stop sets its own
    done: trio.Event = attrs.field(factory=trio.Event)  # torn down and forgotten

    @property
    def engine_pid(self) -> int:
        complete = len(self.processes) == len(self.commands)
        return self.processes[-1].pid if complete else 0

    def record(self) -> ShardRecord:
        return ShardRecord(
            spec=self.spec,
            engine_key=self.engine_key,
            commands=self.commands,
            health_port=self.health_port,
            processes=tuple(self.processes),
            compute=self.compute,
        )

    def follow(self, record: ProcessRecord) -> OutputFollower:
        # Sidecars' lines are marked so that one tail tells whose output is whose.
        prefix = "" if record.name == self.commands[-1] else f"[{record.name}] "
        follower = OutputFollower(self.directory / f"{record.name}.out", self.tail, prefix)
        self.followers.append(follower)
        return follower


class Supervisor:
    """Runs this node's shards. ``run()`` must be running for the other methods to act."""

    def __init__(
        self,
        work_dir: Path,
        *,
        binaries: EngineBinaries,
        run_as: str | None = "llmgw-engine",
        on_status: Callable[[ShardStatus], None],
        nvml: Any = None,
        leader_wait: float = 600.0,
        stop_grace: float = 30.0,
        health_interval: float = 1.0,
        also_ours: Callable[[], frozenset[int]] | None = None,
        adapters: AdapterCache | None = None,
        weights: WeightsCache | None = None,
        installs: EngineInstalls | None = None,
        engine_tracing: EngineTracing | None = None,
    ) -> None:
        self._work_dir = work_dir
        # The agent's tracing, for engines that trace too (core.engines.tracing); None: off.
        self._engine_tracing = engine_tracing
        # Weights the shards' models name by URL or hub reference, fetched before the engine starts.
        self.weights = weights or WeightsCache(work_dir / "weights", work_dir=work_dir, run_as=run_as)
        # Engine builds profiles name (engine_version), installed before the engine starts.
        self.installs = installs or EngineInstalls(work_dir / "engines")
        # Where the stored adapters a shard names were delivered (by the link).
        self._adapters = adapters or AdapterCache(work_dir, run_as)
        # Pids that are ours though no shard describes them (training children); blocking.
        self._also_ours = also_ours
        self._shards_dir = work_dir / "shards"
        self._binaries = binaries
        self._run_as = run_as
        self._on_status = on_status
        self._nvml = nvml
        self._leader_wait = leader_wait
        self.stop_grace = stop_grace  # a stop's grace when it names none (engines.stop_grace)
        self._health_interval = health_interval
        self._shards: dict[str, _Shard] = {}
        self._nursery: trio.Nursery | None = None
        self._running = False
        self._recovered = trio.Event()
        self._user_note_logged = False

    # --- the public face ---------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Adopts what an earlier agent left running, reports started, then serves until cancelled.

        Started comes once every state file has been judged, so that the agent's first Register
        lists the adopted shards; their health checks go on in the background.
        """
        try:
            async with trio.open_nursery() as nursery:
                self._running = True
                self._nursery = nursery
                await self._recover()
                self._recovered.set()
                task_status.started()
                await self._sweep_weights()
        finally:
            self._running = False

    async def start(self, spec: ShardSpec, engine_key: str | None) -> tuple[bool, str]:
        """Starts a shard; returns once it is under way (its states are reported as they come)."""
        await self._recovered.wait()
        existing = self._shards.get(spec.shard_id)
        if existing is not None:
            if existing.ended is None:
                return True, "already running"
            return False, "still stopping; start it again once it has stopped"
        try:
            if problem := shard_state.id_problem(spec.shard_id):
                raise InvalidShard([problem])
            # Stored adapters become paths on this node for the command line only: the spec kept
            # and reported stays the server's.
            launched = spec
            if any(adapter.source for adapter in spec.adapters):
                launched = await trio.to_thread.run_sync(self._adapters.resolve, spec)
            # Fetched weights: the engine is given the cache's copy, which _launch fetches first.
            if self.weights.key(spec) is not None:
                launched = attrs.evolve(launched, model_path=str(self.weights.local_path(spec)))
            binaries = self._binaries
            if self.installs.wanted(spec):
                binaries = self.installs.binaries(spec, binaries)
            plan = build_plan(launched, engine_key=engine_key, binaries=binaries)
            plan = traced_plan(plan, spec.engine, self._engine_tracing)  # the engine's own traces
        except InstallFailed as exc:
            self._emit(spec, ShardState.FAILED, reason=str(exc))
            return False, str(exc)
        except WeightsError as exc:
            self._emit(spec, ShardState.FAILED, reason=f"weights: {exc}")
            return False, f"weights: {exc}"
        except NotDelivered as exc:
            self._emit(spec, ShardState.FAILED, reason=str(exc))
            return False, str(exc)
        except InvalidShard as exc:
            self._emit(spec, ShardState.FAILED, reason=f"invalid shard: {exc}")
            return False, f"invalid shard: {exc}"
        shard = _Shard(
            spec=spec,
            engine_key=engine_key,
            commands=tuple(command.name for command in plan.commands),
            health_port=plan.health_port,
            directory=shard_state.shard_dir(self._shards_dir, spec.shard_id),
            adopted=False,
        )
        self._shards[spec.shard_id] = shard
        shard.span = tracing.start(
            "shard.until_ready",
            {"llmgw.replica": spec.replica_id, "llmgw.shard": spec.shard_id, "llmgw.model": spec.model},
        )
        log.info("starting shard %s of replica %s (%s)", spec.shard_id, spec.replica_id, spec.model)
        self._report(shard)
        self._spawner().start_soon(self._run_shard, shard, plan)
        return True, "starting"

    async def stop(self, shard_id: str, grace: float | None = None) -> tuple[bool, str]:
        """Stops a shard: SIGTERM to each process group, SIGKILL after ``grace`` seconds (None:
        the agent's engines.stop_grace).

        Returns once nothing of it is left. A shard this agent does not run counts as stopped
        (ok, "not running"): what the server wants, no such shard here, holds.
        """
        await self._recovered.wait()
        shard = self._shards.get(shard_id)
        if shard is None:
            return True, "not running"
        if shard.ended is None:
            shard.grace = self.stop_grace if grace is None else grace
            self._end(shard, ShardState.STOPPED, "")
        await shard.done.wait()
        assert shard.ended is not None
        state, reason = shard.ended
        return True, "stopped" if state == ShardState.STOPPED else f"it had ended already: {reason}"

    async def drain(
        self,
        shard_id: str,
        timeout: float,  # noqa: ASYNC109 (it ends the wait, not the drain: the shard stops either way)
        grace: float | None = None,
    ) -> tuple[bool, str]:
        """Stops a shard once its engine holds no request (running or queued), or after ``timeout``.

        The engine's /metrics says; an engine whose metrics cannot be read is given the whole
        timeout. A shard that was not Ready has no requests (nothing routes to it) and a rank
        that serves no HTTP has none of its own: both stop at once.
        """
        await self._recovered.wait()
        shard = self._shards.get(shard_id)
        if shard is None:
            return True, "not running"
        if shard.ended is None:
            was_ready = shard.state == ShardState.READY
            self._advance(shard, ShardState.DRAINING)
            if was_ready and shard.health_port is not None:
                with trio.move_on_after(timeout):
                    await self._until_idle(shard)
        return await self.stop(shard_id, grace)

    async def stop_all(self, grace: float) -> None:
        """Stops every shard. After run() has ended (the agent's own shutdown, with
        engines.stop_shards_on_exit) no shard task is left to do it, so the teardown is done here."""
        async with trio.open_nursery() as nursery:
            for shard in list(self._shards.values()):
                if self._running:
                    nursery.start_soon(self.stop, shard.spec.shard_id, grace)
                    continue
                if shard.ended is None:
                    shard.grace = grace
                    shard.ended = (ShardState.STOPPED, "")
                nursery.start_soon(self._teardown, shard)

    def running(self) -> list[RunningShard]:
        """The shards that run (not those being torn down), for Register."""
        return [
            RunningShard(
                spec=shard.spec,
                state=shard.state,
                pid=shard.engine_pid,
                compute=shard.compute,
                adopted=shard.adopted,
            )
            for shard in self._shards.values()
            if shard.ended is None
        ]

    def log_tail(self, shard_id: str) -> tuple[str, ...]:
        """The last lines of a running shard's output (sidecars' lines marked with their name)."""
        shard = self._shards.get(shard_id)
        return tuple(shard.tail) if shard is not None else ()

    def own_pids(self) -> frozenset[int]:
        """Every living process of every shard (for discovery's foreign-process check). Blocking:
        it reads /proc."""
        return frozenset(members(self._our_pgids(), process_table()))

    # --- adoption --------------------------------------------------------------------------------

    async def _recover(self) -> None:
        found = await trio.to_thread.run_sync(shard_state.read_all, self._shards_dir)
        for directory, record in found:
            if isinstance(record, ValueError):
                # Nothing in it can be trusted to name processes; what it ran, if it holds GPU
                # memory, is found by the sweep below.
                log.error("%s; removing %s", record, directory)
                await trio.to_thread.run_sync(shard_state.remove, directory)
                continue
            shard = _Shard(
                spec=record.spec,
                engine_key=record.engine_key,
                commands=record.commands,
                health_port=record.health_port,
                directory=directory,
                adopted=True,
                compute=record.compute,
                processes=list(record.processes),
            )
            for process in shard.processes:
                shard.follow(process)
            self._shards[shard.spec.shard_id] = shard
            why_not = self._adopt(shard)
            if tracing.enabled():  # a trace of its own: the one that started it ended with its agent
                attributes = {
                    "llmgw.shard": shard.spec.shard_id,
                    "llmgw.replica": shard.spec.replica_id,
                    "llmgw.model": shard.spec.model,
                }
                with tracing.span("agent.adopt_shard", attributes) as adopting:
                    if why_not:
                        tracing.fail(adopting, why_not)
            if why_not:
                log.warning("shard %s: %s", shard.spec.shard_id, why_not)
                shard.ended = (ShardState.FAILED, why_not)
                self._spawner().start_soon(self._teardown, shard)
            else:
                log.info("adopted shard %s (engine pid %d)", shard.spec.shard_id, shard.engine_pid)
                self._report(shard, reason="adopted after an agent restart")
                self._spawner().start_soon(self._run_shard, shard, None)
        await self._kill_foreign_gpu_processes()

    def _adopt(self, shard: _Shard) -> str:
        """Holds a pidfd to each of the shard's processes; "" when all are there, else why not."""
        if len(shard.processes) < len(shard.commands):
            return "the agent went down while starting it"
        # The engine first: its exit is the shard's, and the more useful reason.
        for process in reversed(shard.processes):
            pidfd = open_pidfd(process)
            if pidfd is None:
                for fd in shard.pidfds.values():
                    os.close(fd)
                shard.pidfds.clear()
                who = "" if process.name == shard.commands[-1] else f"sidecar {process.name} "
                return f"{who}exited while the agent was down"
            shard.pidfds[process.pid] = pidfd
        return ""

    async def _kill_foreign_gpu_processes(self) -> None:
        """Kills processes holding GPU memory that no shard describes (and that are not the agent).

        Placement counts a GPU's memory as free when no shard holds it; a process it cannot see
        would make the next engine there fail to allocate, or share a card it was promised alone.
        """
        by_pid = await trio.to_thread.run_sync(gpu_memory_by_pid, self._nvml)
        if not by_pid:
            return
        if not in_initial_pid_namespace():
            log.warning(
                "processes %s hold GPU memory, and this agent runs in a pid namespace of its own where "
                "NVML's pids may name other processes: leaving them alone",
                sorted(by_pid),
            )
            return
        table = await trio.to_thread.run_sync(process_table)
        ours = members(self._our_pgids(), table) | {os.getpid()}
        if self._also_ours is not None:
            ours |= await trio.to_thread.run_sync(self._also_ours)
        for pid, cards in sorted(by_pid.items()):
            if pid in ours:
                continue
            held = ", ".join(f"GPU {card.index}: {card.used_mib} MiB" for card in cards)
            log.warning(
                "killing pid %d, which holds GPU memory (%s) that no shard of this agent describes", pid, held
            )
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # --- a shard's life ----------------------------------------------------------------------------

    async def _run_shard(self, shard: _Shard, plan: LaunchPlan | None) -> None:
        """Runs a shard until it ends, then tears it down; ``plan`` is None for an adopted one."""
        with shard.scope, tracing.use(shard.span):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._become_ready, shard)
                if plan is None:
                    for process in shard.processes:
                        nursery.start_soon(self._watch_adopted, shard, process)
                    for follower in shard.followers:
                        nursery.start_soon(follower.follow, FOLLOW_INTERVAL)
                    shard.launched.set()
                else:
                    await self._launch(shard, plan, nursery)
        # Reached only through _end: a cancellation of run() leaves the processes running.
        await self._teardown(shard)

    async def _launch(self, shard: _Shard, plan: LaunchPlan, nursery: trio.Nursery) -> None:
        # Before the state file: an agent that dies while fetching leaves no shard to adopt, only
        # a partial download, which the shard's next start resumes.
        if self.installs.wanted(shard.spec):
            try:
                await self.installs.ensure(shard.spec, lambda text: self._report(shard, reason=text))
            except InstallFailed as exc:
                self._end(shard, ShardState.FAILED, str(exc))
                return
            self._report(shard)
        if self.weights.key(shard.spec) is not None:
            try:
                await self.weights.fetch(shard.spec, lambda text: self._report(shard, reason=text))
            except FetchFailed as exc:
                self._end(shard, ShardState.FAILED, str(exc))
                return
            self._report(shard)  # the progress shown so far is over
        try:
            user = await trio.to_thread.run_sync(self._engine_user)
            await trio.to_thread.run_sync(shard_state.make_dirs, self._shards_dir, shard.spec.shard_id)
        except runas.NoEngineUser as exc:
            self._end(shard, ShardState.FAILED, str(exc))
            return
        except OSError as exc:
            self._end(shard, ShardState.FAILED, f"cannot prepare the shard's directories: {exc}")
            return
        # Written before anything runs: an agent that dies from here on leaves a record.
        if not await self._save(shard):
            return
        environment = base_environment(user)
        for command in plan.commands:
            if command.waits_for_leader and not await self._leader_listens_traced(shard.spec):
                address = f"{shard.spec.leader_address}:{shard.spec.rendezvous_port}"
                self._end(
                    shard,
                    ShardState.FAILED,
                    f"{command.name} waits for the leader's rendezvous point {address}, "
                    f"which did not accept connections within {self._leader_wait:g}s",
                )
                return
            output = shard.directory / f"{command.name}.out"
            try:
                with tracing.span("engine.launch", {"llmgw.process": command.name}):
                    process = await spawn(
                        command.argv, env={**environment, **command.env}, user=user, output=output
                    )
            except OSError as exc:
                self._end(shard, ShardState.FAILED, f"cannot start {command.name} ({command.argv[0]}): {exc}")
                return
            stat = read_stat(process.pid)
            assert stat is not None, "an unreaped child has a /proc entry"
            record = ProcessRecord(
                name=command.name,
                pid=process.pid,
                pgid=stat.pgrp,
                argv=command.argv,
                cmdline=read_cmdline(process.pid) or (),
                start_time=stat.start_time,
            )
            shard.processes.append(record)
            shard.children.append(process)
            nursery.start_soon(shard.follow(record).follow, FOLLOW_INTERVAL)
            nursery.start_soon(self._watch_child, shard, command.name, process)
            if not await self._save(shard):
                return
        shard.launched.set()

    def _engine_user(self) -> runas.EngineUser:
        user, note = runas.resolve(self._run_as, self._work_dir)
        # Root is said at every start; another user than asked for, once.
        if note and (user.uid == 0 or not self._user_note_logged):
            log.warning(note)
            self._user_note_logged = True
        runas.prepare_home(user)
        return user

    async def _leader_listens_traced(self, spec: ShardSpec) -> bool:
        with tracing.span("leader.wait", {"llmgw.leader": f"{spec.leader_address}:{spec.rendezvous_port}"}):
            return await self._leader_listens(spec)

    async def _leader_listens(self, spec: ShardSpec) -> bool:
        with trio.move_on_after(self._leader_wait):
            while True:
                with trio.move_on_after(LEADER_CONNECT_TIMEOUT):
                    try:
                        stream = await trio.open_tcp_stream(spec.leader_address, spec.rendezvous_port)
                    except OSError:
                        pass
                    else:
                        await stream.aclose()
                        return True
                await trio.sleep(LEADER_POLL)
        return False

    async def _watch_child(self, shard: _Shard, name: str, process: trio.Process) -> None:
        returncode = await process.wait()
        self._end(shard, ShardState.FAILED, f"{self._who(shard, name)} {describe_exit(returncode)}")

    async def _watch_adopted(self, shard: _Shard, record: ProcessRecord) -> None:
        # Not this agent's child: no exit status to be had, only that it is gone.
        await wait_for_exit(shard.pidfds[record.pid])
        self._end(shard, ShardState.FAILED, f"{self._who(shard, record.name)} (pid {record.pid}) exited")

    @staticmethod
    def _who(shard: _Shard, name: str) -> str:
        return "the engine" if name == shard.commands[-1] else f"sidecar {name}"

    async def _become_ready(self, shard: _Shard) -> None:
        await shard.launched.wait()
        if shard.health_port is not None:
            with tracing.span("readiness", {"llmgw.port": shard.health_port}):
                await self._until_serving(shard)
        # A rank without HTTP is judged by staying alive: the replica's real readiness is its
        # leader answering, which happens only once every rank has joined.
        self._advance(shard, ShardState.READY)
        if shard.ended is None:
            tracing.end(shard.span)
            shard.span = tracing.NO_SPAN
        if shard.compute is None:
            await self._learn_compute(shard)

    async def _until_serving(self, shard: _Shard) -> None:
        """Starting until /health answers at all; Loading until /v1/models answers 200.

        /health alone is not readiness: llama.cpp answers it (503) while loading, and routing on
        it would send requests into a model that is not there yet.
        """
        assert shard.health_port is not None
        while True:
            try:
                status, _ = await self._probe(shard, "/health", with_key=False)
            except ProbeFailed:
                status = 0
            if status:
                if status == 200:
                    try:
                        models, _ = await self._probe(shard, "/v1/models")
                    except ProbeFailed:
                        models = 0
                    if models == 200:
                        return
                self._advance(shard, ShardState.LOADING)
            await trio.sleep(self._health_interval)

    async def _probe(self, shard: _Shard, path: str, *, with_key: bool = True) -> tuple[int, bytes]:
        """GET ``path`` from the shard's engine on this node (raises ProbeFailed)."""
        assert shard.health_port is not None
        headers = self._auth(shard) if with_key else None
        host = listen_address(shard.spec)  # where the engine listens: it listens nowhere else
        return await http_get(host, shard.health_port, path, headers=headers, timeout=PROBE_TIMEOUT)

    async def _learn_compute(self, shard: _Shard) -> None:
        """What the shard computes on: GPUs its processes hold memory on, else the CPU."""
        bound = COMPUTE_WAIT if shard.spec.gpus else 0.0
        deadline = trio.current_time() + bound
        while True:
            cards = await self._cards(shard)
            if cards or trio.current_time() >= deadline:
                break
            await trio.sleep(self._health_interval)
        shard.compute = Compute(gpus=cards)
        # By now a program that retitles itself has done so; keep what it shows for adoption.
        shard.processes = [_seen_now(process) for process in shard.processes]
        if await self._save(shard):
            self._report(shard)

    async def _cards(self, shard: _Shard) -> tuple[GpuUse, ...]:
        table = await trio.to_thread.run_sync(process_table)
        pids = members([p.pgid for p in shard.processes if group_is_ours(p)], table)
        by_pid = await trio.to_thread.run_sync(gpu_memory_by_pid, self._nvml)
        used: dict[int, GpuUse] = {}
        for pid in pids:
            for card in by_pid.get(pid, ()):
                before = used[card.index].used_mib if card.index in used else 0
                used[card.index] = attrs.evolve(card, used_mib=before + card.used_mib)
        return tuple(used[index] for index in sorted(used))

    async def _until_idle(self, shard: _Shard) -> None:
        assert shard.health_port is not None
        while shard.ended is None:
            try:
                status, body = await self._probe(shard, "/metrics")
            except ProbeFailed:
                busy = None
            else:
                busy = busy_requests(body.decode(errors="replace")) if status == 200 else None
            if busy == 0:
                return
            await trio.sleep(self._health_interval)

    @staticmethod
    def _auth(shard: _Shard) -> dict[str, str]:
        return {"Authorization": f"Bearer {shard.engine_key}"} if shard.engine_key else {}

    # --- the end of a shard ------------------------------------------------------------------------

    def _end(self, shard: _Shard, state: ShardState, reason: str) -> None:
        """Records why the shard ends (the first reason wins) and cancels its scope."""
        if shard.ended is None:
            shard.ended = (state, reason)
            shard.scope.cancel()
            tracing.end(shard.span, error=reason if state == ShardState.FAILED else None)
            shard.span = tracing.NO_SPAN

    async def _teardown(self, shard: _Shard) -> None:
        assert shard.ended is not None
        state, reason = shard.ended
        await self._stop_processes(shard, shard.grace)
        for follower in shard.followers:
            follower.read_available(final=True)
        for pidfd in shard.pidfds.values():
            os.close(pidfd)
        # Removed before the shard is forgotten: a start of the same shard id makes its
        # directory afresh, which this must not delete.
        await trio.to_thread.run_sync(shard_state.remove, shard.directory)
        del self._shards[shard.spec.shard_id]
        log.info("shard %s %s%s", shard.spec.shard_id, state.lower(), f": {reason}" if reason else "")
        failed = state == ShardState.FAILED
        SHARD_LIFECYCLE.move_in_place(shard, state)
        self._report(shard, reason=reason, log_tail=tuple(shard.tail) if failed else ())
        shard.done.set()

    async def _stop_processes(self, shard: _Shard, grace: float) -> None:
        """SIGTERM group by group, engine first, within one grace; then SIGKILL what is left; the
        children reaped.

        Engine first: vLLM under Ray shuts its workers down through the Ray cluster its sidecar
        runs. Sidecars go too: a Ray head left behind holds the port the next replica needs.
        """
        left = await stop_groups(list(reversed(shard.processes)), grace, children=shard.children)
        if left:
            log.error(
                "shard %s: processes %s outlived SIGKILL by %gs", shard.spec.shard_id, sorted(left), KILL_WAIT
            )

    async def _sweep_weights(self) -> None:
        """Removes fetched weights no shard has used for the cache's max_idle, now and then."""
        while True:
            in_use = {key for shard in self._shards.values() if (key := self.weights.key(shard.spec))}
            try:
                await self.weights.sweep(in_use)
            except OSError as exc:
                log.warning("cannot sweep the weights cache %s: %s", self.weights.cache_dir, exc)
            await trio.sleep(min(WEIGHTS_SWEEP_INTERVAL, self.weights.max_idle / 2))

    # --- bookkeeping -------------------------------------------------------------------------------

    def _spawner(self) -> trio.Nursery:
        if self._nursery is None:
            raise RuntimeError("Supervisor.run() is not running")
        return self._nursery

    def _our_pgids(self) -> list[int]:
        return [p.pgid for shard in self._shards.values() for p in shard.processes if group_is_ours(p)]

    async def _save(self, shard: _Shard) -> bool:
        try:
            await trio.to_thread.run_sync(shard_state.write, shard.directory, shard.record())
        except OSError as exc:
            # A shard without its state could not be adopted after a restart, and its engine
            # would then be killed as a stranger holding GPUs: better to fail it now, visibly.
            self._end(shard, ShardState.FAILED, f"cannot write its state file: {exc}")
            return False
        return True

    def _advance(self, shard: _Shard, state: ShardState) -> None:
        """Moves a running shard on, if the table goes that way from where it is: a readiness
        probe that lags behind a drain (Ready after Draining) or a repeat is dropped."""
        if shard.ended is None and state != shard.state and SHARD_LIFECYCLE.allows(shard.state, state):
            SHARD_LIFECYCLE.move_in_place(shard, state)
            self._report(shard)

    def _report(self, shard: _Shard, *, reason: str = "", log_tail: tuple[str, ...] = ()) -> None:
        self._emit(
            shard.spec,
            shard.state,
            reason=reason,
            pid=shard.engine_pid,
            compute=shard.compute,
            log_tail=log_tail,
        )

    def _emit(self, spec: ShardSpec, state: ShardState, **details: Any) -> None:
        self._on_status(
            ShardStatus(shard_id=spec.shard_id, replica_id=spec.replica_id, state=state, **details)
        )


def _seen_now(process: ProcessRecord) -> ProcessRecord:
    """The record with the command line the process shows now, if it is still that process."""
    stat = read_stat(process.pid)
    cmdline = read_cmdline(process.pid)
    if stat is None or stat.start_time != process.start_time or not cmdline:
        return process
    return attrs.evolve(process, cmdline=cmdline)
