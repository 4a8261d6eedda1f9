"""Gateway load across servers sharing a store (core/shared_load.py)."""

from llmgw.core.scaling import EngineLoad, LoadSignals
from llmgw.core.shared_load import GatewayLoad, combine, decode, encode


def test_waiting_requests_add_up_and_a_model_is_idle_only_as_long_as_everywhere():
    own = LoadSignals(
        queue_depth=1, replicas=(EngineLoad(running=1, waiting=0, saturation=0.5),), idle_for=0.0
    )
    others = [{"m": GatewayLoad(queued=3, idle_for=0.0)}, {"other": GatewayLoad(queued=9, idle_for=0.0)}]
    assert combine(own, "m", others) == LoadSignals(queue_depth=4, replicas=own.replicas, idle_for=0.0)
    idle_here = LoadSignals(idle_for=500.0)
    assert combine(idle_here, "m", [{"m": GatewayLoad(idle_for=20.0)}]).idle_for == 20.0
    assert combine(idle_here, "m", [{}]).idle_for == 500.0


def test_reports_round_trip_and_garbage_counts_as_nothing():
    loads = {"m": GatewayLoad(queued=2, idle_for=1.5)}
    assert decode(encode(loads)) == loads
    assert decode("nonsense") == {}
    assert decode({"m": {"queued": -1}, "n": {"queued": "x"}, "o": {"queued": 1, "idle_for": 2}}) == {
        "o": GatewayLoad(queued=1, idle_for=2.0)
    }
