"""Dashboard sessions: log in with a one-time link, resume, end one or all.

A login link (`service.core.tokens.create_login_link`) is consumed once and
starts a session: a 256-bit random token that the dashboard keeps in a
signed cookie; only its SHA-256 is stored.  A session ends:
- when unused for `idle` (the idle timeout), or `absolute` after its login
  (the absolute timeout), whatever its use;
- by logout (`end_session`);
- when the operator ends every session of a user (`end_user_sessions`).

Only users have sessions: login links are made for user IDs, so the
operator is never a dashboard user.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from models import DashboardSession, database
from models.clock import utcnow
from service.core import audit
from service.core.access import Actor, validate_user_id
from service.core.errors import PermissionDeniedError
from service.core.tokens import consume_login_token, login_link_user, spend_login_links

#: Writes of `last_seen_at` happen at most this often per session (a write per
#: page view is wasted work); the idle timeout is precise to this step.
TOUCH_EVERY = timedelta(seconds=30)
#: Ended or expired sessions are deleted this long after their end.
KEEP_ENDED = timedelta(days=7)


@dataclass(frozen=True)
class Session:
    """A live session: whose it is, and since when."""

    id: int
    user_id: str
    created_at: datetime
    expires_at: datetime

    @property
    def actor(self) -> Actor:
        return Actor.user(self.user_id)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def login(link_token: str, *, absolute: timedelta,
          now: datetime | None = None) -> tuple[str, Session]:
    """Consume a one-time login link and start a session; return the session
    token (for the cookie, never stored) and the session.  Raises
    `NotFoundError` (`invalid_login_token`) for an unknown, used or expired link."""
    token = secrets.token_urlsafe(32)
    now = now or utcnow()
    # One transaction: a login is either wholly before `end_user_sessions`
    # (its session is ended there) or wholly after (its link is spent there).
    with database.atomic():
        user_id = consume_login_token(link_token)
        DashboardSession.delete().where(
            DashboardSession.expires_at < now - KEEP_ENDED).execute()
        row = DashboardSession.create(token_hash=_digest(token), user_id=user_id, created_at=now,
                                      last_seen_at=now, expires_at=now + absolute)
    return token, Session(row.id, user_id, now, row.expires_at)


def link_user(link_token: str) -> str:
    """Whose session a login link would start, without using it (the dashboard
    asks before a link replaces a live session of another user).  Raises
    `NotFoundError` (`invalid_login_token`) for an unknown, used or expired link."""
    return login_link_user(link_token)


def resume(token: str, *, idle: timedelta, now: datetime | None = None) -> Session | None:
    """The live session of a cookie token, or None (unknown, ended, idle too
    long, past its absolute end).  Marks a timed-out session as ended."""
    if not token:
        return None
    now = now or utcnow()
    row = DashboardSession.get_or_none((DashboardSession.token_hash == _digest(token))
                                       & DashboardSession.ended_at.is_null())
    if row is None:
        return None
    reason = ("expired" if now >= row.expires_at
              else "idle" if now - row.last_seen_at >= idle else None)
    if reason is not None:
        (DashboardSession.update(ended_at=now, end_reason=reason)
         .where((DashboardSession.id == row.id) & DashboardSession.ended_at.is_null()).execute())
        return None
    if now - row.last_seen_at >= TOUCH_EVERY:
        DashboardSession.update(last_seen_at=now).where(DashboardSession.id == row.id).execute()
    return Session(row.id, row.user_id, row.created_at, row.expires_at)


def end_session(token: str, *, now: datetime | None = None) -> bool:
    """Log out: end the session of a cookie token.  True when one was live."""
    if not token:
        return False
    n = (DashboardSession.update(ended_at=now or utcnow(), end_reason="logout")
         .where((DashboardSession.token_hash == _digest(token))
                & DashboardSession.ended_at.is_null()).execute())
    return bool(n)


def end_user_sessions(actor: Actor, user_id: str, *, now: datetime | None = None) -> int:
    """End every live session of `user_id` and spend the login links not yet
    used (operator only); return how many sessions ended.
    Raises `PermissionDeniedError`, `ValidationError`."""
    if not actor.is_operator:
        raise PermissionDeniedError("only the operator may end a user's sessions")
    validate_user_id(user_id)
    now = now or utcnow()
    with database.atomic():
        # The links first: a login that consumed one meanwhile has committed its
        # session before this statement returns, and the next one ends it.
        links = spend_login_links(user_id, now)
        n = int(DashboardSession.update(ended_at=now, end_reason="revoked")
                .where((DashboardSession.user_id == user_id)
                       & DashboardSession.ended_at.is_null()).execute())
        audit.record(actor, "sessions.ended", user=user_id, count=n, links=links)
    return n


def live_sessions(actor: Actor, user_id: str, *, idle: timedelta,
                  now: datetime | None = None) -> int:
    """How many sessions of `user_id` are live (operator only).
    Raises `PermissionDeniedError`, `ValidationError`."""
    if not actor.is_operator:
        raise PermissionDeniedError("only the operator may list a user's sessions")
    validate_user_id(user_id)
    now = now or utcnow()
    return int(DashboardSession.select().where(
        (DashboardSession.user_id == user_id) & DashboardSession.ended_at.is_null()
        & (DashboardSession.expires_at > now)
        & (DashboardSession.last_seen_at > now - idle)).count())


def xsrf_token(key: str, session_token: str) -> str:
    """The XSRF token of a session: an HMAC of its token under the cookie
    secret, so a page of one session cannot forge a form of another, and a
    cookie set by a sibling domain cannot pair with a token of its choice."""
    return hmac.new(key.encode("utf-8"), b"xsrf:" + session_token.encode("utf-8"),
                    hashlib.sha256).hexdigest()


def check_xsrf(key: str, session_token: str, presented: str | None) -> bool:
    """True when `presented` is the session's XSRF token (constant time)."""
    if not presented or not session_token or not presented.isascii():
        return False   # compare_digest refuses non-ASCII text: a forged token, not a fault
    return hmac.compare_digest(xsrf_token(key, session_token), presented)
