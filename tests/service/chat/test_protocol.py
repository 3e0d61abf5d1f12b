"""Reading interactions and shaping replies (`service.chat.protocol`)."""
from __future__ import annotations

from typing import Any

import pytest

from service.chat import protocol
from service.chat.protocol import InteractionError, parse

BASE: dict[str, Any] = {"id": "10", "application_id": "20", "token": "tok.en-_1", "type": 2}


def test_group_subcommand_and_focused_option() -> None:
    got = parse({**BASE, "type": 4, "guild_id": "30", "member": {"user": {"id": "40"}},
                 "data": {"name": "logic", "options": [{"type": 2, "name": "script", "options": [
                     {"type": 1, "name": "show", "options": [
                         {"type": 3, "name": "script", "value": "al", "focused": True}]}]}]}})
    assert (got.path, got.options, got.focused) == (("logic", "script", "show"), {"script": "al"},
                                                    "script")
    assert (got.guild_id, got.user_id) == ("30", "40")
    assert "tok" not in repr(got), "the token is a credential: not in reprs (logs)"


def test_direct_message_has_no_guild() -> None:
    got = parse({**BASE, "user": {"id": "40"}, "data": {"name": "logic", "options": [
        {"type": 1, "name": "dashboard", "options": []}]}})
    assert got.guild_id is None and got.user_id == "40" and got.path == ("logic", "dashboard")


@pytest.mark.parametrize("payload", [
    [], {"type": "2"}, {**BASE, "id": ""}, {**BASE, "token": "a/b"}, {**BASE, "application_id": 5},
    {**BASE, "token": "."}, {**BASE, "token": ".."},  # dot segments of the follow-up URL
    {**BASE, "guild_id": "x1", "member": {"user": {"id": "1"}}},
    {**BASE, "member": {"user": {"id": 1}}},
    {**BASE, "data": {"name": "logic", "options": [{"type": 1, "name": 5}]}},
    {**BASE, "data": {"name": "logic", "options": [{"type": 1, "name": "list", "options": [7]}]}},
    {**BASE, "data": {"name": 3}},
])
def test_malformed_interactions_are_refused(payload: Any) -> None:
    with pytest.raises(InteractionError):
        parse(payload)


def test_replies_respect_the_platform_limits() -> None:
    long = protocol.message("x" * 5000, ephemeral=True)
    assert len(long["data"]["content"]) == protocol.MAX_CONTENT and long["data"]["flags"] == 64
    # In the channel: no link previews (a script name shaped like a URL got a
    # preview card under the application's name: review, session 25).
    assert protocol.message("hi", ephemeral=False)["data"]["flags"] == protocol.SUPPRESS_EMBEDS
    many = protocol.choices([(f"n{i}" * 60, f"v{i}") for i in range(40)] + [("", "x")])
    assert len(many["data"]["choices"]) == 25
    assert all(len(c["name"]) <= 100 for c in many["data"]["choices"])
    assert protocol.deferred(True) == {"type": 5, "data": {"flags": 64}}
