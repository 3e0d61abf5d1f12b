"""The command table: what `/logic` offers, what it dispatches to, what is registered.

One table (`LOGIC`) both dispatches interactions and produces the
registration JSON (`registration()`, printed by `logic chat commands --json`),
so the names a member types and the names the service reads cannot drift.
The names are stable: `/logic script list|show|enable|disable|secret|
whitelist|history|stats` (group `script`, option `script`, `whitelist` also
`cidrs`) and `/logic dashboard`.

Each subcommand declares whether its successful reply is ephemeral (flag
64: only the member who asked sees it).  Every reply carrying a secret,
history or a link is; so is every refusal or error.  Only `enable` and
`disable` answer in the channel, so the server's other managers see the
switch (the message holds the script's name and ID, nothing secret).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from service.chat import subcommands as sub
from service.chat.protocol import CHAT_INPUT, STRING, SUB_COMMAND, SUB_COMMAND_GROUP
from service.chat.subcommands import Call
from service.core.access import is_registered
from service.core.errors import (CoreError, NotFoundError, PermissionDeniedError, QuotaError)

log = logging.getLogger("logic.chat")

#: Members need the platform's MANAGE_GUILD permission (bit 5) to see the command;
#: the service still decides who may do what (owner, manager).
MANAGE_GUILD = 1 << 5
#: Interaction contexts: 0 = in a guild (not in direct messages).
GUILD_CONTEXT = 0


@dataclass(frozen=True)
class Option:
    name: str
    description: str
    required: bool = True
    autocomplete: bool = False

    def registration(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": STRING, "name": self.name,
                               "description": self.description, "required": self.required}
        if self.autocomplete:
            out["autocomplete"] = True
        return out


@dataclass(frozen=True)
class Subcommand:
    name: str
    description: str
    run: Callable[[Call], str]
    options: tuple[Option, ...] = ()
    ephemeral: bool = True

    def registration(self) -> dict[str, Any]:
        return {"type": SUB_COMMAND, "name": self.name, "description": self.description,
                "options": [o.registration() for o in self.options]}


@dataclass(frozen=True)
class Group:
    name: str
    description: str
    subcommands: tuple[Subcommand, ...]

    def registration(self) -> dict[str, Any]:
        return {"type": SUB_COMMAND_GROUP, "name": self.name, "description": self.description,
                "options": [s.registration() for s in self.subcommands]}


@dataclass(frozen=True)
class Command:
    name: str
    description: str
    entries: tuple[Group | Subcommand, ...]

    def registration(self) -> dict[str, Any]:
        return {"type": CHAT_INPUT, "name": self.name, "description": self.description,
                "default_member_permissions": str(MANAGE_GUILD), "contexts": [GUILD_CONTEXT],
                "options": [e.registration() for e in self.entries]}

    def find(self, path: tuple[str, ...]) -> Subcommand | None:
        """The subcommand at `("logic", "script", "show")`-like `path`, or None."""
        if len(path) < 2 or path[0] != self.name:
            return None
        for entry in self.entries:
            if entry.name != path[1]:
                continue
            if isinstance(entry, Subcommand):
                return entry if len(path) == 2 else None
            if len(path) == 3:
                return next((s for s in entry.subcommands if s.name == path[2]), None)
        return None


SCRIPT = Option("script", "Script name or logic_ ID", autocomplete=True)
CIDRS = Option("cidrs", "Allowed addresses, space-separated CIDRs; none clears the whitelist")

LOGIC = Command("logic", "Manage this server's Logic Endpoints", (
    Group("script", "A script's inbound HTTP endpoint", (
        Subcommand("list", "This server's scripts and whether their endpoints are on",
                   sub.script_list),
        Subcommand("show", "A script's endpoint: URL, on/off, secret hint, whitelist",
                   sub.script_show, (SCRIPT,)),
        Subcommand("enable", "Switch a script's endpoint on (within the plan's quota)",
                   sub.script_enable, (SCRIPT,), ephemeral=False),
        Subcommand("disable", "Switch a script's endpoint off", sub.script_disable, (SCRIPT,),
                   ephemeral=False),
        Subcommand("secret", "Create or regenerate the endpoint secret (owner only; shown once)",
                   sub.script_secret, (SCRIPT,)),
        Subcommand("whitelist", "Set the IP whitelist of a script's endpoint",
                   sub.script_whitelist, (SCRIPT, CIDRS)),
        Subcommand("history", "The last 5 requests to a script's endpoint", sub.script_history,
                   (SCRIPT,)),
        Subcommand("stats", "Request statistics of a script's endpoint", sub.script_stats,
                   (SCRIPT,)),
    )),
    Subcommand("dashboard", "A one-time login link to the Dashboard, for you only", sub.dashboard),
))


def registration() -> list[dict[str, Any]]:
    """The body of the platform's "bulk overwrite application commands" call."""
    return [LOGIC.registration()]


# ----------------------------------------------------------------- answers

@dataclass(frozen=True)
class Reply:
    content: str
    ephemeral: bool


NOT_IN_GUILD = Reply("Use /logic in a server: it manages that server's scripts.", True)


def refusal(err: CoreError, guild_id: str | None = None) -> str:
    """A service-layer refusal as a sentence for the member."""
    if err.code == "guild_not_found":
        # The service layer answers "not found" to anyone without a role, so
        # that a stranger learns nothing. A chat member is in the server by
        # the platform's signature: telling them it is registered is no leak.
        if guild_id is not None and is_registered(guild_id):
            return ("Not allowed: only the server's owner and its managers may use /logic. "
                    "The owner does everything and alone creates or regenerates "
                    "secrets; managers do the rest.")
        return ("This server is not registered with Logic Endpoints. The service's operator "
                "adds it (`logic guild create`).")
    if isinstance(err, PermissionDeniedError):
        return (f"Not allowed: {err.message}. The server's owner does everything and alone "
                "creates or regenerates secrets; managers do the rest.")
    if isinstance(err, QuotaError):
        return f"Refused by the plan: {err.message}."
    if isinstance(err, NotFoundError):
        return f"Not found: {err.message}."
    return f"Cannot do that: {err.message}."


def run(subcommand: Subcommand, call: Call) -> Reply:
    """Run one subcommand; a service-layer refusal becomes an ephemeral answer."""
    try:
        return Reply(subcommand.run(call), subcommand.ephemeral)
    except CoreError as err:
        return Reply(refusal(err, call.guild_id), True)


def unknown(path: tuple[str, ...]) -> Reply:
    shown = "/" + " ".join(p for p in path if p) if any(path) else "this command"
    return Reply(f"Unknown command {shown}. The commands may be out of date: the operator "
                 "registers them again from `logic chat commands --json`.", True)


def complete(subcommand: Subcommand, call: Call, focused: str | None) -> list[tuple[str, str]]:
    """Autocomplete choices for the focused option; none for a member the
    service layer refuses (a stranger learns no script names)."""
    if focused != SCRIPT.name or SCRIPT not in subcommand.options:
        return []
    try:
        return sub.suggest_scripts(call, call.options.get(focused, ""))
    except CoreError:
        return []
