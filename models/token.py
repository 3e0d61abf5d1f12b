"""API tokens and one-time login links, both stored as SHA-256 of the token.

The tokens are 256-bit random strings, so a fast hash is enough (nobody can
brute-force the preimage) and it allows an indexed lookup, which a salted
password hash would not.
"""
from __future__ import annotations

from peewee import AutoField, CharField, DateTimeField

from models.clock import utcnow
from models.db import BaseModel


class ApiToken(BaseModel):
    """A token for the admin API: acts as `user_id`, or as the operator."""

    id = AutoField()
    token_hash = CharField(max_length=64, unique=True)
    hint = CharField(max_length=4)
    kind = CharField(max_length=16)               # "user" | "operator"
    user_id = CharField(max_length=64, null=True)
    created_at = DateTimeField(default=utcnow)
    last_used_at = DateTimeField(null=True)
    revoked_at = DateTimeField(null=True)
    expires_at = DateTimeField(null=True)         # None: never expires


class LoginToken(BaseModel):
    """A one-time dashboard login link: expires, and works once."""

    id = AutoField()
    token_hash = CharField(max_length=64, unique=True)
    user_id = CharField(max_length=64)
    created_at = DateTimeField(default=utcnow)
    expires_at = DateTimeField()
    used_at = DateTimeField(null=True)
