"""0009: change notifications on channels of this schema's own.

Migration 0004's trigger notified `logic_targets`, one channel for the whole
database: installations in different schemas of one database (`search_path`)
emptied each other's endpoint caches on every change.  The trigger now also
notifies `logic_targets_<16 hex digits>`, the start of the SHA-256 of the
schema that holds the changed table (`models.change_feed.SUFFIX_SQL` names it
with the same expression), which is the only targets channel this release
listens to.  The unscoped notification stays for nodes of the release before,
until they are replaced; reverting this migration keeps both (nodes of this
release may still be serving while the schema is downgraded).  SQLite needs
nothing.
"""
from __future__ import annotations

from peewee import Database, PostgresqlDatabase

CHANNEL = "logic_targets"

_SCOPED = f"""
CREATE OR REPLACE FUNCTION logic_notify_targets() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('{CHANNEL}_' || left(encode(sha256(convert_to(TG_TABLE_SCHEMA::text,
                                                                    'UTF8')), 'hex'), 16),
                      TG_TABLE_NAME);
    PERFORM pg_notify('{CHANNEL}', TG_TABLE_NAME);
    RETURN NULL;
END
$$ LANGUAGE plpgsql
"""


def up(db: Database) -> None:
    if isinstance(db, PostgresqlDatabase):
        db.execute_sql(_SCOPED)  # type: ignore[no-untyped-call]


def down(db: Database) -> None:
    """Leaves the trigger notifying both channels: a downgrade runs while nodes
    of this release may still serve, and they listen only to the scoped one
    (the release before ignores it).  0004's `down` drops the function."""
