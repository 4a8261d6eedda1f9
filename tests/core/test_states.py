"""Lifecycles as tables (core/states.py), and the replica's table in particular."""

from __future__ import annotations

import enum

import attrs
import pytest

from llmgw.core.replica import LIFECYCLE, Replica, ReplicaState
from llmgw.core.reports import SHARD_LIFECYCLE, ShardState
from llmgw.core.states import IllegalTransition, Lifecycle


class Door(enum.StrEnum):
    OPEN = "Open"
    SHUT = "Shut"
    LOCKED = "Locked"


DOOR = Lifecycle.of(
    "door", Door, {Door.OPEN: {Door.SHUT}, Door.SHUT: {Door.OPEN, Door.LOCKED}, Door.LOCKED: ()}
)


@attrs.frozen
class Thing:
    state: Door
    note: str = ""


def test_a_legal_move_evolves_the_record_with_its_changes():
    assert DOOR.move(Thing(state=Door.OPEN), Door.SHUT, note="closed") == Thing(
        state=Door.SHUT, note="closed"
    )


def test_staying_put_is_always_legal_even_in_a_terminal_state():
    assert DOOR.move(Thing(state=Door.LOCKED), Door.LOCKED).state == Door.LOCKED


def test_an_illegal_move_raises_naming_the_lifecycle_and_both_states():
    with pytest.raises(IllegalTransition, match="door: Open → Locked is not a legal move"):
        DOOR.move(Thing(state=Door.OPEN), Door.LOCKED)


def test_plain_strings_from_the_wire_or_the_store_are_checked_like_members():
    assert DOOR.allows("Shut", "Locked")
    assert not DOOR.allows("Locked", "Open")
    assert not DOOR.allows("Ajar", "Open")


def test_a_table_missing_a_state_is_refused_when_it_is_built():
    with pytest.raises(ValueError, match="no row for Locked"):
        Lifecycle.of("door", Door, {Door.OPEN: {Door.SHUT}, Door.SHUT: {Door.OPEN}})


def test_terminal_states_are_those_nothing_follows():
    assert DOOR.terminal() == {Door.LOCKED}
    assert LIFECYCLE.terminal() == {ReplicaState.STOPPED}


def _replica(state: ReplicaState) -> Replica:
    return Replica(id="r-1", profile="p", model="m", state=state, since=0.0, created=0.0)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (ReplicaState.STOPPED, ReplicaState.READY),  # a stopped replica never serves again
        (ReplicaState.DRAINING, ReplicaState.READY),  # nor does one taken out of rotation
        (ReplicaState.PENDING, ReplicaState.READY),  # Ready only by way of Starting
        (ReplicaState.PENDING, ReplicaState.FAILED),  # nothing ran that could fail
        (ReplicaState.READY, ReplicaState.PENDING),  # a running one fails or ends first
    ],
)
def test_replica_moves_the_reconciler_must_never_make(old, new):
    with pytest.raises(IllegalTransition):
        LIFECYCLE.move(_replica(old), new)


def test_a_replica_state_is_its_string_on_the_wire():
    assert ReplicaState.READY == "Ready"
    assert f"{ReplicaState.READY}" == "Ready"


def test_a_table_naming_something_that_is_not_a_state_is_refused():
    with pytest.raises(ValueError, match="not a state: Ajar"):
        Lifecycle.of("door", Door, {Door.OPEN: {"Ajar"}, Door.SHUT: (), Door.LOCKED: ()})


@attrs.define
class Task:
    state: Door


def test_a_mutable_record_moves_in_place_through_the_same_check():
    task = Task(state=Door.OPEN)
    DOOR.move_in_place(task, Door.SHUT)
    assert task.state == Door.SHUT
    with pytest.raises(IllegalTransition, match="door: Locked → Open"):
        DOOR.move_in_place(Task(state=Door.LOCKED), Door.OPEN)


# --- the shard's table (the agent's supervisor moves through it) --------------------------------


def test_a_shard_goes_forward_and_ends_from_anywhere_before_its_end():
    path = [ShardState.STARTING, ShardState.LOADING, ShardState.READY, ShardState.DRAINING]
    for i, old in enumerate(path):
        for new in path[i:]:
            assert SHARD_LIFECYCLE.allows(old, new)
        for new in path[:i]:
            assert not SHARD_LIFECYCLE.allows(old, new), f"{old} → {new}"
        assert SHARD_LIFECYCLE.allows(old, ShardState.STOPPED)
        assert SHARD_LIFECYCLE.allows(old, ShardState.FAILED)
    assert SHARD_LIFECYCLE.terminal() == {ShardState.STOPPED, ShardState.FAILED}


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("Stopped", "Starting"),  # a stopped shard is gone; a start makes a new one
        ("Failed", "Ready"),
        ("Draining", "Ready"),  # out of rotation for good
        ("Ready", "Loading"),
    ],
)
def test_shard_moves_the_supervisor_must_never_make(old, new):
    with pytest.raises(IllegalTransition, match=f"shard: {old} → {new}"):
        SHARD_LIFECYCLE.check(old, new)
