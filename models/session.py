"""Dashboard sessions: one row per login, keyed by the SHA-256 of its cookie token.

The cookie holds a 256-bit random token (signed by Tornado with the cookie
secret); the database holds only its hash, so a copy of the database cannot
be replayed as a cookie.  A session ends by logout, by the operator ending
all of a user's sessions, or by its idle and absolute timeouts.
"""
from __future__ import annotations

from peewee import AutoField, CharField, DateTimeField

from models.clock import utcnow
from models.db import BaseModel


class DashboardSession(BaseModel):
    """A logged-in dashboard user (never the operator)."""

    id = AutoField()
    token_hash = CharField(max_length=64, unique=True)
    user_id = CharField(max_length=64, index=True)
    created_at = DateTimeField(default=utcnow)
    last_seen_at = DateTimeField(default=utcnow)
    expires_at = DateTimeField()                 # absolute end, fixed at login
    ended_at = DateTimeField(null=True)
    end_reason = CharField(max_length=16, null=True)   # logout | revoked | idle | expired
