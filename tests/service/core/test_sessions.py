"""Dashboard sessions: login by one-time link, idle and absolute timeouts, logout,
the operator ending a user's sessions, session-bound XSRF tokens."""
from __future__ import annotations

from datetime import timedelta

import pytest

from models import AuditRecord, DashboardSession
from models.clock import utcnow
from service import core
from service.core import sessions
from tests.factories import OPERATOR, OWNER

IDLE, ABSOLUTE = timedelta(minutes=30), timedelta(hours=8)


def link(user: str = "100", ttl: timedelta | None = None) -> str:
    kw = {"ttl": ttl} if ttl is not None else {}
    return str(core.create_login_link(OPERATOR, user, "http://x", **kw)["url"].rsplit("/", 1)[1])


def test_a_link_logs_in_once_and_only_the_hash_is_stored(db):
    token = link()
    cookie, session = sessions.login(token, absolute=ABSOLUTE)
    assert session.user_id == "100" and session.actor == core.Actor.user("100")
    assert cookie not in [r.token_hash for r in DashboardSession.select()]
    assert sessions.resume(cookie, idle=IDLE) == session
    with pytest.raises(core.NotFoundError) as err:
        sessions.login(token, absolute=ABSOLUTE)          # used
    assert err.value.code == "invalid_login_token"
    with pytest.raises(core.NotFoundError):
        sessions.login(link(ttl=timedelta(seconds=-1)), absolute=ABSOLUTE)   # expired
    assert sessions.resume("nope", idle=IDLE) is None and sessions.resume("", idle=IDLE) is None


def test_idle_timeout_ends_a_session_and_use_keeps_it_alive(db):
    t0 = utcnow()
    cookie, _ = sessions.login(link(), absolute=ABSOLUTE, now=t0)
    # Used every 20 minutes: alive past the 30-minute idle timeout.
    for minutes in (20, 40, 60):
        assert sessions.resume(cookie, idle=IDLE, now=t0 + timedelta(minutes=minutes))
    assert sessions.resume(cookie, idle=IDLE, now=t0 + timedelta(minutes=91)) is None
    row = DashboardSession.get()
    assert row.end_reason == "idle"
    # Ended for good, even if asked at an earlier time again.
    assert sessions.resume(cookie, idle=IDLE, now=t0 + timedelta(minutes=61)) is None


def test_absolute_timeout_ends_a_session_in_use(db):
    t0 = utcnow()
    cookie, _ = sessions.login(link(), absolute=ABSOLUTE, now=t0)
    step = timedelta(minutes=10)
    now = t0
    while now + step < t0 + ABSOLUTE:
        now += step
        assert sessions.resume(cookie, idle=IDLE, now=now) is not None
    assert sessions.resume(cookie, idle=IDLE, now=t0 + ABSOLUTE) is None
    assert DashboardSession.get().end_reason == "expired"


def test_logout_ends_only_that_session(db):
    a, _ = sessions.login(link(), absolute=ABSOLUTE)
    b, _ = sessions.login(link(), absolute=ABSOLUTE)
    assert sessions.end_session(a) is True and sessions.end_session(a) is False
    assert sessions.resume(a, idle=IDLE) is None and sessions.resume(b, idle=IDLE) is not None


def test_the_operator_ends_every_session_of_a_user(db):
    mine = [sessions.login(link("100"), absolute=ABSOLUTE)[0] for _ in range(3)]
    other, _ = sessions.login(link("200"), absolute=ABSOLUTE)
    with pytest.raises(core.PermissionDeniedError):
        sessions.end_user_sessions(OWNER, "100")
    assert sessions.live_sessions(OPERATOR, "100", idle=IDLE) == 3
    assert sessions.end_user_sessions(OPERATOR, "100") == 3
    assert all(sessions.resume(c, idle=IDLE) is None for c in mine)
    assert sessions.resume(other, idle=IDLE) is not None
    assert sessions.live_sessions(OPERATOR, "100", idle=IDLE) == 0
    assert AuditRecord.select().where(AuditRecord.action == "sessions.ended").count() == 1


def test_ending_a_users_sessions_spends_the_links_not_yet_used(db):
    """Outside review, session 21: an operator ends a user's sessions after a
    compromise; a login link sent to that user earlier and leaked must not
    log the attacker back in (another user's links keep working)."""
    leaked, theirs = link("100"), link("200")
    assert sessions.end_user_sessions(OPERATOR, "100") == 0
    with pytest.raises(core.NotFoundError) as err:
        sessions.login(leaked, absolute=ABSOLUTE)
    assert err.value.code == "invalid_login_token"
    assert sessions.live_sessions(OPERATOR, "100", idle=IDLE) == 0
    assert sessions.login(theirs, absolute=ABSOLUTE)[1].user_id == "200"
    # A link made after the sessions were ended works as usual.
    assert sessions.login(link("100"), absolute=ABSOLUTE)[1].user_id == "100"


def test_xsrf_tokens_are_bound_to_the_session_and_the_key():
    key = "k" * 40
    good = sessions.xsrf_token(key, "session-a")
    assert sessions.check_xsrf(key, "session-a", good)
    assert not sessions.check_xsrf(key, "session-b", good)
    assert not sessions.check_xsrf("j" * 40, "session-a", good)
    assert not sessions.check_xsrf(key, "session-a", None)
    assert not sessions.check_xsrf(key, "session-a", good[:-1] + "0" if good[-1] != "0" else good[:-1] + "1")
