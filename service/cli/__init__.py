"""The `logic` command line: one module per command group, all over `service.core`.

`base` holds the click group, the shared options and output helpers; each
other module attaches its commands to that group when imported.  Only this
package's `__init__` imports them, so no module imports another back.
"""
from service.cli import chat, db, endpoints, guilds, reads, scripts, serve, tokens  # noqa: F401  (registers)
from service.cli.base import cli, main

__all__ = ["cli", "main"]
