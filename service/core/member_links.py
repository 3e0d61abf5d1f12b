"""Login links members ask for themselves (the chat command's `/logic dashboard`).

Rule: a user who owns or manages a guild may get a one-time dashboard login
link for themselves, asked from within that guild.  The link is made by
`service.core.tokens.create_login_link` (the operator's function) once this
rule has allowed it; the audit record names the member and the guild, not
the operator.  The operator has `logic login-link` and gets nothing here.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from service.core.access import Actor, Role, get_guild, require_role
from service.core.errors import PermissionDeniedError
from service.core.tokens import LOGIN_TOKEN_TTL, create_login_link


def member_login_link(actor: Actor, guild_id: str, base_url: str,
                      ttl: timedelta = LOGIN_TOKEN_TTL) -> dict[str, Any]:
    """`{"url", "userId", "expiresAt"}`: a one-time link for the acting user.
    Raises `PermissionDeniedError` (operator, stranger), `NotFoundError`
    (`guild_not_found`), `ValidationError`."""
    if actor.is_operator or actor.user_id is None:
        raise PermissionDeniedError("the operator uses `logic login-link USER_ID` instead")
    guild = get_guild(guild_id)
    require_role(actor, guild, (Role.OWNER, Role.MANAGER), "open the dashboard")
    return create_login_link(Actor.operator(), actor.user_id, base_url, ttl,
                             audit_as=actor, guild_id=guild.id)
