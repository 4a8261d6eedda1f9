"""A stand-in for the ranks of a multi-node engine: `vllm serve` with its own multiprocessing
(rank 0 and headless workers) or with Ray (`ray start --head` / `ray start --address`, then
`vllm serve` on the head), and SGLang's `sglang.launch_server` ranks (run by llmgw's launch program, `python -c ...`).

Standard library only: it runs under any Python, as the unprivileged engine user. It checks what
llmgw promised each rank and exits with status 2, naming the argument or variable, when
something is wrong:

- its rank and --nnodes (ranks distinct, 0 <= rank < nnodes, the same nnodes everywhere);
- the master address and port (rank 0 binds them, so the address must be its own; a worker
  connects there), the Ray head's address;
- VLLM_HOST_IP (vLLM) equal to this node's own address, never the leader's;
- NCCL_SOCKET_IFNAME ("=" + name) and GLOO_SOCKET_IFNAME equal to the interface holding this
  node's own address (names differ between nodes);
- NCCL_IB_HCA / NCCL_IB_GID_INDEX equal to FAKE_ENGINE_EXPECT_IB_HCA / ..._GID_INDEX when those are
  set (a fabric was given), NCCL_IB_DISABLE=1 when FAKE_ENGINE_EXPECT_IB_HCA is "none";
- the GPUs it sees (CUDA_VISIBLE_DEVICES) times the nodes equal to tensor x pipeline parallel.

Rank 0 listens on the rendezvous port and serves HTTP (the fake engine's surface, see
fake_engine.py) only once every worker has joined; a worker that never reaches its master within
FAKE_ENGINE_JOIN_TIMEOUT seconds fails, and once joined it exits when the master goes away.
Rank 0 exits when a joined worker goes away (as NCCL does when a peer dies). Each process writes
one line "fake-rank {json}" to stdout with its pid and role, for the tests to find it by.

The rendezvous protocol is one JSON line from the joiner ({"role", "rank", "nnodes", "gpus",
"address"}) and one JSON line back ({"ok": true} or {"error": ...}); a connection that says
nothing (the agent's check that the port listens) is ignored.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from http.server import ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_engine  # noqa: E402  (beside this file; standard library only as well)

BAD = 2  # exit status for a broken promise
LOST = 1  # exit status when a peer went away
SIOCGIFADDR = 0x8915


def fail(what: str) -> None:
    print(f"fake-rank FAILED: {what}", flush=True)
    os._exit(BAD)


def say(line: str) -> None:
    print(line, flush=True)


def announce(**fields: object) -> None:
    say("fake-rank " + json.dumps({"pid": os.getpid(), **fields}, sort_keys=True))


# --- what the node looks like -----------------------------------------------------------------


def interface_of(address: str) -> str:
    """The interface holding IPv4 ``address`` in this network namespace ("" if none)."""
    try:
        packed = socket.inet_aton(address)
    except OSError:
        return ""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("40s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
            except OSError:
                continue
            if reply[20:24] == packed:
                return name
    return ""


def visible_gpus() -> int:
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in devices.split(",") if d.strip()])


def check_network(own_address: str, *, vllm: bool) -> None:
    """The collectives' settings against this node's own address and interface."""
    env = os.environ
    interface = interface_of(own_address)
    if not interface:
        fail(f"no interface of this node holds {own_address} (the address this rank was told is its own)")
    if vllm and env.get("VLLM_HOST_IP") != own_address:
        fail(f"VLLM_HOST_IP is {env.get('VLLM_HOST_IP')!r}, this node's address is {own_address}")
    if env.get("NCCL_SOCKET_IFNAME") != "=" + interface:
        fail(f"NCCL_SOCKET_IFNAME is {env.get('NCCL_SOCKET_IFNAME')!r}, expected '={interface}'")
    if env.get("GLOO_SOCKET_IFNAME") != interface:
        fail(f"GLOO_SOCKET_IFNAME is {env.get('GLOO_SOCKET_IFNAME')!r}, expected {interface!r}")
    hca = env.get("FAKE_ENGINE_EXPECT_IB_HCA")
    if hca == "none":
        if env.get("NCCL_IB_DISABLE") != "1" or "NCCL_IB_HCA" in env:
            fail(f"no fabric was given, yet NCCL_IB_DISABLE={env.get('NCCL_IB_DISABLE')!r} "
                 f"NCCL_IB_HCA={env.get('NCCL_IB_HCA')!r}")  # fmt: skip
    elif hca is not None and env.get("NCCL_IB_HCA") != hca:
        fail(f"NCCL_IB_HCA is {env.get('NCCL_IB_HCA')!r}, expected {hca!r}")
    gid = env.get("FAKE_ENGINE_EXPECT_IB_GID_INDEX")
    if gid is not None and env.get("NCCL_IB_GID_INDEX") != gid:
        fail(f"NCCL_IB_GID_INDEX is {env.get('NCCL_IB_GID_INDEX')!r}, expected {gid!r}")


def check_world(tensor: int, pipeline: int, nnodes: int) -> None:
    gpus = visible_gpus()
    if gpus * nnodes != tensor * pipeline:
        fail(
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} gives {gpus} GPUs on each of "
            f"--nnodes {nnodes}, but tensor x pipeline parallel is {tensor}x{pipeline}"
        )


# --- the rendezvous ---------------------------------------------------------------------------


class Rendezvous:
    """Rank 0's side: joins are checked, counted, and watched until they go away."""

    def __init__(self, address: str, port: int, *, nnodes: int, on_lost) -> None:
        try:
            self.listener = socket.create_server((address, port))
        except OSError as exc:
            fail(f"cannot listen on the master address {address}:{port} ({exc}): is it this node's?")
        self.nnodes = nnodes
        self.on_lost = on_lost
        self.joined: dict[int, dict] = {}
        self.changed = threading.Condition()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            connection, _ = self.listener.accept()
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        reader = connection.makefile("rb")
        line = reader.readline()
        if not line:
            connection.close()  # a probe of the port
            return
        hello = json.loads(line)
        error = self._admit(hello)
        connection.sendall((json.dumps({"error": error} if error else {"ok": True}) + "\n").encode())
        if error:
            connection.close()
            return
        say(f"rank {hello['rank']} joined from {hello['address']} ({hello['role']})")
        reader.read()  # until the joiner goes away
        with self.changed:
            del self.joined[hello["rank"]]
        self.on_lost(hello)

    def _admit(self, hello: dict) -> str:
        with self.changed:
            if hello.get("nnodes") != self.nnodes:
                return f"--nnodes {hello.get('nnodes')} at rank {hello.get('rank')}, {self.nnodes} at rank 0"
            rank = hello.get("rank")
            if not isinstance(rank, int) or not 0 < rank < self.nnodes or rank in self.joined:
                return f"rank {rank!r} cannot join ({sorted(self.joined)} have, of {self.nnodes})"
            self.joined[rank] = hello
            self.changed.notify_all()
        return ""

    def wait_for(self, condition) -> None:
        with self.changed:
            self.changed.wait_for(lambda: condition(self.joined))


