"""The gateway's router over the replicas: who is ready, and how much room they have."""

from __future__ import annotations

import json

import attrs

from llmgw.core.catalog import Profile
from llmgw.core.replica import Replica, ReplicaShard, ReplicaState
from llmgw.core.scaling import EngineLoad
from llmgw.core.shard import Adapter
from llmgw.server.routing import DEFAULT_SLOTS, ReplicaRouter
from llmgw.wire.messages import Inventory


class Catalog:
    def __init__(self, *profiles: Profile) -> None:
        self._profiles = {p.name: p for p in profiles}

    def profiles(self) -> dict[str, Profile]:
        return self._profiles


class Replicas:
    def __init__(self, *records: Replica) -> None:
        self.records = records

    def list(self) -> list[Replica]:
        return list(self.records)

    def key_of(self, replica_id: str) -> str:
        return f"key-of-{replica_id}"


@attrs.define
class Node:
    inventory: Inventory


class Registry:
    def get(self, name: str) -> Node:
        return Node(
            Inventory(
                hostname=name,
                cpu_count=1,
                memory_total_mib=1,
                memory_available_mib=1,
                mgmt_address=f"10.0.0.{name[-1]}",
            )
        )


def profile(name: str, parallel: int | None) -> Profile:
    return Profile(name=name, model="m", engine="llamacpp", gpu_class=None, memory_mib=512, parallel=parallel)


def replica(rid: str, profile_name: str, state: str = ReplicaState.READY, node: str = "n1") -> Replica:
    shard = ReplicaShard(node=node, shard_id=f"{rid}-s0", rank=0, port=20000, state="Ready")
    return Replica(id=rid, profile=profile_name, model="m", state=state, shards=(shard,), since=0, created=0)


def router(load=None) -> ReplicaRouter:
    records = (
        replica("r1", "p8"),
        replica("r2", "pdefault", node="n2"),
        replica("r3", "p8", state=ReplicaState.STARTING),
    )
    return ReplicaRouter(
        Catalog(profile("p8", 8), profile("pdefault", None)), Replicas(*records), Registry(), load=load
    )


def test_routes_are_the_ready_replicas_with_their_slots_and_loads():
    loads = {"r1": EngineLoad(running=3, waiting=2, saturation=0.5)}
    routes = router(load=loads.get).routes("m")
    assert routes.policy == "prefix"  # the default
    assert [(r.replica, r.slots, r.load) for r in routes.replicas] == [
        ("r1", 8, loads["r1"]),
        ("r2", DEFAULT_SLOTS, None),
    ]
    assert router().routes("other") is None


def test_routes_are_kept_until_refreshed():
    loads: dict[str, EngineLoad] = {}
    r = router(load=loads.get)
    assert r.routes("m").replicas[0].load is None
    loads["r1"] = EngineLoad(running=1, waiting=0, saturation=0.1)
    assert r.routes("m").replicas[0].load is None  # as built
    r.refresh()
    assert r.routes("m").replicas[0].load == loads["r1"]


def test_a_models_policy_is_its_first_profiles():
    records = (replica("r1", "a-fast"), replica("r2", "b-slow"))
    catalog = Catalog(
        attrs.evolve(profile("a-fast", 2), routing="least-loaded"),
        attrs.evolve(profile("b-slow", 2), routing="round-robin"),
    )
    routes = ReplicaRouter(catalog, Replicas(*records), Registry()).routes("m")
    assert routes.policy == "least-loaded" and len(routes.replicas) == 2


def test_ready_upstreams_carry_each_replicas_own_key_and_address():
    upstreams = router().ready_upstreams("m")
    assert sorted((u.host, u.port, u.engine_key, u.replica) for u in upstreams) == [
        ("10.0.0.1", 20000, "key-of-r1", "r1"),
        ("10.0.0.2", 20000, "key-of-r2", "r2"),
    ]
    assert router().ready_upstreams("unknown") is None


def test_adapters_are_served_by_name_beside_their_base_on_the_replicas_of_profiles_listing_them():
    """Profile p-lora (llama.cpp) lists two adapters, p-plain none: the adapters are models of
    their own whose parent is m, and only p-lora's replica serves them, each through an upstream
    whose body members select it among the engine's adapters in their --lora order."""
    lora = attrs.evolve(
        profile("p-lora", 2),
        adapters=(Adapter(name="sql", path="/a/sql.gguf"), Adapter(name="chat", path="/a/chat.gguf")),
    )
    vllm = attrs.evolve(profile("p-vllm", 2), engine="vllm", adapters=(Adapter(name="tool", path="/a/tool"),))
    records = (replica("r1", "p-lora"), replica("r2", "p-plain", node="n2"), replica("r3", "p-vllm"))
    router = ReplicaRouter(Catalog(lora, profile("p-plain", 2), vllm), Replicas(*records), Registry())
    assert router.models() == ["chat", "m", "sql", "tool"]
    assert [router.parent(n) for n in ("chat", "m", "sql", "tool", "other")] == ["m", None, "m", "m", None]
    by_id = {route.replica: route for route in router.routes("m").replicas}
    assert set(by_id["r1"].adapters) == {"sql", "chat"} and not by_id["r2"].adapters
    chat = by_id["r1"].adapters["chat"]
    assert (chat.host, chat.port, chat.replica) == (by_id["r1"].upstream.host, 20000, "r1")
    assert json.loads(chat.body_members) == {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]}
    # The base model's requests deselect every adapter; a replica without any is sent as is.
    assert json.loads(by_id["r1"].upstream.body_members) == {
        "lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]
    }
    assert by_id["r2"].upstream.body_members == b""
    # vLLM serves its adapter under its name: the request goes as the client sent it.
    assert by_id["r3"].adapters["tool"] == by_id["r3"].upstream and by_id["r3"].upstream.body_members == b""
