"""The status pages' server time with a large fleet: 200 nodes of 8 GPUs, 1,000 replicas.

Nodes are registered in process on a real NodeRegistry (fake links, simulated GPUs, each card
running shards), replicas written straight into a ReplicaManager's records; the admin app is the
real one (api.make_app), called through quart's test client, so every figure includes routing,
the session check, JSON building and serialisation, and nothing of a network.

Prints, for the overview page's HTML, /admin/v1/overview (all the open overview polls) and the
two biggest listings the other pages read, the median and worst of --rounds requests, and the
overview's total (its HTML plus one overview). Target: the overview under 200 ms.

    .venv/bin/python scripts/bench_ui.py [--nodes 200] [--replicas 1000] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmgw.core.catalog import Model, Profile  # noqa: E402
from llmgw.core.liveness import Liveness  # noqa: E402
from llmgw.core.replica import Replica, ReplicaShard, ReplicaState  # noqa: E402
from llmgw.core.shard import GpuRef, ShardSpec  # noqa: E402
from llmgw.server import tokens  # noqa: E402
from llmgw.server.api import make_app  # noqa: E402
from llmgw.server.catalog import Catalog  # noqa: E402
from llmgw.server.nodes import NodeRegistry, Shard  # noqa: E402
from llmgw.server.replicas import ReplicaManager  # noqa: E402
from llmgw.server.store import open_store  # noqa: E402
from llmgw.wire.messages import Gpu, Inventory, Register  # noqa: E402

TOKEN = "bench-admin-token"
GPUS_PER_NODE = 8
TARGET_MS = 200.0
STATES = [ReplicaState.READY] * 8 + [ReplicaState.PENDING, ReplicaState.LOADING]


class IdleLink:
    async def call(self, command):
        raise AssertionError("the bench sends no commands")

    def close(self, reason: str) -> None:
        pass


def inventory(name: str) -> Inventory:
    gpus = tuple(
        Gpu(
            index=i,
            uuid=f"GPU-{name}-{i}",
            name="NVIDIA H100 80GB HBM3",
            gpu_class="h100-80g",
            memory_total_mib=81_559,
            memory_used_mib=1_000,
            compute_capability="9.0",
        )
        for i in range(GPUS_PER_NODE)
    )
    return Inventory(
        hostname=name,
        cpu_count=128,
        memory_total_mib=1_000_000,
        memory_available_mib=900_000,
        gpus=gpus,
        fabric=f"ib-{int(name.split('-')[1]) // 32}",
        mgmt_address=f"10.0.{int(name.split('-')[1]) // 250}.{int(name.split('-')[1]) % 250 + 1}",
        simulated=True,
    )


async def build(nodes: int, replicas: int, data_dir: Path):
    store = await open_store(data_dir)
    registry = NodeRegistry(store, Liveness(interval=1.0, missed=3))
    names = [f"gpu-{i:03d}" for i in range(nodes)]
    for name in names:
        await registry.attach(
            IdleLink(), Register(node=name, agent_version="bench", inventory=inventory(name))
        )
    model = Model(name="llama-70b", path="/models/llama-70b", format="safetensors")
    profile = Profile(
        name="llama-70b-h100", model="llama-70b", engine="vllm", gpu_class="h100-80g", gpus_per_node=1,
        memory_mib=70_000, min_replicas=replicas, max_replicas=replicas,
    )  # fmt: skip
    catalog = await Catalog.load(store, [model], [profile])
    manager = ReplicaManager(registry, catalog, engine_secret=b"s" * 32)
    records = {}
    now = time.time()
    for i in range(replicas):
        replica_id = f"r-{i:06x}"
        state = STATES[i % len(STATES)]
        node = names[i % nodes]
        gpu = (i // nodes) % GPUS_PER_NODE
        shard_id = f"{replica_id}-0"
        shards = ()
        if state != ReplicaState.PENDING:
            shards = (
                ReplicaShard(
                    node=node, shard_id=shard_id, rank=0, gpu_indices=(gpu,), port=20000 + i, state=state
                ),
            )
            spec = ShardSpec(
                shard_id=shard_id, replica_id=replica_id, profile=profile.name, model=model.name,
                model_path=model.path, engine="vllm", port=20000 + i,
                gpus=(GpuRef(index=gpu, uuid=f"GPU-{node}-{gpu}", gpu_class="h100-80g", compute_capability="9.0"),),
            )  # fmt: skip
            registry.get(node).shards[shard_id] = Shard(
                shard_id=shard_id, replica_id=replica_id, state=str(state), since=now, spec=spec
            )
        records[replica_id] = Replica(
            id=replica_id, profile=profile.name, model=model.name, state=state, shards=shards,
            since=now - 60, created=now - 3600,
            reason="no node fits: 200 nodes have no free h100-80g" if state == ReplicaState.PENDING else "",
        )  # fmt: skip
    manager._records = records  # rows injected straight into the reconciler's shell
    # Every Pending replica carries every node's reason, as a real pass leaves it.
    manager._candidates = {
        rid: tuple((name, "all 8 h100-80g GPUs are taken") for name in names)
        for rid, record in records.items()
        if record.state == ReplicaState.PENDING
    }
    app = make_app(registry, catalog, tokens.digest(TOKEN), replicas=manager)
    return store, app


async def timed(client, path: str, rounds: int, headers: dict) -> tuple[list[float], int]:
    times = []
    size = 0
    for _ in range(rounds):
        started = time.perf_counter()
        response = await client.get(path, headers=headers)
        body = await response.get_data()
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, (path, response.status_code, body[:200])
        size = len(body)
    return times, size


async def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-ui-") as tmp:
        store, app = await build(args.nodes, args.replicas, Path(tmp))
        try:
            client = app.test_client()
            login = await client.post("/login", form={"token": TOKEN})
            assert login.status_code == 303
            cookie = login.headers["Set-Cookie"].split(";")[0]
            headers = {"Cookie": cookie}  # the browser's way in: the session, not the bearer token
            app.status_pages.take_sample()
            app.status_pages.take_sample()
            print(
                f"fleet: {args.nodes} nodes x {GPUS_PER_NODE} GPUs, {args.replicas} replicas; {args.rounds} rounds each"
            )
            medians = {}
            for path in ("/", "/admin/v1/overview", "/admin/v1/replicas", "/admin/v1/nodes"):
                await timed(client, path, 2, headers)  # warm up
                times, size = await timed(client, path, args.rounds, headers)
                medians[path] = statistics.median(times)
                print(
                    f"  GET {path:<22} median {medians[path]:7.1f} ms  max {max(times):7.1f} ms  "
                    f"({size / 1024:.0f} KiB)"
                )
            sample_times = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                app.status_pages.take_sample()
                sample_times.append((time.perf_counter() - started) * 1000)
            print(f"  one overview sample (every 5 s)   median {statistics.median(sample_times):7.1f} ms")
            # The open overview polls /admin/v1/overview alone; its HTML is loaded once.
            total = medians["/"] + medians["/admin/v1/overview"]
            verdict = "under" if total < TARGET_MS else "OVER"
            print(
                f"overview page (its HTML + one overview): {total:.1f} ms, {verdict} the {TARGET_MS:.0f} ms target"
            )
        finally:
            await store.aclose()
    return 0 if total < TARGET_MS else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=200, help="simulated nodes (default 200)")
    parser.add_argument("--replicas", type=int, default=1000, help="replica records (default 1000)")
    parser.add_argument("--rounds", type=int, default=20, help="requests timed per endpoint (default 20)")
    sys.exit(trio.run(main, parser.parse_args()))
