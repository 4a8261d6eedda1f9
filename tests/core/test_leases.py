"""Leases (core/leases.py): quotas and replica slots split among gateway workers.

What the module's docstring claims, each proved here against the real worker and ledger code with
grants and reports delayed in flight, workers cut off or killed: across two workers, 64 clients
overshoot a token quota by no more than the one-process bound, requests per minute never exceed
their limit, a replica never has more requests in flight than its slots, tenants of a band share a
replica's slots equally across workers, and the quota book's memory stays bounded.
"""

from __future__ import annotations

import json
import math

import attrs
import cattrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.admission import AdmissionLane, Arrival, Go, Queued
from llmgw.core.leases import (
    LEASE_TTL,
    RENEW_INTERVAL,
    LeaseGrant,
    LeaseLedger,
    LeaseReport,
    Waiting,
    WorkerLeases,
    share_out,
)
from llmgw.core.quota import MINUTE, Limits, QuotaBook, Refused, Reservation
from llmgw.core.routing import ROUND_ROBIN

TENANT = ("tenant", "acme")
TPM = ("quota", "tenant", "acme", "tpm")
RPM = ("quota", "tenant", "acme", "rpm")


def exchange(ledger: LeaseLedger, worker: WorkerLeases, now: float) -> LeaseGrant:
    """One report and its grant, delivered at once."""
    ledger.receive(worker.report(now), now)
    grant = ledger.grant(worker.worker, now)
    worker.apply(grant, now)
    return grant


# --- splitting ---------------------------------------------------------------------------------

demands = st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 50), min_size=1)


@given(st.integers(0, 200), demands)
def test_share_out_gives_out_exactly_the_capacity_and_meets_demand_max_min_fairly(capacity, wanted):
    out = share_out(capacity, wanted)
    assert sum(out.values()) == capacity and set(out) == set(wanted)
    assert all(share >= 0 for share in out.values())
    if sum(wanted.values()) <= capacity:
        assert all(out[w] >= wanted[w] for w in wanted)  # every demand met, the rest spread
    else:
        assert all(out[w] <= wanted[w] for w in wanted)  # nobody gets more than it asked for
        # Max-min: a worker short of its demand has no less than anyone else, but for rounding.
        for w in wanted:
            if out[w] < wanted[w]:
                assert all(out[w] >= out[v] - 1 for v in wanted)


@given(
    st.integers(0, 100),
    st.dictionaries(st.sampled_from("abcd"), st.tuples(st.integers(1, 60), st.integers(1, 8)), min_size=2),
)
def test_weighted_shares_follow_the_weights_until_demand_is_met(capacity, asks):
    wanted = {w: d for w, (d, _) in asks.items()}
    weights = {w: float(k) for w, (_, k) in asks.items()}
    out = share_out(capacity, wanted, weights)
    assert sum(out.values()) == capacity
    if sum(wanted.values()) >= capacity:
        short = [w for w in wanted if out[w] < wanted[w]]
        for a in short:
            for b in short:
                # Per unit of weight, within the rounding of one slot each.
                assert out[a] / weights[a] <= out[b] / weights[b] + 1 / weights[a] + 1 / weights[b]


def test_idle_workers_share_evenly_so_a_first_request_goes_at_once():
    assert share_out(10, {"a": 0, "b": 0, "c": 0}) == {"a": 4, "b": 3, "c": 3}
    # What the busy worker does not need is spread evenly over all.
    assert share_out(100, {"a": 30, "b": 0}) == {"a": 65, "b": 35}


# --- quota leases: examples --------------------------------------------------------------------


def test_two_workers_split_a_quota_and_move_it_to_the_one_that_is_refused():
    ledger = LeaseLedger(0.0)
    ledger.set_limits(TENANT, Limits(tpm=100))
    a, b = WorkerLeases("a"), WorkerLeases("b")
    # a, first, is given the whole; b's half comes once a has applied the cut (a round later).
    for now in (0.0, 0.5, 1.0):
        exchange(ledger, a, now)
        exchange(ledger, b, now)
    assert ledger.shares(TPM) == {"a": 50, "b": 50}
    quota = {TENANT: Limits(tpm=100)}
    # 70 does not fit b's half: refused, told to come back after one renewal, demand noted.
    refused = b.reserve(quota, 70, now=1.5)
    assert refused == Refused(subject=TENANT, limit="tpm", retry_after=RENEW_INTERVAL, short_of_share=True)
    assert b.wants_report()
    exchange(ledger, b, 1.6)  # b asks; a's half is cut but not grantable before a applies it
    assert ledger.shares(TPM)["b"] < 70 and ledger.charged(TPM) <= 100
    exchange(ledger, a, 2.0)  # a is sent the cut
    exchange(ledger, b, 2.1)
    assert ledger.shares(TPM)["b"] < 70
    exchange(ledger, a, 3.0)  # a says it applied it (and that its window is empty)
    exchange(ledger, b, 3.1)
    # b's 70, and what nobody asks for split evenly.
    assert ledger.shares(TPM) == {"a": 15, "b": 85}
    assert isinstance(b.reserve(quota, 70, now=3.2), Reservation)


