"""Who is acting, and what their role in a guild allows (DESIGN section 7).

Roles: the guild **owner** may do everything; **managers** edit scripts,
switch endpoints, edit the whitelist and read history, errors and stats; the
**operator** (CLI without `--as`, or an operator token) manages guilds and
plans and may do what a manager does, but never creates or regenerates a
secret.  Anyone else is answered as if the guild did not exist.  Lookups
check the guild first, then the role, then the script, so a stranger learns
nothing about a guild or its scripts.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from models import Guild, GuildManager, Script
from models.db import is_postgres
from service.core.errors import NotFoundError, PermissionDeniedError, ValidationError

_GUILD_ID = re.compile(r"[0-9]{1,25}")
_USER_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SCRIPT_ID = re.compile(r"logic_[A-Za-z0-9_-]{22}")


class Role(enum.Enum):
    OWNER = "owner"
    MANAGER = "manager"
    OPERATOR = "operator"


#: The roles that may manage a guild's scripts and endpoints.
EDITORS = (Role.OWNER, Role.MANAGER, Role.OPERATOR)


@dataclass(frozen=True)
class Actor:
    """The one acting: a user (by platform ID) or, with `user_id` None, the operator.

    `via` names the front a user acted through when it is not the default
    (e.g. "chat" for the chat command); audit records carry it."""

    user_id: str | None = None
    via: str | None = None

    @classmethod
    def operator(cls) -> "Actor":
        return cls(None)

    @classmethod
    def user(cls, user_id: str, via: str | None = None) -> "Actor":
        return cls(validate_user_id(user_id), via)

    @property
    def is_operator(self) -> bool:
        return self.user_id is None

    @property
    def label(self) -> str:
        """How audit records name the actor."""
        return "operator" if self.user_id is None else f"user:{self.user_id}"


def validate_guild_id(guild_id: str) -> str:
    """Raises `ValidationError` unless the ID is 1-25 digits."""
    if not isinstance(guild_id, str) or not _GUILD_ID.fullmatch(guild_id):
        raise ValidationError(f"guild id {guild_id!r} must be 1-25 digits", code="invalid_guild_id")
    return guild_id


def validate_user_id(user_id: str) -> str:
    """Raises `ValidationError` unless the ID is 1-64 of A-Z a-z 0-9 _ . -."""
    if not isinstance(user_id, str) or not _USER_ID.fullmatch(user_id):
        shown = user_id if not isinstance(user_id, str) or len(user_id) <= 64 \
            else user_id[:61] + "..."
        raise ValidationError(f"user id {shown!r} must be 1-64 letters, digits, '_', '.' or '-'",
                              code="invalid_user_id")
    return user_id


def role_in(actor: Actor, guild: Guild) -> Role | None:
    """The actor's role in `guild`, or None."""
    if actor.is_operator:
        return Role.OPERATOR
    if actor.user_id == guild.owner_id:
        return Role.OWNER
    is_manager = (GuildManager.select(GuildManager.id)
                  .where((GuildManager.guild == guild.id) & (GuildManager.user_id == actor.user_id))
                  .exists())
    return Role.MANAGER if is_manager else None


def is_registered(guild_id: str) -> bool:
    """Whether the guild is known to the service, whoever asks.

    Only for a front whose caller already proves membership of the guild (the
    chat command: the platform signs that the member typed it there); every
    other front answers a guild the actor has no role in as not found."""
    return bool(Guild.select(Guild.id).where(Guild.id == validate_guild_id(guild_id)).exists())


def get_guild(guild_id: str, *, lock: bool = False) -> Guild:
    """The guild; raises `ValidationError` for a malformed ID, `NotFoundError`.

    `lock=True` (inside a transaction) takes the row lock on PostgreSQL so
    read-then-write rules such as quotas cannot race; SQLite transactions
    already hold the database write lock (`BEGIN IMMEDIATE`)."""
    validate_guild_id(guild_id)
    query = Guild.select().where(Guild.id == guild_id)
    if lock and is_postgres():
        query = query.for_update()
    guild: Guild | None = query.first()
    if guild is None:
        raise NotFoundError(f"guild {guild_id} not found", code="guild_not_found")
    return guild


def require_role(actor: Actor, guild: Guild, allowed: tuple[Role, ...], action: str) -> Role:
    """Return the actor's role; raises `PermissionDeniedError` unless it is in `allowed`.

    Someone with no role at all gets `NotFoundError` (`guild_not_found`), the
    very answer for a guild that does not exist: a stranger learns nothing,
    not even that the guild is registered."""
    role = role_in(actor, guild)
    if role is None:
        raise NotFoundError(f"guild {guild.id} not found", code="guild_not_found")
    if role not in allowed:
        who = "the operator" if actor.is_operator else f"user {actor.user_id}"
        raise PermissionDeniedError(f"{who} may not {action} in guild {guild.id}")
    return role


def get_script(guild: Guild, script_id: str) -> Script:
    """A live (not deleted) script of `guild`; raises `NotFoundError`."""
    if not isinstance(script_id, str) or not _SCRIPT_ID.fullmatch(script_id):
        raise NotFoundError(f"script {script_id!r} not found", code="script_not_found")
    script = Script.get_or_none((Script.public_id == script_id) & (Script.guild == guild.id)
                                & Script.deleted_at.is_null())
    if script is None:
        raise NotFoundError(f"script {script_id} not found in guild {guild.id}",
                            code="script_not_found")
    return script


def guild_and_script(actor: Actor, guild_id: str, script_id: str, action: str,
                     allowed: tuple[Role, ...] = EDITORS, *,
                     lock: bool = False) -> tuple[Guild, Script, Role]:
    """Guild, role check, then script: the common preamble of script actions
    (``lock``: the guild's row lock, see `get_guild`)."""
    guild = get_guild(guild_id, lock=lock)
    role = require_role(actor, guild, allowed, action)
    return guild, get_script(guild, script_id), role
