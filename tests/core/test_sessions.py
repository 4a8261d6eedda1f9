"""core.sessions: the status pages' session book against a model of it, on any sequence of
logins, checks, logouts and clock steps."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from llmgw.core.sessions import SessionBook, session_digest

LIFETIME = 100.0
MAX = 4
IDS = st.sampled_from([f"s{i}" for i in range(8)])


class SessionBookMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.book = SessionBook(lifetime=LIFETIME, max_sessions=MAX)
        self.now = 0.0
        self.model: dict[str, float] = {}  # id -> expiry, in login order

    def _prune(self) -> None:
        self.model = {i: t for i, t in self.model.items() if self.now < t}

    @rule(session=IDS)
    def login(self, session):
        expires = self.book.open(session_digest(session), self.now)
        assert expires == self.now + LIFETIME
        self._prune()
        self.model.pop(session, None)
        while len(self.model) >= MAX:
            del self.model[next(iter(self.model))]  # the oldest goes
        self.model[session] = expires

    @rule(session=IDS)
    def check(self, session):
        expected = session in self.model and self.now < self.model[session]
        assert self.book.valid(session_digest(session), self.now) == expected

    @rule(session=IDS)
    def logout(self, session):
        self.book.close(session_digest(session))
        self.model.pop(session, None)

    @rule(step=st.floats(min_value=0, max_value=LIFETIME * 1.5))
    def wait(self, step):
        self.now += step

    @invariant()
    def bounded(self):
        assert len(self.book) <= MAX


TestSessionBook = SessionBookMachine.TestCase


def test_a_session_is_valid_until_its_expiry_and_not_at_it():
    book = SessionBook(lifetime=10.0)
    digest = session_digest("abc")
    book.open(digest, 100.0)
    assert book.valid(digest, 109.999)
    assert not book.valid(digest, 110.0)
    assert len(book) == 0  # an expired session is forgotten when found


def test_no_cookie_and_unknown_cookies_are_no_session():
    book = SessionBook()
    book.open(session_digest("real"), 0.0)
    assert not book.valid(None, 1.0)
    assert not book.valid(session_digest("guess"), 1.0)


def test_the_digest_is_sha256_of_the_id_not_the_id():
    digest = session_digest("abc")
    assert len(digest) == 32 and b"abc" not in digest


@pytest.mark.parametrize(
    ("field", "kwargs"), [("lifetime", {"lifetime": 0}), ("max_sessions", {"max_sessions": 0})]
)
def test_bad_settings_are_refused_by_name(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SessionBook(**kwargs)