def test_a_share_taken_back_is_not_regranted_until_the_window_holding_it_drains():
    ledger = LeaseLedger(0.0)
    ledger.set_limits(TENANT, Limits(tpm=100))
    a, b = WorkerLeases("a"), WorkerLeases("b")
    exchange(ledger, a, 0.0)
    exchange(ledger, b, 0.0)
    exchange(ledger, a, 0.5)
    exchange(ledger, b, 0.5)
    quota = {TENANT: Limits(tpm=100)}
    assert isinstance(a.reserve(quota, 50, now=1.0), Reservation)  # a's whole half
    assert isinstance(b.reserve(quota, 80, now=1.0), Refused)
    for now in (2.0, 3.0, 30.0):
        exchange(ledger, b, now)
        exchange(ledger, a, now)
        # a's window holds 50 until its bucket leaves: b may never have more than the other 50.
        assert ledger.shares(TPM)["b"] <= 50
        assert isinstance(b.reserve(quota, 80, now=now), Refused)
    # At 65 a's bucket [0, 5) has left its window; a reports an empty window, b gets its 80.
    for now in (65.0, 66.0, 67.0):
        exchange(ledger, a, now)
        exchange(ledger, b, now)
    assert isinstance(b.reserve(quota, 80, now=67.0), Reservation)


def test_a_cut_off_worker_serves_on_its_shares_and_they_come_back_only_once_it_is_gone():
    ledger = LeaseLedger(0.0)
    ledger.set_limits(TENANT, Limits(rpm=10))
    a, b = WorkerLeases("a"), WorkerLeases("b")
    for now in (0.0, 1.0):
        exchange(ledger, a, now)
        exchange(ledger, b, now)
    quota = {TENANT: Limits(rpm=10)}
    a.report(1.5)  # sent at 1.5, never answered: a is cut off from here on
    assert a.expires_at == 1.0 + LEASE_TTL  # when the control plane counts it silent
    # Long past that, it still admits on its share, and no more: the data plane serves on.
    later = 1.0 + LEASE_TTL + 300.0
    admitted = [a.reserve(quota, 0, now=later) for _ in range(6)]
    assert [isinstance(r, Reservation) for r in admitted] == [True] * 5 + [False]
    # The ledger never hands a's share to b while a may be admitting on it.
    for now in range(2, 600, 7):
        exchange(ledger, b, float(now))
        assert ledger.shares(RPM)["b"] <= 5 and ledger.charged(RPM) <= 10
    # a's process is known to be gone (the server killed it): its share comes back once what
    # it admitted has left the minute's window, not before.
    ledger.gone("a", 600.0)
    exchange(ledger, b, 600.0 + MINUTE.span_seconds)
    assert ledger.shares(RPM)["b"] <= 5
    exchange(ledger, b, 600.0 + MINUTE.span_seconds + MINUTE.bucket_seconds)
    exchange(ledger, b, 600.0 + MINUTE.span_seconds + MINUTE.bucket_seconds + 1)
    assert ledger.shares(RPM) == {"b": 10}


