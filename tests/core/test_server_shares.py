"""Quota shares across servers sharing one store (core/server_shares.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.quota import Limits
from llmgw.core.server_shares import ServerShare, share_of, split


def test_one_server_keeps_the_whole_limit():
    limits = Limits(rpm=7, tpm=100, tpd=None)
    assert share_of(limits, ServerShare()) == limits
    assert share_of(limits, ServerShare.of([], "a")) == limits


def test_rank_is_the_place_among_sorted_ids_and_me_counts():
    assert ServerShare.of(["b", "a"], "b") == ServerShare(servers=2, rank=1)
    assert ServerShare.of(["c"], "a") == ServerShare(servers=2, rank=0)


def test_a_limit_is_split_with_the_remainder_to_the_first_ranks():
    assert [split(7, ServerShare(3, r)) for r in range(3)] == [3, 2, 2]
    assert share_of(Limits(rpm=10, tpm=None), ServerShare(2, 1)) == Limits(rpm=5, tpm=None)


@given(limit=st.integers(1, 10_000), servers=st.integers(1, 16))
def test_shares_sum_to_the_limit_and_are_never_zero(limit, servers):
    shares = [split(limit, ServerShare(servers, rank)) for rank in range(servers)]
    assert all(s >= 1 for s in shares)
    assert sum(shares) == (servers if limit < servers else limit)
    assert max(shares) - min(shares) <= 1
