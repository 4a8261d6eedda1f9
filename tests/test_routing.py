"""The gateway's router over the replicas: who is ready, and how much room they have."""

from __future__ import annotations

import attrs

from llmgw.core.catalog import Profile
from llmgw.core.replica import Replica, ReplicaShard, ReplicaState
from llmgw.core.scaling import EngineLoad
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


def test_room_is_each_ready_replicas_slots():
    assert router().capacity("m") == 8 + DEFAULT_SLOTS
    assert router().capacity("other") == 0


def test_an_engine_that_says_it_is_full_offers_no_more_than_it_runs():
    loads = {
        "r1": EngineLoad(running=3, waiting=2, saturation=0.5),  # requests queued inside it
        "r2": EngineLoad(running=1, waiting=0, saturation=0.99),  # KV cache full
    }
    assert router(load=loads.get).capacity("m") == 3 + 1
    idle = {"r1": EngineLoad(running=0, waiting=0, saturation=0.1)}
    assert router(load=idle.get).capacity("m") == 8 + DEFAULT_SLOTS  # not full: its slots stand


def test_ready_upstreams_carry_each_replicas_own_key_and_address():
    upstreams = router().ready_upstreams("m")
    assert sorted((u.host, u.port, u.engine_key) for u in upstreams) == [
        ("10.0.0.1", 20000, "key-of-r1"),
        ("10.0.0.2", 20000, "key-of-r2"),
    ]
    assert router().ready_upstreams("unknown") is None