def test_past_its_lease_a_worker_holding_no_slot_of_a_replica_fills_one_and_reports_none():
    """Shares freeze where demand left them: with b busy when the control plane went, both of r's
    slots are b's. Past its lease, a fills one anyway (r runs one request over its slots, which
    its engine queues) rather than answer 503 to all its clients; a quota gets no such floor, and
    a's reports say the share as granted, so a new ledger adopts no more than the slots."""
    ledger = LeaseLedger(0.0)
    ledger.set_replicas({"r": ("m", 2)})
    ledger.set_limits(TENANT, Limits(rpm=10))
    a, b = WorkerLeases("a"), WorkerLeases("b")
    busy = [Waiting(model="m", band=0, tenant="t", count=2)]
    for now in (0.0, 1.0, 2.0, 3.0):
        ledger.receive(b.report(now, waiting=busy), now)
        b.apply(ledger.grant("b", now), now)
        exchange(ledger, a, now)
    rpm = a.share(TENANT, "rpm", 3.0)
    assert (a.slots("r", 3.0), b.slots("r", 3.0)) == (0, 2) and 0 < rpm < 10
    assert not a.lapsed(a.expires_at - 0.1) and a.slots("r", a.expires_at - 0.1) == 0
    later = a.expires_at + 300.0
    assert a.lapsed(later) and b.lapsed(later)
    assert (a.slots("r", later), b.slots("r", later)) == (1, 2)
    assert a.share(TENANT, "rpm", later) == rpm
    assert [(s.replica, s.share) for s in a.report(later, in_flight={"r": 1}).slots] == [("r", 0)]
    # A control plane again: it adopts the shares as granted, and a is back on its share.
    new = LeaseLedger(later, awaiting=("a", "b"))
    new.set_replicas({"r": ("m", 2)})
    new.set_limits(TENANT, Limits(rpm=10))
    for now in (later, later + 1, later + 2):
        exchange(new, a, now)
        exchange(new, b, now)
        assert sum(new.shares(("slot", "r")).values()) <= 2
    assert not a.lapsed(later + 2) and a.slots("r", later + 2) == new.shares(("slot", "r"))["a"]


def test_a_worker_started_again_under_its_name_is_a_new_process_to_the_ledger():
    ledger = LeaseLedger(0.0)
    ledger.set_limits(TENANT, Limits(rpm=10))
    ledger.set_replicas({"r": ("m", 4)})
    a, b = WorkerLeases("a"), WorkerLeases("b")
    for now in (0.0, 1.0, 2.0):
        exchange(ledger, a, now)
        exchange(ledger, b, now)
    quota = {TENANT: Limits(rpm=10)}
    for _ in range(5):
        assert isinstance(a.reserve(quota, 0, now=2.5), Reservation)
    exchange(ledger, a, 3.0)  # its window holds 5
    ledger.gone("a", 3.5)
    # The new a counts its reports from 1 again: heard, granted, and its slots come at once (the
    # old process's requests died with it), while the old one's 5 requests still count.
    again = WorkerLeases("a")
    for now in (4.0, 5.0, 6.0):
        exchange(ledger, again, now)
        exchange(ledger, b, now)
    assert again.live(6.0) and again.slots("r", 6.0) > 0
    assert ledger.charged(RPM) <= 10
    assert again.share(TENANT, "rpm", 6.0) + b.share(TENANT, "rpm", 6.0) <= 5
    # The old process's charge is left out of the split: b, which held half of all of it, is
    # cut to half of what is left, and the new a, refused, gets the other half in two rounds.
    assert isinstance(again.reserve(quota, 0, now=6.5), Refused) or again.share(TENANT, "rpm", 6.5) > 0
    for now in (7.0, 7.5):
        exchange(ledger, again, now)
        exchange(ledger, b, now)
    exchange(ledger, again, 8.0)
    assert again.share(TENANT, "rpm", 8.0) >= 2 and ledger.charged(RPM) <= 10


def test_a_worker_started_in_a_gone_ones_place_is_refused_by_its_share_alone_until_it_moves():
    """The 429 a replaced worker answered within quota (rpm 200, six requests): its first grant
    holds no share, as the gone worker's charge and the other's uncut share take the whole limit.
    The refusal says it is the share's, not the limit's, and the room comes with the next grants
    once the other worker applied its cut: what the gate waits for (server.gate.SHARE_WAIT)."""
    ledger = LeaseLedger(0.0, ttl=3.0)
    ledger.set_limits(TENANT, Limits(rpm=200))
    quota = {TENANT: Limits(rpm=200)}
    w0, w1 = WorkerLeases("w0"), WorkerLeases("w1")
    for now in (0.0, 1.0, 2.0):
        exchange(ledger, w0, now)
        exchange(ledger, w1, now)
    assert ledger.shares(RPM) == {"w0": 100, "w1": 100}
    for now in (3.0, 4.0, 5.0, 6.0):
        exchange(ledger, w0, now)  # w1 is silent from 2.0 on
    ledger.gone("w1", 6.0)  # silent past the lease: killed, and said so
    again = WorkerLeases("w1")
    exchange(ledger, again, 6.5)
    assert again.live(6.5) and again.share(TENANT, "rpm", 6.5) == 0
    refused = again.reserve(quota, 0, now=6.6)
    assert isinstance(refused, Refused) and refused.short_of_share
    assert again.wants_report()
    # The cut reaches w0 (due at once), w0 acknowledges it, and the room is w1's.
    assert ledger.due() == ["w0"]
    w0.apply(ledger.grant("w0", 6.6), 6.6)
    assert w0.wants_report()
    exchange(ledger, w0, 6.7)
    assert "w1" in ledger.due()
    again.apply(ledger.grant("w1", 6.7), 6.7)
    assert again.share(TENANT, "rpm", 6.7) > 0
    assert isinstance(again.reserve(quota, 0, now=6.8), Reservation)
    assert ledger.charged(RPM) <= 200


