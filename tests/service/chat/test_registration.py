"""The registration JSON: the shapes the platform's protocol documents, printed by the CLI."""
from __future__ import annotations

import json
import re
import subprocess
from typing import Any

from service.chat import commands
from service.chat.commands import LOGIC, Group, registration
from tests.service.http.harness import LOGIC as LOGIC_BIN

NAME = re.compile(r"^[-_a-z0-9]{1,32}$")
SUB_COMMAND, SUB_COMMAND_GROUP, STRING = 1, 2, 3
OPTION_TYPES = set(range(1, 12))


def check_option(option: dict[str, Any], depth: int) -> None:
    assert set(option) <= {"type", "name", "description", "required", "options", "autocomplete"}
    assert option["type"] in OPTION_TYPES
    assert NAME.match(option["name"]), option["name"]
    assert 1 <= len(option["description"]) <= 100
    if option["type"] == SUB_COMMAND_GROUP:
        assert depth == 0, "a group only at the top level"
        assert 1 <= len(option["options"]) <= 25
        for inner in option["options"]:
            assert inner["type"] == SUB_COMMAND, "a group holds subcommands only"
            check_option(inner, depth + 1)
    elif option["type"] == SUB_COMMAND:
        assert "required" not in option
        assert len(option["options"]) <= 25
        names = [o["name"] for o in option["options"]]
        assert len(names) == len(set(names))
        required = [o.get("required", False) for o in option["options"]]
        assert required == sorted(required, reverse=True), "required options come first"
        for inner in option["options"]:
            assert inner["type"] not in (SUB_COMMAND, SUB_COMMAND_GROUP)
            check_option(inner, depth + 1)
    else:
        assert isinstance(option.get("required", False), bool)
        if option.get("autocomplete"):
            assert option["type"] == STRING


def test_registration_matches_the_protocol_shapes() -> None:
    body = registration()
    assert isinstance(body, list) and len(body) == 1
    command = body[0]
    assert command["type"] == 1  # CHAT_INPUT
    assert NAME.match(command["name"]) and 1 <= len(command["description"]) <= 100
    assert command["default_member_permissions"] == str(1 << 5)  # MANAGE_GUILD, a string
    assert command["contexts"] == [0]
    assert 1 <= len(command["options"]) <= 25
    first = {o["type"] for o in command["options"]}
    assert first <= {SUB_COMMAND, SUB_COMMAND_GROUP}, "subcommands cannot mix with plain options"
    for option in command["options"]:
        check_option(option, 0)
    total = len(json.dumps(body))
    assert total < 4000


def test_the_stable_names() -> None:
    command = registration()[0]
    groups = {o["name"]: o for o in command["options"]}
    assert set(groups) == {"script", "dashboard"}
    subs = {s["name"]: s for s in groups["script"]["options"]}
    assert list(subs) == ["list", "show", "enable", "disable", "secret", "whitelist", "history",
                          "stats"]
    assert subs["list"]["options"] == []
    for name in ("show", "enable", "disable", "secret", "history", "stats"):
        assert [(o["name"], o["required"], o.get("autocomplete")) for o in subs[name]["options"]] \
            == [("script", True, True)]
    assert [o["name"] for o in subs["whitelist"]["options"]] == ["script", "cidrs"]
    assert groups["dashboard"]["type"] == SUB_COMMAND and groups["dashboard"]["options"] == []


def test_dispatch_and_registration_come_from_one_table() -> None:
    command = registration()[0]
    for entry in command["options"]:
        leaves = entry["options"] if entry["type"] == SUB_COMMAND_GROUP else [entry]
        for leaf in leaves:
            path = ("logic", entry["name"], leaf["name"]) if leaf is not entry else ("logic", entry["name"])
            assert LOGIC.find(path) is not None, path
    assert LOGIC.find(("logic", "script")) is None
    assert LOGIC.find(("logic", "dashboard", "x")) is None


def test_secret_history_and_link_replies_are_declared_ephemeral() -> None:
    for path in (("logic", "script", "secret"), ("logic", "script", "history"),
                 ("logic", "dashboard")):
        found = LOGIC.find(path)
        assert found is not None and found.ephemeral, path
    leaves = [s for e in LOGIC.entries
              for s in (e.subcommands if isinstance(e, Group) else (e,))]
    public = {s.name for s in leaves if not s.ephemeral}
    assert public == {"enable", "disable"}
    assert commands.NOT_IN_GUILD.ephemeral


def test_cli_prints_the_body() -> None:
    out = subprocess.run([LOGIC_BIN, "chat", "commands", "--json"], capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout) == registration()
    text = subprocess.run([LOGIC_BIN, "chat", "commands"], capture_output=True, text=True,
                          check=True).stdout
    assert "/logic script whitelist script: cidrs:" in text and "/logic dashboard" in text
