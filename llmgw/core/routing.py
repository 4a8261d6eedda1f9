"""Which replica a request goes to: a model's candidate replicas, best first.

The gateway is the only owner of the order. The admission queue asks :func:`decide` for each
request: go now to the replica it ranks first (which has room), or — with the prefix policy —
wait for one replica in particular; the relay tries the order given and falls back to the next
only when a connect fails.

Three policies, chosen per profile:

- ``prefix`` (the default): consistent hashing with bounded loads (CHWBL). The request's
  :func:`prefix_key` — the start of its prompt, which is where a chat's system prompt and first
  turns sit — picks a point on a ring of replica points; walking on from it gives the key's
  preference list. The first replica on it whose load (requests in flight and waiting for it),
  with this request, stays within ``load_factor × (the average load + 1)`` takes it — at once
  if it has room, else when it has. Requests that share a prefix so land where the engine's
  prompt cache already holds it, while no replica is loaded past the bound; a replica that is
  added or removed moves only the keys next to its own points.
- ``least-loaded``: the lowest in-flight ÷ slots, with engines that report requests waiting
  inside them or a nearly full KV cache after the others; ties broken by a salt the shell
  draws, so that equal replicas share the load instead of the first one taking it all.
- ``round-robin``: each replica with room in turn, for comparison.

Room: a replica takes up to its slots (its profile's ``parallel``) at once; one whose engine
reports waiting requests or a KV cache at :data:`SATURATED` takes no more than it runs. Only
the gateway's own in-flight count moves per request: the engine's numbers are as of the last
scrape, good for telling a full engine from a free one, too old to count requests by.

Adapters: a request that names an adapter has for candidates only the replicas that serve it
(the admission lane leaves the others out), and its adapter's name starts its prefix key, so the
same prompt for two adapters keys two places (two caches: the engine's KV for one adapter is not
the other's).

Pure: no I/O, no clock, no randomness of its own.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections.abc import Mapping, Sequence

import attrs

frozen = attrs.frozen(kw_only=True)

PREFIX = "prefix"
LEAST_LOADED = "least-loaded"
ROUND_ROBIN = "round-robin"
POLICIES = (PREFIX, LEAST_LOADED, ROUND_ROBIN)
DEFAULT_POLICY = PREFIX

# CHWBL's bound: a replica takes a request while its in-flight count, with it, stays within this
# factor of the average (+ 1). 1.25 is what the algorithm's authors and KubeAI use: tight enough
# that a hot prefix spills before one replica queues, loose enough that most keys stay home.
DEFAULT_LOAD_FACTOR = 1.25
# Characters of the prompt that make its key: enough to tell system prompts apart, few enough
# that the key is a system prompt's (or a conversation's first turns'), not one request's.
DEFAULT_PREFIX_CHARS = 256
# Points per replica on the ring: more points, a more even share of the keys per replica.
RING_POINTS = 64
# An engine whose KV cache (or slots) is this full takes no more than it already runs.
SATURATED = 0.95

# Outcomes, for the gateway's metrics: the key's own replica took it, or it spilled over to
# another (over the load bound, or no room); the other policies have one outcome each.
AFFINITY = "affinity"
SPILLED = "spilled"
NO_KEY = "no-key"  # a prefix policy request with no prompt to key on: chosen as least-loaded


@frozen
class Candidate:
    """A Ready replica a request may go to."""

    id: str
    slots: int  # requests it serves at once
    in_flight: int = 0  # the gateway's own requests on it now
    queued: int = 0  # requests waiting at the gateway for this replica in particular
    # The engine's last scraped load; None when unknown (not scraped yet, or not answering).
    running: int | None = None
    waiting: int = 0
    saturation: float = 0.0


@frozen
class Choice:
    order: tuple[str, ...]  # replica ids, best first
    outcome: str  # for metrics: AFFINITY, SPILLED, NO_KEY, LEAST_LOADED or ROUND_ROBIN


def is_full(candidate: Candidate) -> bool:
    """Its engine says it takes no more: requests wait inside it, or its cache is nearly full."""
    return candidate.running is not None and (candidate.waiting > 0 or candidate.saturation >= SATURATED)


def room(candidate: Candidate) -> int:
    """How many more requests the replica takes now (0 or more)."""
    slots = candidate.slots
    if is_full(candidate):
        slots = min(slots, candidate.running)
    return max(0, slots - candidate.in_flight)


def has_room(candidates: Sequence[Candidate]) -> bool:
    return any(room(candidate) > 0 for candidate in candidates)


def order(
    policy: str,
    candidates: Sequence[Candidate],
    *,
    key: bytes | None = None,
    salt: int = 0,
    turn: int = 0,
    load_factor: float = DEFAULT_LOAD_FACTOR,
) -> Choice:
    """The candidates best first, for one request. With least-loaded and round-robin, replicas
    with room come before those without, so the first has room whenever :func:`has_room` says
    some has; with prefix, the key's replica within the load bound comes first, room or not
    (:func:`decide` says whether the request waits for it), and the others follow, those with
    room first.

    ``key``: the request's :func:`prefix_key` (prefix policy); ``salt``: random bits for the
    least-loaded tie-break; ``turn``: the round-robin counter. Raises ValueError for an unknown
    policy or no candidates."""
    if not candidates:
        raise ValueError("no candidates to order")
    if policy == PREFIX:
        if key is None:
            return Choice(order=_least_loaded(candidates, salt), outcome=NO_KEY)
        return _bounded_hash(candidates, key, load_factor)
    if policy == LEAST_LOADED:
        return Choice(order=_least_loaded(candidates, salt), outcome=LEAST_LOADED)
    if policy == ROUND_ROBIN:
        return Choice(order=_round_robin(candidates, turn), outcome=ROUND_ROBIN)
    raise ValueError(f"unknown routing policy {policy!r}; expected one of {', '.join(POLICIES)}")


def load(candidate: Candidate) -> int:
    """What CHWBL counts against a replica: its requests in flight and those waiting for it."""
    return candidate.in_flight + candidate.queued


def load_bound(candidates: Sequence[Candidate], load_factor: float) -> int:
    """The most requests one replica may hold, this one included, under CHWBL's bound.

    With the ceiling, the n replicas together may hold at least ``load_factor × (total + 1)``,
    more than their total load: some replica is always under the bound."""
    total = sum(load(candidate) for candidate in candidates)
    return max(1, math.ceil(load_factor * (total + 1) / len(candidates)))


def _bounded_hash(candidates: Sequence[Candidate], key: bytes, load_factor: float) -> Choice:
    """CHWBL: the first replica on the key's ring walk whose load, with this request, stays
    within the bound — room or not (decide says whether to wait for it); the rest after it."""
    preference = _preference(candidates, key)
    bound = load_bound(candidates, load_factor)
    target = next(c for c in preference if load(c) + 1 <= bound)  # one always is: see load_bound
    return _chosen_first(target, preference)


def _preference(candidates: Sequence[Candidate], key: bytes) -> list[Candidate]:
    by_id = {candidate.id: candidate for candidate in candidates}
    return [by_id[rid] for rid in ring(tuple(sorted(by_id))).walk(key)]


def _chosen_first(chosen: Candidate, preference: list[Candidate]) -> Choice:
    rest = [c for c in preference if c is not chosen]
    rest.sort(key=lambda c: room(c) == 0)  # stable: the ring's order among equals
    outcome = AFFINITY if chosen is preference[0] else SPILLED
    return Choice(order=(chosen.id, *(c.id for c in rest)), outcome=outcome)


@frozen
class Decision:
    """What to do with one request now: go (to ``choice.order[0]``, which has room), or wait for
    that replica in particular (``wait``)."""

    choice: Choice
    wait: bool = False


def decide(
    policy: str,
    candidates: Sequence[Candidate],
    *,
    key: bytes | None = None,
    salt: int = 0,
    turn: int = 0,
    load_factor: float = DEFAULT_LOAD_FACTOR,
) -> Decision | None:
    """The admission queue's question for one request: where it goes now, or which replica it
    waits for; None when it can do neither (no replica has room, and its policy waits for none).

    Only the prefix policy waits for a replica. Its key's replica is the first on the ring
    whose load — in flight and waiting — stays within the bound; when that one is full the
    request waits for it rather than go where no cache holds its prompt, which would cost a
    whole prefill (for a long prompt, more than waiting for a slot). The bound is what keeps
    that wait short: past it, the key spills over to the next replica on the ring, waiting for
    that one if it too is full. The others go wherever has room, or stay in the queue."""
    if not candidates:
        return None
    if len(candidates) == 1:
        # One replica (the common case): nothing to rank, and the ring would say the same.
        only = candidates[0]
        if policy == PREFIX and key is not None:
            return Decision(choice=Choice(order=(only.id,), outcome=AFFINITY), wait=room(only) == 0)
        if room(only) == 0:
            return None
        outcome = NO_KEY if policy == PREFIX else policy
        return Decision(choice=Choice(order=(only.id,), outcome=outcome))
    if policy == PREFIX and key is not None:
        choice = _bounded_hash(candidates, key, load_factor)
        target = next(c for c in candidates if c.id == choice.order[0])
        return Decision(choice=choice, wait=room(target) == 0)
    if not has_room(candidates):
        return None
    return Decision(choice=order(policy, candidates, key=key, salt=salt, turn=turn, load_factor=load_factor))


def _least_loaded(candidates: Sequence[Candidate], salt: int) -> tuple[str, ...]:
    def rank(candidate: Candidate) -> tuple:
        return (
            room(candidate) == 0,
            is_full(candidate),
            candidate.in_flight / max(1, candidate.slots),
            _hash(salt.to_bytes(8, "little", signed=False) + candidate.id.encode()),
        )

    return tuple(c.id for c in sorted(candidates, key=rank))


def _round_robin(candidates: Sequence[Candidate], turn: int) -> tuple[str, ...]:
    ids = sorted(candidates, key=lambda c: c.id)
    start = turn % len(ids)
    rotated = ids[start:] + ids[:start]
    rotated.sort(key=lambda c: room(c) == 0)  # stable: the turn's order among those with room
    return tuple(c.id for c in rotated)


class Ring:
    """Replica points on a 64-bit hash ring; :meth:`walk` lists replicas in a key's order."""

    def __init__(self, replica_ids: Sequence[str], points: int = RING_POINTS) -> None:
        entries = sorted((_hash(f"{rid}#{i}".encode()), rid) for rid in replica_ids for i in range(points))
        self._hashes = [h for h, _ in entries]
        self._ids = [rid for _, rid in entries]
        self._count = len(set(replica_ids))

    def walk(self, key: bytes) -> list[str]:
        """Every replica once, in the order met going round from the key's point."""
        start = bisect.bisect_left(self._hashes, _hash(key))
        seen: dict[str, None] = {}
        size = len(self._ids)
        for step in range(size):
            seen.setdefault(self._ids[(start + step) % size])
            if len(seen) == self._count:
                break
        return list(seen)