def test_a_refusal_by_the_whole_limit_is_not_short_of_share():
    ledger = LeaseLedger(0.0)
    ledger.set_limits(TENANT, Limits(rpm=2))
    quota = {TENANT: Limits(rpm=2)}
    alone = WorkerLeases("a")
    exchange(ledger, alone, 0.0)
    assert alone.share(TENANT, "rpm", 0.0) == 2
    for _ in range(2):
        assert isinstance(alone.reserve(quota, 0, now=0.5), Reservation)
    refused = alone.reserve(quota, 0, now=0.5)
    assert isinstance(refused, Refused) and not refused.short_of_share
    # With a second worker, the same window refuses by the share: the room may be the other's.
    other = WorkerLeases("b")
    exchange(ledger, other, 1.0)
    assert isinstance(other.reserve(quota, 0, now=1.0), Refused)
    assert other.reserve(quota, 0, now=1.0).short_of_share


def test_a_new_ledger_adopts_the_workers_shares_and_raises_none_until_they_reported():
    old = LeaseLedger(0.0)
    old.set_limits(TENANT, Limits(tpm=100))
    a, b = WorkerLeases("a"), WorkerLeases("b")
    for now in (0.0, 1.0):
        exchange(old, a, now)
        exchange(old, b, now)
    # The control plane restarts; a comes back first and asks for more.
    new = LeaseLedger(5.0, awaiting=("a", "b"))
    new.set_limits(TENANT, Limits(tpm=100))
    assert isinstance(a.reserve({TENANT: Limits(tpm=100)}, 80, now=5.0), Refused)
    grant = exchange(new, a, 5.0)
    assert grant.full and new.shares(TPM) == {"a": 50}  # adopted, not raised: b is unheard
    exchange(new, b, 5.5)
    exchange(new, a, 6.0)
    exchange(new, b, 6.5)
    exchange(new, a, 7.0)
    assert new.shares(TPM)["a"] > 50 and new.charged(TPM) <= 100


def test_a_new_ledgers_grants_are_not_taken_for_the_old_ones():
    old = LeaseLedger(0.0)
    old.set_replicas({"r": ("m", 2)})
    a, b = WorkerLeases("a"), WorkerLeases("b")
    for now in range(40):  # many grants: the worker has acknowledged up to about 40
        exchange(old, a, float(now))
        exchange(old, b, float(now))
    assert a.slots("r", 40.0) == 1
    new = LeaseLedger(50.0, awaiting=("a", "b"))
    new.set_replicas({"r": ("m", 2)})
    exchange(new, a, 50.0)
    exchange(new, b, 50.0)
    # b waits for two more; a has nothing to do: the new ledger moves a's slot to b, and both
    # take its grants (numbered on from the old ledger's), not drop them as already seen.
    waiting = [Waiting(model="m", band=0, tenant="t", count=2)]
    for now in (51.0, 52.0, 53.0):
        new.receive(b.report(now, in_flight={"r": 1}, waiting=waiting), now)
        b.apply(new.grant("b", now), now)
        exchange(new, a, now)
    assert (a.slots("r", 53.0), b.slots("r", 53.0)) == (0, 2)


def test_messages_travel_as_plain_json():
    ledger = LeaseLedger(0.0)
    ledger.set_limits(TENANT, Limits(tpm=100))
    ledger.set_replicas({"r1": ("m", 4)})
    a = WorkerLeases("a")
    report = a.report(0.0, in_flight={"r1": 1}, waiting=[Waiting(model="m", band=1, tenant="t", count=2)])
    converter = cattrs.Converter()
    for message in (report, (ledger.receive(report, 0.0), ledger.grant("a", 0.0))[1]):
        text = json.dumps(converter.unstructure(message))
        assert converter.structure(json.loads(text), type(message)) == message
    with pytest.raises(ValueError, match="has not reported"):
        ledger.grant("b", 0.0)


