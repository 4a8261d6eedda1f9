"""How many replicas a profile wants, from its load: between its min and max replicas.

The signals are what the gateway sees: requests queued for the model at the gateway, and for each
Ready replica its engine's running and waiting requests and its saturation (0 idle … 1 full).
Load is *high* when requests wait on most replicas, or the replicas are nearly full on average, or
the gateway's queue holds more than a few requests per replica; *low* when nothing waits anywhere
and the replicas are mostly idle; otherwise it is fine as it is.

Two things keep the count from flapping. Load must stay high (low) for a while before it counts,
so a burst shorter than that changes nothing. And after any change the count holds for a cooldown
before the next one: a longer one before scaling down, because a replica added a moment ago is
still loading weights and the load it will take is not visible yet. The count moves one replica
at a time; each further step needs the load to have stayed high (low) again for the whole window.

Zero is different. A profile with ``min_replicas: 0`` keeps its last replica until the gateway
has seen no request of the model for ``scale_to_zero_after`` — not merely low load, since the
next request would wait for a whole engine start — and then stops it. From zero, a request
waiting at the gateway brings a replica up at once: no window, no cooldown, because every moment
of either is a client waiting with nothing to serve it.

Pure: the shell keeps the :class:`ScaleState` and the count, and calls this on each tick.
"""

from __future__ import annotations

import attrs

from llmgw.core.catalog import Profile

frozen = attrs.frozen(kw_only=True)

HIGH = "high"
LOW = "low"
FINE = "fine"


@frozen
class EngineLoad:
    """One Ready replica's engine, from its metrics."""

    running: int  # requests being generated
    waiting: int  # requests the engine queued: it has no room for them yet
    saturation: float  # 0 idle … 1 full (KV cache or slots, whichever is tighter)


@frozen
class LoadSignals:
    queue_depth: int = 0  # requests for the model waiting at the gateway for a replica
    replicas: tuple[EngineLoad, ...] = ()  # one per Ready replica
    # Seconds the gateway has had no request of the model in flight or waiting.
    idle_for: float = 0.0


@frozen
class ScalePolicy:
    up_after: float = 60.0  # seconds load must stay high before a replica is added
    down_after: float = 300.0  # seconds load must stay low before one is removed
    up_cooldown: float = 120.0  # after any change, before the next replica is added
    down_cooldown: float = 600.0  # after any change, before one is removed
    saturation_high: float = 0.8
    saturation_low: float = 0.3
    waiting_share: float = 0.5  # requests wait on at least this share of the replicas: high
    queue_per_replica: int = 8  # more requests queued at the gateway per replica: high


@frozen
class ScaleState:
    high_since: float | None = None  # load has been high since; None = it is not
    low_since: float | None = None
    last_change: float | None = None  # when the count last went up or down


@frozen
class ScaleDecision:
    count: int
    reason: str
    state: ScaleState  # keep it for the next call


def desired_replicas(
    profile: Profile,
    current: int,
    signals: LoadSignals,
    state: ScaleState,
    now: float,
    policy: ScalePolicy = ScalePolicy(),  # noqa: B008 (frozen: one shared default is safe)
) -> ScaleDecision:
    """The count ``profile`` should run, from ``current`` (the count wanted until now)."""
    low, high = profile.min_replicas, profile.max_replicas
    if current < low:
        return ScaleDecision(count=low, reason=f"up to the profile's min_replicas {low}", state=state)
    if current > high:
        return ScaleDecision(count=high, reason=f"down to the profile's max_replicas {high}", state=state)
    # No cooldown here: the idle time counts from the last request, which came after any change,
    # so a replica that a request brought up is not stopped before it has served it.
    if low == 0 and current == 1 and signals.idle_for >= profile.scale_to_zero_after:
        return ScaleDecision(
            count=0,
            reason=f"down to 0: no request for {signals.idle_for:.0f} s "
            f"(scale_to_zero_after {profile.scale_to_zero_after:g} s)",
            state=ScaleState(last_change=now),
        )
    level, why = load_level(signals, policy)
    state = ScaleState(
        high_since=(state.high_since if state.high_since is not None else now) if level == HIGH else None,
        low_since=(state.low_since if state.low_since is not None else now) if level == LOW else None,
        last_change=state.last_change,
    )
    if level == HIGH:
        if current >= high:
            return _hold(current, f"at max_replicas {high} though {why}", state)
        # With no replica at all the queued requests have nowhere to go: waiting for the load
        # to be sustained, or for a cooldown, would only keep them waiting.
        sustain = 0.0 if current == 0 else policy.up_after
        cooldown = 0.0 if current == 0 else policy.up_cooldown
        return _step(current, +1, why, state.high_since, sustain, cooldown, state, now)
    if level == LOW:
        if current <= low:
            if current == 0:
                return _hold(0, "no request waits (min_replicas 0)", state)
            return _hold(current, f"at min_replicas {low}", state)
        if current == 1:
            # The last replica goes only by scale_to_zero_after (above), not for low load.
            return _hold(
                current,
                f"{why}; the last replica stays until {profile.scale_to_zero_after:g} s without "
                f"a request (idle {signals.idle_for:.0f} s)",
                state,
            )
        return _step(current, -1, why, state.low_since, policy.down_after, policy.down_cooldown, state, now)
    return _hold(current, why, state)


def load_level(signals: LoadSignals, policy: ScalePolicy) -> tuple[str, str]:
    """HIGH, LOW or FINE, and why in words."""
    engines = signals.replicas
    queued = signals.queue_depth
    if not engines:
        if queued:
            return HIGH, f"{queued} requests queued and no replica is Ready"
        return LOW, "no requests and no replica is Ready"
    saturation = sum(engine.saturation for engine in engines) / len(engines)
    waiting_on = sum(1 for engine in engines if engine.waiting > 0)
    if queued > policy.queue_per_replica * len(engines):
        return HIGH, f"{queued} requests queued at the gateway for {len(engines)} replicas"
    if waiting_on >= policy.waiting_share * len(engines):
        return HIGH, f"requests wait in the engines of {waiting_on} of {len(engines)} replicas"
    if saturation > policy.saturation_high:
        return HIGH, f"average saturation {saturation:.2f} above {policy.saturation_high:.2f}"
    if not queued and not waiting_on and saturation < policy.saturation_low:
        return LOW, f"average saturation {saturation:.2f} below {policy.saturation_low:.2f}, nothing waits"
    return FINE, f"load fits {len(engines)} replicas (average saturation {saturation:.2f})"


def _step(
    current: int,
    direction: int,
    why: str,
    since: float | None,
    sustain: float,
    cooldown: float,
    state: ScaleState,
    now: float,
) -> ScaleDecision:
    assert since is not None
    word = "up" if direction > 0 else "down"
    lasted = now - since
    if lasted < sustain:
        return _hold(
            current, f"{why}, for {lasted:.0f} s of the {sustain:.0f} s before scaling {word}", state
        )
    if state.last_change is not None and now - state.last_change < cooldown:
        left = cooldown - (now - state.last_change)
        return _hold(
            current, f"{why}, but the count changed {left:.0f} s too recently to scale {word}", state
        )
    # The window starts again: each further step needs the load to last once more.
    moved = ScaleState(
        high_since=now if direction > 0 else None,
        low_since=now if direction < 0 else None,
        last_change=now,
    )
    return ScaleDecision(
        count=current + direction, reason=f"{word} to {current + direction}: {why}", state=moved
    )


def _hold(current: int, why: str, state: ScaleState) -> ScaleDecision:
    return ScaleDecision(count=current, reason=f"holding at {current}: {why}", state=state)
