"""Link messages: codec round trips, framing, and the HTTP/2 stream under flow control."""

from __future__ import annotations

import json
import logging

import attrs
import cattrs
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.shard import ShardSpec
from llmgw.core.training import JobState
from llmgw.wire import h2link
from llmgw.wire.codec import FramingError, LineDecoder, decode, encode
from llmgw.wire.h2link import STREAM_WINDOW, H2Link, LinkClosed
from llmgw.wire.messages import (
    ForeignProcess,
    Goodbye,
    Gpu,
    Heartbeat,
    IbPort,
    Inventory,
    JobStatus,
    Ping,
    Pong,
    Register,
    RunningJob,
    RunningShard,
    ShardState,
    ShardStatus,
    StopShard,
)

text = st.text(max_size=40)
gpus = st.builds(
    Gpu,
    index=st.integers(0, 15),
    uuid=text,
    name=text,
    gpu_class=text,
    memory_total_mib=st.integers(0, 200_000),
    memory_used_mib=st.integers(0, 200_000),
    compute_capability=st.sampled_from(["7.5", "8.0", "8.9", "9.0"]),
    ecc_uncorrected=st.integers(-1, 100),
    foreign_processes=st.lists(
        st.builds(ForeignProcess, pid=st.integers(1, 2**22), name=text), max_size=3
    ).map(tuple),
    problems=st.lists(st.sampled_from(["ecc-uncorrected", "foreign-memory"]), max_size=2).map(tuple),
)
ports = st.builds(
    IbPort,
    device=text,
    port=st.integers(1, 2),
    state=st.sampled_from(["ACTIVE", "DOWN"]),
    rate_gbps=st.floats(0, 800, allow_nan=False),
    link_layer=st.sampled_from(["InfiniBand", "Ethernet"]),
    roce_v2_gid_index=st.none() | st.integers(0, 8),
    subnet=text,
)
inventories = st.builds(
    Inventory,
    hostname=text,
    cpu_count=st.integers(1, 512),
    memory_total_mib=st.integers(0, 10**7),
    memory_available_mib=st.integers(0, 10**7),
    gpus=st.lists(gpus, max_size=8).map(tuple),
    ib_ports=st.lists(ports, max_size=4).map(tuple),
    fabric=text,
)
messages = st.one_of(
    st.builds(Register, node=text, agent_version=text, inventory=inventories),
    st.builds(Heartbeat, seq=st.integers(0, 2**40), inventory=st.none() | inventories),
    st.builds(Ping, id=st.integers(0, 2**31), trace=st.dictionaries(text, text, max_size=3), payload=text),
    st.builds(Pong, reply_to=st.integers(0, 2**31), payload=text, node=text),
    st.builds(Goodbye, reason=text),
)