# --- quota leases: 64 clients over two workers ------------------------------------------------

CLIENTS = 64
SMALL = Limits(rpm=40, tpm=200)
WORKERS = ("a", "b")

gaps = st.one_of(st.just(0.0), st.none(), st.integers(min_value=0, max_value=40).map(lambda q: q / 4))
client_steps = st.tuples(
    st.just("client"),
    st.integers(0, CLIENTS - 1),
    gaps,
    st.one_of(st.integers(0, 30), st.integers(0, 300)),  # estimate; now and then above the limit
    st.integers(-300, 0),  # what it used below its estimate
    st.booleans(),  # release instead of settling
    st.sampled_from(WORKERS),  # the worker its connection lands on
)
lease_steps = st.one_of(
    st.tuples(st.just("report"), st.sampled_from(WORKERS)),
    st.tuples(st.just("deliver_report")),
    st.tuples(st.just("deliver_grant"), st.sampled_from(WORKERS)),
    st.tuples(st.just("cut"), st.sampled_from(WORKERS)),
    st.tuples(st.just("restart"), st.sampled_from(WORKERS)),
    st.tuples(st.just("tick"), st.sampled_from([1.0, 5.0, 20.0, 40.0])),
)
schedules = st.lists(st.one_of(client_steps, client_steps, lease_steps), max_size=500)


@attrs.define
class Admitted:
    at: float
    step: int
    estimate: int
    final: int
    requests: int = 1


def run_two_workers(schedule) -> list[Admitted]:
    ledger = LeaseLedger(0.0)
    ledger.set_limits(TENANT, SMALL)
    workers = {name: WorkerLeases(name) for name in WORKERS}
    to_ledger: list[LeaseReport] = []  # in order, delivered one by one
    to_worker: dict[str, list[LeaseGrant]] = {name: [] for name in WORKERS}
    cut: set[str] = set()
    holding: dict[int, tuple[str, Reservation, Admitted]] = {}
    admitted: list[Admitted] = []
    told: list[float] = []
    now = 0.0
    for step, event in enumerate(schedule):
        kind = event[0]
        if kind == "report":
            report = workers[event[1]].report(now)
            if event[1] not in cut:
                to_ledger.append(report)
        elif kind == "deliver_report" and to_ledger:
            report = to_ledger.pop(0)
            ledger.receive(report, now)
            to_worker[report.worker].append(ledger.grant(report.worker, now))
        elif kind == "deliver_grant" and to_worker[event[1]]:
            grant = to_worker[event[1]].pop(0)
            if event[1] not in cut:
                workers[event[1]].apply(grant, now)
        elif kind == "cut":
            cut.add(event[1])  # it keeps serving, on its last shares, for as long as it runs
        elif kind == "restart":
            # Its process dies (its requests count at their estimates), the server's shell sees
            # it go — its link ended, so nothing more of it reaches the ledger — and starts a new
            # process under its name.
            name = event[1]
            for client in [c for c, (where, _, _) in holding.items() if where == name]:
                del holding[client]
            to_ledger[:] = [r for r in to_ledger if r.worker != name]
            to_worker[name] = []
            cut.discard(name)
            ledger.gone(name, now)
            workers[name] = WorkerLeases(name)
        elif kind == "tick":
            now += event[1]
        elif kind == "client":
            _, client, gap, estimate, under, release, name = event
            if gap is not None:
                now += gap
            elif told:
                now = max(now, min(told))
                told.remove(min(told))
            if client in holding:
                where, reservation, record = holding.pop(client)
                if release:
                    workers[where].release(reservation)
                    record.final = record.requests = 0
                else:
                    record.final = max(0, record.estimate + under)
                    workers[where].settle(reservation, record.final)
                continue
            result = workers[name].reserve({TENANT: SMALL}, estimate, now)
            if isinstance(result, Refused):
                assert result.retry_after > 0 and math.isfinite(result.retry_after)
                told.append(now + result.retry_after)
                continue
            record = Admitted(at=now, step=step, estimate=estimate, final=estimate)
            holding[client] = (name, result, record)
            admitted.append(record)
        for key in (TPM, RPM):
            assert ledger.charged(key) <= ledger.capacity(key)
    return admitted


