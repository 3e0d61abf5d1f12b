"""Whether a commit changed what the endpoint lookup reads (SQLite).

The WAL index header (`service.core.wal_index`) tells `TargetCache` that
something committed; most commits are the records writer's (history,
statistics), which change no lookup's answer. Triggers (migration 0012) add
one to `target_generation.n` in the same transaction as every insert, update
or delete of a guild, script or endpoint row, whoever commits it. So when the
header moved, the cache reads the generation here: the same as at its
previous read means that no answer it remembers changed, and it keeps them.

The generation is `n` and the schema cookie (`schema_version`, which every
CREATE, DROP or ALTER moves), read in one statement (one snapshot) that also
counts the triggers. It vouches only when all of them exist as migration
0012 made them: the same name, on the same table, with the same statement
(so neither a table renamed away, which takes its triggers along, nor a
trigger made again under its name that no longer counts, passes for one);
and since any trigger dropped and created again moves the schema cookie, a
change made while one was missing never goes unseen. None (no table, a trigger missing,
an error) vouches for nothing: the cache drops its answers, as on every
commit without any of this.
"""
from __future__ import annotations

import importlib
import sqlite3

_MIGRATION = importlib.import_module("models.migrations.0012_target_generation")
TRIGGERS: tuple[str, ...] = _MIGRATION.TRIGGERS
_EXPECTED: tuple[str, ...] = tuple(v for definition in _MIGRATION.TRIGGER_DEFINITIONS
                                   for v in definition)

# One row, read to its end (no statement left open on the connection).
_READ = (f"SELECT n, (SELECT schema_version FROM pragma_schema_version), "
         f"(SELECT count(*) FROM sqlite_master WHERE type = 'trigger' "
         f"AND (name, tbl_name, sql) IN (VALUES {', '.join(['(?, ?, ?)'] * len(TRIGGERS))})) "
         f"FROM {_MIGRATION.TABLE} WHERE id = 1")


def generation(conn: sqlite3.Connection) -> tuple[int, int] | None:
    """(n, schema cookie) of ``conn``'s database now, or None when they cannot vouch."""
    try:
        rows = conn.execute(_READ, _EXPECTED).fetchall()
    except sqlite3.Error:
        return None
    if len(rows) != 1 or rows[0][2] != len(TRIGGERS):
        return None
    return int(rows[0][0]), int(rows[0][1])
