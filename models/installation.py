"""The installation's id: one random id per database (per schema on PostgreSQL).

Made by migration 0014. Whatever every node of one installation shares
outside the database is named after it — the rate-limit windows in a shared
Redis (`service.http.redis_windows`) — so two installations using one Redis
server keep apart.
"""
from __future__ import annotations

import secrets

from peewee import CharField

from models.db import BaseModel


class Installation(BaseModel):
    """The one row: this installation's id."""

    id = CharField(max_length=16, primary_key=True)

    class Meta:
        table_name = "installation"


def installation_id() -> str:
    """This database's installation id (made now if its row is missing)."""
    row = Installation.select().order_by(Installation.id).first()
    if row is None:
        Installation.insert(id=secrets.token_hex(8)).on_conflict_ignore().execute()
        row = Installation.select().order_by(Installation.id).first()
    return str(row.id)


def renew_installation_id() -> str:
    """Replace the id (a restored copy of another installation's database)."""
    from models.db import database
    new = secrets.token_hex(8)
    with database.atomic():
        Installation.delete().execute()
        Installation.insert(id=new).execute()
    return new