@settings(max_examples=300, deadline=None)
@given(schedules)
def test_64_clients_over_two_workers_overshoot_by_no_more_than_one_reservation(schedule):
    admitted = run_two_workers(schedule)
    for first in admitted:
        inside = [r for r in admitted if first.at <= r.at < first.at + MINUTE.span_seconds]
        last = max(inside, key=lambda r: r.step)
        tokens = sum(r.final for r in inside)
        # The one-process bound: the limit, or a single reservation larger than it alone.
        assert tokens <= max(SMALL.tpm, last.estimate)
        assert tokens <= SMALL.tpm + max(r.estimate for r in inside)
        assert sum(r.requests for r in inside) <= SMALL.rpm


def test_64_clients_over_two_workers_get_the_quota_once_shares_follow_them():
    """Not only safe: with reports flowing, the two workers together admit the whole limit."""
    ledger = LeaseLedger(0.0)
    ledger.set_limits(TENANT, Limits(tpm=640))
    workers = [WorkerLeases("a"), WorkerLeases("b")]
    admitted = 0
    for tick in range(12):
        now = tick * 0.5
        for w in workers:
            exchange(ledger, w, now)
        for client in range(CLIENTS):
            # Most clients' connections are on worker a.
            worker = workers[0] if client % 4 else workers[1]
            if isinstance(
                worker.reserve({TENANT: Limits(tpm=640)}, 10, now + 0.01 * client / CLIENTS), Reservation
            ):
                admitted += 10
    assert admitted == 640


# --- slot leases ------------------------------------------------------------------------------

DRAIN = 30.0  # the longest a request runs in these schedules

slot_steps = st.one_of(
    st.tuples(st.just("start"), st.integers(0, 2), st.integers(0, 3)),
    st.tuples(st.just("start"), st.integers(0, 2), st.integers(0, 3)),
    st.tuples(st.just("finish"), st.integers(0, 2), st.integers(0, 3)),
    st.tuples(st.just("report"), st.integers(0, 2), st.integers(0, 3)),
    st.tuples(st.just("deliver_report")),
    st.tuples(st.just("deliver_grant"), st.integers(0, 2)),
    st.tuples(st.just("cut"), st.integers(0, 2)),
    st.tuples(st.just("kill"), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("replica"), st.integers(0, 3), st.integers(0, 5)),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 3.0, 15.0, 40.0])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(slot_steps, max_size=400))
def test_a_replica_never_has_more_requests_in_flight_than_its_slots_across_workers(schedule):
    ledger = LeaseLedger(0.0)
    replicas = {"r0": ("m", 2), "r1": ("m", 3)}
    ledger.set_replicas(replicas)
    made = 2
    names = ["w0", "w1", "w2"]
    workers = {n: WorkerLeases(n) for n in names}
    in_flight: dict[str, dict[str, list[float]]] = {n: {} for n in names}  # start times
    to_ledger: list[LeaseReport] = []
    to_worker: dict[str, list[LeaseGrant]] = {n: [] for n in names}
    cut: set[str] = set()
    now = 0.0
    generation = [0, 0, 0]
    for event in schedule:
        kind = event[0]
        if kind == "tick":
            now += event[1]
            for runs in in_flight.values():  # no request runs longer than DRAIN
                for replica in runs:
                    runs[replica] = [at for at in runs[replica] if now - at < DRAIN]
        elif kind in ("start", "finish", "report"):
            name, replica = names[event[1]], sorted(replicas)[event[2] % len(replicas)] if replicas else None
            runs = in_flight[name]
            if kind == "report":
                counts = {r: len(starts) for r, starts in runs.items()}
                report = workers[name].report(
                    now, in_flight=counts, waiting=[Waiting(model="m", band=0, tenant=name, count=event[2])]
                )
                if name not in cut:
                    to_ledger.append(report)
            elif replica is None:
                continue
            elif kind == "start" and len(runs.get(replica, [])) < workers[name].slots(replica, now):
                runs.setdefault(replica, []).append(now)
                total = sum(len(r.get(replica, [])) for r in in_flight.values())
                assert total <= replicas[replica][1], (replica, total)
            elif kind == "finish" and runs.get(replica):
                runs[replica].pop(0)
        elif kind == "deliver_report" and to_ledger:
            report = to_ledger.pop(0)
            ledger.receive(report, now)
            to_worker[report.worker].append(ledger.grant(report.worker, now))
        elif kind == "deliver_grant":
            name = names[event[1]]
            if to_worker[name]:
                grant = to_worker[name].pop(0)
                if name not in cut:
                    workers[name].apply(grant, now)
        elif kind == "cut":
            cut.add(names[event[1]])  # keeps its requests running, starts more while its lease lasts
        elif kind == "kill":
            name = names[event[1]]
            in_flight[name] = {}  # its requests die with it
            if event[2]:
                # Its supervisor saw it go (its link ended: nothing more of it arrives) and starts
                # a new process under its name.
                ledger.gone(name, now)
                to_ledger[:] = [r for r in to_ledger if r.worker != name]
                cut.discard(name)
                new = name
            else:
                # Unseen: it may as well be running still, so a new process under a new name.
                generation[event[1]] += 1
                new = f"w{event[1]}.{generation[event[1]]}"
                names[event[1]] = new
            workers[new] = WorkerLeases(new)
            in_flight[new] = {}
            to_worker[new] = []
        elif kind == "replica":
            # A replica goes (its requests fail with it) or a new one comes.
            ids = sorted(replicas)
            if event[1] < len(ids) and len(ids) > 1:
                gone = ids[event[1]]
                del replicas[gone]
                for runs in in_flight.values():
                    runs.pop(gone, None)
            else:
                replicas[f"r{made}"] = ("m", event[2])
                made += 1
            ledger.set_replicas(replicas)
        for replica, (_, slots) in replicas.items():
            assert ledger.charged(("slot", replica)) <= slots or not any(
                ledger.shares(("slot", replica)).values()
            )


