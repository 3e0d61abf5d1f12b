"""0014: the installation's id (`models.installation`), one random row.  Additive:
nodes of the release before do not read it.  Frozen copy."""
from __future__ import annotations

import secrets

from peewee import CharField, Database, Model


class Installation(Model):
    id = CharField(max_length=16, primary_key=True)

    class Meta:
        table_name = "installation"


NEW = [Installation]


def up(db: Database) -> None:
    with db.bind_ctx(NEW):
        db.create_tables(NEW, safe=False)
        Installation.insert(id=secrets.token_hex(8)).execute()


def down(db: Database) -> None:
    with db.bind_ctx(NEW):
        db.drop_tables(list(reversed(NEW)), safe=False)
