"""When a failed replica starts again: after a backoff, on other nodes, or not at all.

A replica fails when a shard exits or refuses to start, or when it is not Ready within its
profile's startup timeout. Restarting at once would turn a model that cannot load into a loop that
reloads weights as fast as the disks allow, so each consecutive failure doubles the wait, up to a
cap. Some failures belong to the node (a bad card, a full disk, a driver in a bad state): every
``move_after`` consecutive failures the replica is placed again away from the nodes it failed on.
After ``give_up_after`` it stays Failed: the cause is the model or the profile, and only an
operator can change those.

No jitter here, unlike :mod:`llmgw.core.backoff`: restarts are issued by one reconciler, pass by
pass, so there is no crowd of clients to spread out.

Pure: the caller compares the returned time with its clock.
"""

from __future__ import annotations

import attrs

frozen = attrs.frozen(kw_only=True)

_positive = attrs.validators.gt(0)
_at_least_one = attrs.validators.ge(1)


@frozen
class RestartPolicy:
    initial: float = attrs.field(default=5.0, validator=_positive)  # seconds before the first restart
    maximum: float = attrs.field(default=300.0, validator=_positive)  # the longest wait
    # Consecutive failures on one placement before the replica moves away from its failed nodes.
    move_after: int = attrs.field(default=3, validator=_at_least_one)
    give_up_after: int = attrs.field(default=10, validator=_at_least_one)
    # A replica Ready this long has proved its placement: its earlier failures are forgotten.
    # Counting only "consecutive" failures would otherwise let an engine that crashes a minute
    # after every start restart forever at the shortest delay.
    reset_after: float = attrs.field(default=600.0, validator=_positive)


@frozen
class RestartAfter:
    """Start it again on the same nodes, GPUs and ports once ``at`` has come."""

    at: float
    delay: float


@frozen
class MoveElsewhere:
    """Place it again, away from the nodes it failed on, once ``at`` has come."""

    at: float
    delay: float


@frozen
class GiveUp:
    reason: str


Decision = RestartAfter | MoveElsewhere | GiveUp


def restart_delay(failures: int, policy: RestartPolicy) -> float:
    """Seconds from the last of ``failures`` (≥ 1) consecutive failures to the next start."""
    if failures < 1:
        raise ValueError("a restart follows at least one failure")
    # 2**n overflows a float long before it matters; cap the exponent instead.
    return min(policy.maximum, policy.initial * 2.0 ** min(failures - 1, 62))


def decide(failures: int, last_failure: float, policy: RestartPolicy) -> Decision:
    """What follows ``failures`` consecutive failures, the last at ``last_failure``."""
    if failures >= policy.give_up_after:
        return GiveUp(
            reason=f"gave up after {failures} failed starts in a row; an operator must act "
            "(fix the profile or the model, then remove the replica)"
        )
    delay = restart_delay(failures, policy)
    if failures % policy.move_after == 0:
        return MoveElsewhere(at=last_failure + delay, delay=delay)
    return RestartAfter(at=last_failure + delay, delay=delay)