# --- fairness inside a band, across workers ---------------------------------------------------


@attrs.frozen
class _Replica:
    replica: str
    slots: int
    load: None = None


@attrs.frozen
class _Offer:
    replicas: tuple[_Replica, ...]
    policy: str = ROUND_ROBIN
    load_factor: float = 1.25


def serve(placement: dict[str, list[str]], seconds: float = 300.0, slots: int = 6) -> dict[str, int]:
    """Each worker runs its own lane (core.admission) on its leased slots; every tenant keeps a
    deep backlog on the workers ``placement`` puts it on. Requests take 1 s; workers report every
    second. Returns requests served per tenant."""
    ledger = LeaseLedger(0.0)
    ledger.set_replicas({"r": ("m", slots)})
    workers = {name: WorkerLeases(name) for name in placement}
    # Each lane weighs its tenants as the worker's grants say (what server/worker.py wires up).
    lanes = {
        name: AdmissionLane(
            10_000, weight=lambda band, tenant, w=workers[name]: w.tenant_weight("m", band, tenant)
        )
        for name in placement
    }
    running: dict[str, list[tuple[float, str]]] = {name: [] for name in placement}  # (ends, tenant)
    served: dict[str, int] = {}
    ids = iter(range(10**9))
    tenant_of: dict[int, str] = {}
    step = 0.1
    now = 0.0
    for name, tenants in placement.items():
        for tenant in tenants:
            for _ in range(2000):
                i = next(ids)
                tenant_of[i] = tenant
                went = lanes[name].arrive(
                    Arrival(id=i, tenant=tenant, band=1, deadline=math.inf), None, now, lambda: 0
                )
                assert isinstance(went, Queued)
    while now < seconds:
        if round(now / step) % round(RENEW_INTERVAL / step) == 0:
            for name, worker in workers.items():
                waiting: dict[str, int] = {}
                for i in lanes[name]._waiting:
                    waiting[tenant_of[i]] = waiting.get(tenant_of[i], 0) + 1
                ledger.receive(
                    worker.report(
                        now,
                        in_flight=dict(lanes[name].in_flight),
                        waiting=[Waiting(model="m", band=1, tenant=t, count=n) for t, n in waiting.items()],
                    ),
                    now,
                )
                worker.apply(ledger.grant(name, now), now)
        for name, worker in workers.items():
            for ends, tenant in [r for r in running[name] if r[0] <= now]:
                running[name].remove((ends, tenant))
                lanes[name].release("r")
                served[tenant] = served.get(tenant, 0) + 1
            offer = _Offer(replicas=(_Replica(replica="r", slots=worker.slots("r", now)),))
            for go in lanes[name].dispatch(offer, now, lambda: 0):
                assert isinstance(go, Go)
                running[name].append((now + 1.0, tenant_of[go.id]))
        assert sum(len(r) for r in running.values()) <= slots
        now = round(now + step, 6)
    return served


