"""Reconnect delays: capped exponential backoff with jitter.

Pure: the random draw is a parameter, so the schedule can be tested exactly. Jitter matters when a
server restarts under a fleet: without it every agent retries in lockstep and the listener takes
the whole fleet's handshakes in the same few milliseconds, again and again.
"""

from __future__ import annotations


def reconnect_delay(attempt: int, *, initial: float, maximum: float, draw: float) -> float:
    """Seconds to wait before connection attempt number ``attempt`` + 1.

    ``attempt`` counts failures since the last success (0 for the first retry); ``draw`` is a
    uniform random number in [0, 1). "Equal jitter": half of the capped exponential step is
    fixed, so the delay still grows, and half is random, so peers spread out.
    """
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    # 2**attempt overflows a float long before it matters; cap the exponent instead.
    step = min(maximum, initial * 2.0 ** min(attempt, 62))
    return step / 2 + draw * step / 2