def join(master: tuple[str, int], hello: dict, *, what: str) -> socket.socket:
    """A worker's side: connect (retrying while the master is not up yet), say who it is."""
    deadline = time.monotonic() + float(os.environ.get("FAKE_ENGINE_JOIN_TIMEOUT", "120"))
    while True:
        try:
            connection = socket.create_connection(master, timeout=5)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                fail(f"{what} {master[0]}:{master[1]} never answered ({exc})")
            time.sleep(0.2)
    hello = {**hello, "address": connection.getsockname()[0]}
    hello_address = hello["address"]
    connection.sendall((json.dumps(hello) + "\n").encode())
    answer = connection.makefile("rb").readline()
    if not answer:
        fail(f"{what} {master[0]}:{master[1]} hung up on the join")
    reply = json.loads(answer)
    if "error" in reply:
        fail(f"{what} refused the join: {reply['error']}")
    connection.settimeout(None)
    say(f"joined {master[0]}:{master[1]} from {hello_address}")
    return connection


def stay_until_gone(connection: socket.socket, what: str) -> None:
    while connection.recv(4096):
        pass
    say(f"{what} went away: exiting")
    os._exit(LOST)


def serve_http(host: str, port: int, model: str, key: str) -> None:
    server = ThreadingHTTPServer((host, port), fake_engine.Handler)
    server.daemon_threads = True
    server.engine = fake_engine.Engine(model=model, key=key, ready_at=time.monotonic())
    say(f"serving HTTP on {host}:{port}, model {model}")
    server.serve_forever()