@functools.lru_cache(maxsize=256)
def ring(replica_ids: tuple[str, ...]) -> Ring:
    """The ring of a set of replicas (sorted ids), built once per set: replicas change rarely."""
    return Ring(replica_ids)


def _hash(data: bytes) -> int:
    # Not Python's hash(): that is salted per process, and every gateway process (and the same
    # one after a restart) must map a key to the same replica.
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_key(
    payload: Mapping, chars: int = DEFAULT_PREFIX_CHARS, adapter: str | None = None
) -> bytes | None:
    """The key of a request's prompt: its first ``chars`` characters, as the engine sees them,
    after the name of the ``adapter`` it names (if any).

    A chat's messages in order (role and text of each, images and the like left out); a
    completion's prompt (the first one of a list); None when there is no text to key on
    (embeddings, or an empty prompt)."""
    parts: list[str] = []
    size = 0
    messages = payload.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if size >= chars:
                break
            if not isinstance(message, Mapping):
                continue
            text = _text_of(message.get("content"))
            part = f"{message.get('role')}\x00{text}\x00"
            parts.append(part)
            size += len(part)
    else:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            parts.append(prompt[:chars])
    if not parts:
        return None
    key = "".join(parts)[:chars].encode("utf-8", "surrogatepass")
    return key if adapter is None else adapter.encode() + b"\x00" + key


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones count
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    return ""
