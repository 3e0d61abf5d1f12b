"""`logic chat commands`: the chat command's registration, printed for the operator.

The JSON is the body of the platform's "bulk overwrite application commands"
call (an array of command objects), generated from the same table that
dispatches interactions (`service.chat.commands`).  No database is opened.
"""
from __future__ import annotations

import json
from typing import Any

import click

from service.cli.base import cli, json_option


@cli.group()
def chat() -> None:
    """The chat command /logic (interactions endpoint)."""


def _tree(command: dict[str, Any]) -> str:
    lines = [f"/{command['name']}: {command['description']}"]
    for entry in command["options"]:
        inner = entry.get("options", [])
        if inner and all(o.get("type") in (1, 2) for o in inner):
            for leaf in inner:
                args = " ".join(f"{o['name']}:" for o in leaf.get("options", []))
                lines.append(f"  /{command['name']} {entry['name']} {leaf['name']} {args}".rstrip()
                             + f"  - {leaf['description']}")
        else:
            args = " ".join(f"{o['name']}:" for o in inner)
            lines.append(f"  /{command['name']} {entry['name']} {args}".rstrip()
                         + f"  - {entry['description']}")
    return "\n".join(lines)


@chat.command("commands")
@json_option
def chat_commands(as_json: bool) -> None:
    """Print the command definitions to register with the platform application.

    With --json: the exact request body (a JSON array) for the platform's
    bulk-overwrite-commands call; see docs/chat-command.md.
    """
    from service.chat.commands import registration

    body = registration()
    if as_json:
        click.echo(json.dumps(body, indent=2))
        return
    for command in body:
        click.echo(_tree(command))
    click.echo("Register them with: logic chat commands --json (see docs/chat-command.md)")