def lost_peer(hello: dict) -> None:
    say(f"rank {hello['rank']} at {hello['address']} went away: exiting")
    os._exit(LOST)


# --- the engines ------------------------------------------------------------------------------


def common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default="fake-model")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--api-key")


def vllm_serve(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common_flags(parser)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--distributed-executor-backend")
    parser.add_argument("--master-addr")
    parser.add_argument("--master-port", type=int)
    parser.add_argument("--headless", action="store_true")
    args, _ = parser.parse_known_args(argv)
    key = os.environ.get("VLLM_API_KEY", "")
    if args.distributed_executor_backend == "ray":
        vllm_on_ray(args, key)
        return
    ranks(
        "vllm",
        rank=args.node_rank,
        nnodes=args.nnodes,
        master=(args.master_addr, args.master_port),
        tensor=args.tensor_parallel_size,
        pipeline=args.pipeline_parallel_size,
        headless=args.headless,
        http=(args.host, args.port, args.served_model_name, key),
    )


def sglang_launch_server(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common_flags(parser)
    parser.add_argument("--model-path")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--pp-size", type=int, default=1)
    parser.add_argument("--dist-init-addr")
    args, _ = parser.parse_known_args(argv)
    if args.node_rank != 0 and args.api_key:
        fail("--api-key given to a rank that serves no HTTP")
    master = (None, None)
    if args.dist_init_addr:
        host, _, port = args.dist_init_addr.rpartition(":")
        master = (host, int(port))
    ranks(
        "sglang",
        rank=args.node_rank,
        nnodes=args.nnodes,
        master=master,
        tensor=args.tp_size,
        pipeline=args.pp_size,
        headless=args.node_rank != 0,
        http=(args.host, args.port, args.served_model_name, args.api_key or ""),
    )


def ranks(engine, *, rank, nnodes, master, tensor, pipeline, headless, http) -> None:
    """vLLM mp and SGLang alike: rank 0 waits for every worker, then serves; workers join."""
    if nnodes < 1 or not 0 <= rank < nnodes:
        fail(f"--node-rank {rank} is not a rank of --nnodes {nnodes}")
    if headless != (rank != 0):
        fail(f"rank {rank} {'is' if headless else 'is not'} headless: only rank 0 serves HTTP")
    check_world(tensor, pipeline, nnodes)
    if nnodes == 1:
        announce(engine=engine, role="rank", rank=0, nnodes=1)
        serve_http(*http)
        return
    address, port = master
    if not address or not port:
        fail(f"--nnodes {nnodes} without a master address and port")
    vllm = engine == "vllm"
    announce(engine=engine, role="rank", rank=rank, nnodes=nnodes)
    if rank == 0:
        check_network(address, vllm=vllm)
        rendezvous = Rendezvous(address, port, nnodes=nnodes, on_lost=lost_peer)
        say(f"rank 0 waits for {nnodes - 1} workers on {address}:{port}")
        rendezvous.wait_for(lambda joined: len(joined) == nnodes - 1)
        serve_http(*http)
        return
    hello = {"role": "rank", "rank": rank, "nnodes": nnodes, "gpus": visible_gpus()}
    connection = join((address, port), hello, what="master")
    check_network(connection.getsockname()[0], vllm=vllm)
    stay_until_gone(connection, "master")


def vllm_on_ray(args: argparse.Namespace, key: str) -> None:
    """vLLM on a Ray cluster: serves once the cluster has the GPUs tensor x pipeline needs."""
    address = os.environ.get("RAY_ADDRESS", "")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        fail(f"RAY_ADDRESS is {address!r}: vLLM would start a Ray of its own")
    check_network(os.environ.get("VLLM_HOST_IP", ""), vllm=True)
    if os.environ.get("VLLM_HOST_IP") != host:
        fail(f"RAY_ADDRESS {address} is not this node's head (VLLM_HOST_IP {os.environ.get('VLLM_HOST_IP')})")
    announce(engine="vllm", role="ray-driver")
    wanted = args.tensor_parallel_size * args.pipeline_parallel_size
    connection = socket.create_connection((host, int(port)), timeout=5)
    connection.sendall((json.dumps({"role": "ray-driver", "wants": wanted}) + "\n").encode())
    answer = connection.makefile("rb").readline()
    if not answer or "error" in json.loads(answer):
        fail(f"the Ray head at {address} could not give {wanted} GPUs: {answer!r}")
    threading.Thread(target=stay_until_gone, args=(connection, "the Ray head"), daemon=True).start()
    serve_http(args.host, args.port, args.served_model_name, key)


def ray_start(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--head", action="store_true")
    parser.add_argument("--port", type=int)
    parser.add_argument("--address")
    parser.add_argument("--node-ip-address")
    parser.add_argument("--block", action="store_true")
    args, _ = parser.parse_known_args(argv)
    if not args.block:
        fail("ray start without --block returns at once: the supervisor would lose it")
    own = args.node_ip_address or ""
    check_network(own, vllm=True)
    if args.head:
        announce(engine="ray", role="ray-head")
        RayHead(own, args.port).run()
        return
    host, _, port = (args.address or "").rpartition(":")
    if not host or not port.isdigit():
        fail(f"ray start --address {args.address!r}")
    if host == own:
        fail(f"a Ray worker given its own address {own} as the head's")
    announce(engine="ray", role="ray-worker")
    hello = {"role": "ray-worker", "gpus": visible_gpus(), "node": own}
    connection = join((host, int(port)), hello, what="Ray head")
    if connection.getsockname()[0] != own:
        fail(f"--node-ip-address {own} is not the address this node reaches the head from")
    stay_until_gone(connection, "the Ray head")


class RayHead:
    """The Ray head's rendezvous: workers lend GPUs, the driver waits until enough are there."""

    def __init__(self, address: str, port: int) -> None:
        try:
            self.listener = socket.create_server((address, port))
        except OSError as exc:
            fail(f"ray start --head cannot listen on {address}:{port} ({exc})")
        self.gpus = {address: visible_gpus()}
        self.changed = threading.Condition()

    def run(self) -> None:
        say(f"ray head listening on {self.listener.getsockname()}")
        while True:
            connection, _ = self.listener.accept()
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        reader = connection.makefile("rb")
        line = reader.readline()
        if not line:
            connection.close()
            return
        hello = json.loads(line)
        if hello.get("role") == "ray-worker":
            with self.changed:
                self.gpus[hello["address"]] = hello.get("gpus", 0)
                self.changed.notify_all()
            connection.sendall(b'{"ok": true}\n')
            say(f"ray worker joined from {hello['address']} with {hello.get('gpus')} GPUs")
            reader.read()
            say(f"ray worker {hello['address']} went away: exiting")
            os._exit(LOST)
        wants = int(hello.get("wants", 0))
        with self.changed:
            self.changed.wait_for(lambda: sum(self.gpus.values()) >= wants)
        connection.sendall(b'{"ok": true}\n')
        reader.read()


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGTERM, lambda *_: (say("SIGTERM: exiting"), os._exit(0)))
    say(f"fake multirank pid {os.getpid()} uid {os.getuid()} args {' '.join(argv)}")
    if argv[:1] == ["serve"]:
        vllm_serve(argv[1:])
    elif argv[:1] == ["-c"] and "sglang.launch_server" in argv[1]:
        # llmgw's SGLang launch program: the key from its environment, last on the server's argv.
        key = os.environ.pop("LLMGW_ENGINE_KEY", "")
        sglang_launch_server([*argv[2:], *(["--api-key", key] if key else [])])
    elif argv[:1] == ["start"]:
        ray_start(argv[1:])
    else:
        fail(f"not a command this fake knows: {argv[:2]}")


if __name__ == "__main__":
    main(sys.argv[1:])