@given(messages)
def test_every_message_round_trips_as_one_line(message):
    line = encode(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode(line) == message


@given(st.lists(messages, max_size=5), st.integers(1, 64))
def test_decoder_reassembles_messages_split_anywhere(batch, chunk):
    wire = b"".join(encode(m) for m in batch)
    decoder = LineDecoder()
    out = []
    sizes = 0
    for i in range(0, len(wire), chunk):
        for message, size in decoder.feed_sized(wire[i : i + chunk]):
            out.append(message)
            sizes += size
    assert out == batch
    assert sizes == len(wire)  # every byte is accounted for, so flow-control credit adds up


@pytest.mark.parametrize(
    "junk",
    [
        b"{}\n",
        b'{"type":""}\n',
        b"[]\n",
        b"not json\n",
        b'{"type":"Ping","id":"x"}\n',
        b"[" * 100_000 + b"]" * 100_000 + b"\n",  # json raises RecursionError for it
        b'{"type":"Ping","id":0,"payload":' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
    ],
    ids=["empty", "no-type", "list", "not-json", "bad-field", "nested", "nested-field"],
)
def test_undecodable_lines_are_framing_errors(junk):
    with pytest.raises(FramingError):
        LineDecoder().feed(junk)


@attrs.frozen(kw_only=True)
class FutureCommand:
    """A message type of a version after this one."""

    id: int
    setting: str


@attrs.frozen(kw_only=True)
class NewerPing:
    """Ping as a later version might send it: a field this version lacks."""

    id: int
    payload: str = ""
    trace: dict = attrs.Factory(dict)
    priority: int = 0


def newer_encode(message) -> bytes:
    """The encoder of a newer version, whose message set adds FutureCommand."""
    converter = cattrs.Converter()
    data = converter.unstructure(message)
    name = {"NewerPing": "Ping"}.get(type(message).__name__, type(message).__name__)
    return json.dumps({**data, "type": name}).encode() + b"\n"


def test_a_newer_peers_unknown_type_is_skipped_once_logged_and_its_extra_fields_ignored(caplog):
    decoder = LineDecoder()
    wire = (
        encode(Heartbeat(seq=1))
        + newer_encode(FutureCommand(id=7, setting="on"))
        + newer_encode(NewerPing(id=3, payload="p", priority=9))
        + newer_encode(FutureCommand(id=8, setting="off"))
    )
    with caplog.at_level(logging.WARNING, logger="llmgw.wire.codec"):
        sized = decoder.feed_sized(wire)
    assert [message for message, _ in sized] == [Heartbeat(seq=1), None, Ping(id=3, payload="p"), None]
    assert sum(size for _, size in sized) == len(wire)  # a skipped message's credit is returned too
    assert [r.getMessage() for r in caplog.records] == [
        "skipping link messages of type 'FutureCommand', which this version does not know (the peer is "
        "newer); said once per connection"
    ]


def test_an_older_agents_register_and_stop_decode_with_the_defaults():
    """Fields added later (Register's stop_grace, StopShard's grace left to the agent) have
    defaults, so a peer one version behind still joins and is understood."""
    register = json.loads(
        encode(
            Register(
                node="n",
                agent_version="0",
                inventory=Inventory(hostname="n", cpu_count=1, memory_total_mib=1, memory_available_mib=1),
            )
        )
    )
    del register["stop_grace"]
    assert decode(json.dumps(register).encode()).stop_grace == 30.0
    stop = json.loads(encode(StopShard(id=1, shard_id="s")))
    assert stop["grace"] is None  # the agent's own engines.stop_grace decides
    stop["grace"] = 5.0
    assert decode(json.dumps(stop).encode()) == StopShard(id=1, shard_id="s", grace=5.0)


def test_states_travel_as_their_plain_strings_and_a_newer_peers_state_still_decodes():
    spec = ShardSpec(shard_id="s", replica_id="r", model="m", model_path="/m", engine="llamacpp", port=1)
    shard = ShardStatus(shard_id="s", replica_id="r", state=ShardState.READY)
    job = JobStatus(job_id="j", state=JobState.TRAINING, step=3)
    register = Register(
        node="n",
        agent_version="0",
        inventory=Inventory(hostname="n", cpu_count=1, memory_total_mib=1, memory_available_mib=1),
        shards=(RunningShard(spec=spec, state=ShardState.LOADING),),
        jobs=(RunningJob(job_id="j", state=JobState.CONVERTING),),
    )
    for message in (shard, job, register):
        assert decode(encode(message)) == message
    assert json.loads(encode(shard))["state"] == "Ready" and json.loads(encode(job))["state"] == "Training"
    # A state this side lacks (a newer agent's) is read, not a framing error: the link stays up and
    # the server's rules ignore a report they do not know.
    newer = {**json.loads(encode(job)), "state": "Evaluating"}
    assert decode(json.dumps(newer).encode()).state == "Evaluating"


async def test_a_link_carries_on_past_a_message_it_does_not_know(monkeypatch):
    """A rolling upgrade: the newer side sends a command this side lacks, then an old one; the
    link stays up and the old one arrives."""
    async with trio.open_nursery() as nursery:
        client, server = await linked_pair(nursery)
        monkeypatch.setattr(h2link, "encode", newer_encode)
        await client.send(FutureCommand(id=1, setting="x"))
        await client.send(Ping(id=2))
        with trio.fail_after(10):
            assert await server.receive() == Ping(id=2)
        await server.send(Pong(reply_to=2))
        with trio.fail_after(10):
            assert await client.receive() == Pong(reply_to=2)
        nursery.cancel_scope.cancel()


def test_a_line_past_the_limit_is_refused_before_it_ends():
    decoder = LineDecoder(max_message_bytes=100)
    with pytest.raises(FramingError, match="longer than 100"):
        decoder.feed(b"x" * 101)


async def linked_pair(nursery):
    """A server-side and a client-side H2Link over an in-memory stream pair, stream open."""
    client_end, server_end = trio.testing.memory_stream_pair()
    client = H2Link(client_end, client_side=True)
    server = H2Link(server_end, client_side=False)
    await nursery.start(client.run)
    await nursery.start(server.run)

    async def accept():
        await server.accept_stream()
        await server.respond(200)

    nursery.start_soon(accept)
    await client.open_stream({}, authority="test")
    return client, server


async def test_messages_larger_than_the_window_arrive_whole_and_in_order():
    big = Goodbye(reason="x" * (3 * STREAM_WINDOW))  # needs several WINDOW_UPDATE round trips
    async with trio.open_nursery() as nursery:
        client, server = await linked_pair(nursery)

        async def send_all():
            await client.send(Heartbeat(seq=1))
            await client.send(big)
            await client.send(Heartbeat(seq=2))

        nursery.start_soon(send_all)
        with trio.fail_after(30):
            assert await server.receive() == Heartbeat(seq=1)
            assert await server.receive() == big
            assert await server.receive() == Heartbeat(seq=2)
        nursery.cancel_scope.cancel()


async def test_a_consumer_that_does_not_read_stalls_the_sender_not_the_reader():
    """Credit is returned only as messages are taken: a stuck consumer bounds what is buffered,
    while the connection itself keeps working (the reader still processes frames)."""
    async with trio.open_nursery() as nursery:
        client, server = await linked_pair(nursery)
        sent = 0

        async def flood():
            nonlocal sent
            while True:
                await client.send(Goodbye(reason="y" * 10_000))
                sent += 1

        nursery.start_soon(flood)
        # Wait until the sender is blocked by flow control.
        with trio.fail_after(30):
            while True:
                before = sent
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                if sent == before:
                    break
        assert sent * 10_000 <= 2 * STREAM_WINDOW  # bounded by the window, not by memory
        # The other direction is unaffected: the server can still talk to the client.
        await server.send(Pong(reply_to=1))
        with trio.fail_after(10):
            assert await client.receive() == Pong(reply_to=1)
        # Consuming frees the sender again.
        with trio.fail_after(30):
            for _ in range(sent + 5):
                await server.receive()
        nursery.cancel_scope.cancel()


async def test_receive_after_the_peer_closes_raises_link_closed():
    async with trio.open_nursery() as nursery:
        client, server = await linked_pair(nursery)
        await client.send(Heartbeat(seq=7))
        await client.aclose("bye")
        with trio.fail_after(10):
            assert await server.receive() == Heartbeat(seq=7)  # what was sent before still arrives
            with pytest.raises(LinkClosed):
                await server.receive()
        nursery.cancel_scope.cancel()
