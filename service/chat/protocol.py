"""The platform's interactions protocol: its numbers, the parsed request, the replies.

Discord's public Interactions protocol is the reference.  An interaction is a
JSON object with `type` (1 PING, 2 APPLICATION_COMMAND, 4 AUTOCOMPLETE),
`data` (the command: `name` and nested `options`), `guild_id` and `member`
(`member.user.id`) when sent from a guild, `user` when sent from a direct
message, `application_id` and `token` (what a deferred reply is sent with).
A reply is `{"type": N, "data": {...}}`: 1 PONG, 4 a message, 5 a deferred
message, 8 autocomplete choices; message flag 64 makes it ephemeral (only
the member who asked sees it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Interaction types.
PING = 1
APPLICATION_COMMAND = 2
AUTOCOMPLETE = 4

# Response types.
PONG = 1
CHANNEL_MESSAGE_WITH_SOURCE = 4
DEFERRED_CHANNEL_MESSAGE_WITH_SOURCE = 5
AUTOCOMPLETE_RESULT = 8

# Message flags.
EPHEMERAL = 64
#: No link previews: a script name shaped like a URL posted in the channel
#: under the application's name got a preview card (review, session 25).
SUPPRESS_EMBEDS = 4

# Option types.
SUB_COMMAND = 1
SUB_COMMAND_GROUP = 2
STRING = 3

# Application command type CHAT_INPUT (a slash command).
CHAT_INPUT = 1

#: Longest message content the platform accepts.
MAX_CONTENT = 2000
#: Most autocomplete choices in one reply; a choice's name and value are 1-100 characters.
MAX_CHOICES = 25
MAX_CHOICE_CHARS = 100

_SNOWFLAKE = re.compile(r"[0-9]{1,25}")
#: An interaction token: one path segment of the follow-up URL, never "." or ".."
#: (a proxy that normalises the path would resolve those upwards).
_TOKEN = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9._-]{1,1000}")


class InteractionError(ValueError):
    """The body is JSON but not an interaction this service can read."""


@dataclass(frozen=True)
class Interaction:
    """The parts of an interaction the service uses."""

    type: int
    id: str
    application_id: str
    token: str = field(repr=False)      # a credential for the follow-up: never logged
    guild_id: str | None
    user_id: str | None
    path: tuple[str, ...]               # ("script", "show") or ("dashboard",)
    options: dict[str, str]             # the leaf's string options by name
    focused: str | None                 # the option being typed (autocomplete)


def _leaf(options: Any, path: list[str]) -> tuple[list[Any], tuple[str, ...]]:
    """Walk subcommand groups and subcommands down to the leaf's own options."""
    if not isinstance(options, list):
        return [], tuple(path)
    for option in options:
        if isinstance(option, dict) and option.get("type") in (SUB_COMMAND_GROUP, SUB_COMMAND):
            name = option.get("name")
            if not isinstance(name, str):
                raise InteractionError("option without a name")
            return _leaf(option.get("options", []), path + [name])
    return options, tuple(path)


def parse(payload: Any) -> Interaction:
    """Read an interaction from its decoded JSON.  Raises `InteractionError`."""
    if not isinstance(payload, dict) or not isinstance(payload.get("type"), int):
        raise InteractionError("not an interaction object")
    kind = payload["type"]
    raw_data = payload.get("data")
    data: dict[str, Any] = raw_data if isinstance(raw_data, dict) else {}
    guild_id = payload.get("guild_id")
    if guild_id is not None and not (isinstance(guild_id, str) and _SNOWFLAKE.fullmatch(guild_id)):
        raise InteractionError("guild_id is not a snowflake")
    member = payload.get("member")
    user: Any = member.get("user") if isinstance(member, dict) else payload.get("user")
    user_id = user.get("id") if isinstance(user, dict) else None
    if user_id is not None and not isinstance(user_id, str):
        raise InteractionError("user id is not a string")
    app_id, token = payload.get("application_id", ""), payload.get("token", "")
    interaction_id = payload.get("id", "")
    if kind != PING and not (isinstance(interaction_id, str) and _SNOWFLAKE.fullmatch(interaction_id)
                             and isinstance(app_id, str) and _SNOWFLAKE.fullmatch(app_id)
                             and isinstance(token, str) and _TOKEN.fullmatch(token)):
        raise InteractionError("id, application_id or token missing or malformed")
    leaf, path = _leaf(data.get("options", []), [])
    options: dict[str, str] = {}
    focused = None
    for option in leaf:
        if not isinstance(option, dict) or not isinstance(option.get("name"), str):
            raise InteractionError("malformed option")
        value = option.get("value", "")
        options[option["name"]] = value if isinstance(value, str) else str(value)
        if option.get("focused") is True:
            focused = option["name"]
    command = data.get("name")
    if kind != PING and command is not None and not isinstance(command, str):
        raise InteractionError("command name is not a string")
    return Interaction(type=kind, id=str(interaction_id), application_id=str(app_id),
                       token=str(token), guild_id=guild_id if member is not None else None,
                       user_id=user_id, path=((command or ""),) + path if kind != PING else (),
                       options=options, focused=focused)


def pong() -> dict[str, Any]:
    return {"type": PONG}


def message_data(content: str, ephemeral: bool) -> dict[str, Any]:
    """A message's `data`: content cut to the platform's limit, no mentions resolved
    (a script name such as "@everyone" must not ping anyone)."""
    if len(content) > MAX_CONTENT:
        content = content[: MAX_CONTENT - 1] + "…"
    data: dict[str, Any] = {"content": content, "allowed_mentions": {"parse": []},
                            "flags": EPHEMERAL if ephemeral else SUPPRESS_EMBEDS}
    return data


def message(content: str, ephemeral: bool) -> dict[str, Any]:
    return {"type": CHANNEL_MESSAGE_WITH_SOURCE, "data": message_data(content, ephemeral)}


def deferred(ephemeral: bool) -> dict[str, Any]:
    return {"type": DEFERRED_CHANNEL_MESSAGE_WITH_SOURCE,
            "data": {"flags": EPHEMERAL} if ephemeral else {}}


def choices(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Autocomplete choices (name shown, value sent), within the platform's limits."""
    out = [{"name": name[:MAX_CHOICE_CHARS], "value": value[:MAX_CHOICE_CHARS]}
           for name, value in pairs[:MAX_CHOICES] if name and value]
    return {"type": AUTOCOMPLETE_RESULT, "data": {"choices": out}}