def test_tenants_of_a_band_share_a_replica_by_tenant_not_by_worker_up_to_whole_slots():
    # Three tenants wait on worker a, one on worker b. Split by worker it would be 3:3 (b's tenant
    # a half); by tenant it is 4.5:1.5, rounded to whole slots 5:1.
    served = serve({"a": ["t1", "t2", "t3"], "b": ["t4"]})
    total = sum(served.values())
    assert total >= 6 * 290  # the replica's slots stay busy
    for tenant in ("t1", "t2", "t3"):
        assert abs(served[tenant] / total - 5 / 18) < 0.01, served
    assert abs(served["t4"] / total - 1 / 6) < 0.01, served
    # Four tenants on 8 slots divide evenly: exactly a quarter each.
    served = serve({"a": ["t1", "t2", "t3"], "b": ["t4"]}, slots=8)
    total = sum(served.values())
    for tenant in ("t1", "t2", "t3", "t4"):
        assert abs(served[tenant] / total - 1 / 4) < 0.01, served


def test_a_tenant_waiting_on_two_workers_gets_no_more_than_one_waiting_on_one():
    # t1 waits on both workers, t2 on a alone. Unweighted, a would rotate t1 and t2 evenly on its
    # 6 of 8 slots and t1 would add b's 2: 5:3. Weighted by its half of t1's waiters, a gives t1
    # a third of its slots: 2 + 2 against t2's 4.
    served = serve({"a": ["t1", "t2"], "b": ["t1"]}, slots=8)
    total = sum(served.values())
    assert total >= 8 * 290
    assert abs(served["t1"] / total - 1 / 2) < 0.01, served
    # Spread over both workers, beside two tenants waiting on one each: a third each.
    served = serve({"a": ["t1", "t2"], "b": ["t1", "t3"]}, slots=6)
    total = sum(served.values())
    for tenant in ("t1", "t2", "t3"):
        assert abs(served[tenant] / total - 1 / 3) < 0.01, served


def test_a_grant_carries_the_workers_part_of_each_shared_tenant_and_only_those():
    ledger = LeaseLedger(0.0)
    ledger.set_replicas({"r": ("m", 4)})
    a, b = WorkerLeases("a"), WorkerLeases("b")
    waits = {
        "a": [
            Waiting(model="m", band=1, tenant="t1", count=3),
            Waiting(model="m", band=1, tenant="t2", count=2),
        ],
        "b": [Waiting(model="m", band=1, tenant="t1", count=1)],
    }
    for worker in (a, b):
        ledger.receive(worker.report(0.0, in_flight={}, waiting=waits[worker.worker]), 0.0)
    for worker in (a, b):
        worker.apply(ledger.grant(worker.worker, 0.0), 0.0)
    assert a.tenant_weight("m", 1, "t1") == 0.75 and b.tenant_weight("m", 1, "t1") == 0.25
    assert a.tenant_weight("m", 1, "t2") == 1.0  # a holds all of t2's waiters
    assert a.tenant_weight("other", 1, "t1") == 1.0
    # Once b's waiters are gone, a's next grant gives t1 back its whole weight.
    ledger.receive(b.report(1.0, in_flight={}, waiting=[]), 1.0)
    ledger.receive(a.report(1.0, in_flight={}, waiting=waits["a"]), 1.0)
    a.apply(ledger.grant("a", 1.0), 1.0)
    assert a.tenant_weight("m", 1, "t1") == 1.0


# --- the quota book's memory ------------------------------------------------------------------


def test_the_book_stays_bounded_over_a_long_run_of_many_distinct_subjects():
    book = QuotaBook()
    most_subjects = most_buckets = 0
    # Ten simulated days; every minute a new tenant and a new key, each with a few requests.
    for minute in range(10 * 24 * 60):
        now = minute * 60.0
        quotas = {("tenant", f"t{minute}"): Limits(tpm=1000), ("key", f"k{minute}"): Limits()}
        for second in range(0, 60, 20):
            assert isinstance(book.reserve(quotas, 10, now + second), Reservation)
        most_subjects = max(most_subjects, len(book))
        most_buckets = max(most_buckets, book.buckets())
    # Only the subjects counted in the last day and an hour (at most 25 h of minutes, two each).
    assert most_subjects <= 2 * 25 * 60
    assert most_buckets <= most_subjects * (MINUTE.full_buckets + 1 + 25)
    assert len(book) <= 2 * 25 * 60 < 2 * 10 * 24 * 60
