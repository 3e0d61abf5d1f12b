"""Read-check-write rules of the service layer under PostgreSQL's READ COMMITTED.

Two transactions can both read a row, both pass a check and both write, unless
the second one waits for the first before it reads. The service takes the
guild's row lock for that (`get_guild(lock=True)`). These tests make the race
happen every time: a third connection holds a row the writes need, both
calls are made to wait for it (seen in `pg_locks`), then it is released. On
SQLite a write transaction takes the database's write lock at its start, so
the same calls cannot interleave there (the tests for the rules themselves run
on both backends).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from peewee import Database

from models import Endpoint, Script, ScriptVersion, database
from models.db import connect, open_database
from service import core
from service.core.invoke_target import load_target
from service.core.secrets import verify_secret
from service.plans import DEFAULT_PLANS
from tests.dbsupport import truncate_all
from tests.factories import OWNER, make_guild, make_script
from tests.service.http.harness import wait_until


@pytest.fixture
def pg(pg_migrated: str) -> Iterator[str]:
    """The model proxy bound to a migrated PostgreSQL schema; yields its URL."""
    from service.core.records import reset_sweeps
    reset_sweeps()
    handle = connect(pg_migrated)
    truncate_all(handle)
    yield pg_migrated
    handle.close()
    database.initialize(None)


class Call(threading.Thread):
    """A service-layer call on a connection of its own; `pid` is its backend."""

    def __init__(self, call: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.call = call
        self.pid = 0
        self.ready = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.pid = database.execute_sql("SELECT pg_backend_pid()").fetchone()[0]
            self.ready.set()
            self.result = self.call()
        except BaseException as err:  # noqa: BLE001 - the outcome is what the test reads
            self.error = err
        finally:
            self.ready.set()
            database.close()


def _waiting(locker: Database, call: Call) -> bool:
    row = locker.execute_sql("SELECT count(*) FROM pg_locks WHERE NOT granted AND pid = %s",
                             (call.pid,)).fetchone()
    return bool(row[0])


def _start_waiting(locker: Database, call: Call) -> None:
    call.start()
    assert call.ready.wait(20)
    assert wait_until(lambda: _waiting(locker, call) or not call.is_alive(), timeout=30)
    assert call.is_alive(), call.error     # it waits for a lock


def _behind_a_delete(pg: str, gid: str, sid: str, change: Callable[[], Any]) -> tuple[Call, Call]:
    """The script's delete, holding the guild and waiting for the script's row
    (held by a third connection), then `change` started behind it; both run
    once the row is released. Returns (delete, change), both ended."""
    locker = open_database(pg)
    locker.connect()
    try:
        with locker.atomic():
            locker.execute_sql(f'SELECT id FROM "{Script._meta.table_name}" WHERE public_id = %s '
                               "FOR UPDATE", (sid,))
            delete = Call(lambda: core.delete_script(OWNER, gid, sid))
            _start_waiting(locker, delete)
            other = Call(change)
            _start_waiting(locker, other)
    finally:
        locker.close()
    delete.join(30)
    other.join(30)
    return delete, other


def test_two_forms_replacing_the_same_secret_at_once_give_one_secret(pg: str) -> None:
    # Red team, session 35: both were answered with a new secret, and the one
    # shown first was dead at once (a double submit, two front processes).
    gid = make_guild()
    sid = make_script(gid)
    core.regenerate_secret(OWNER, gid, sid, replaces="none")
    shown = core.show_endpoint(OWNER, gid, sid)["secret"]
    seen = f"{shown['createdAt']}/{shown['hint']}"
    locker = open_database(pg)
    locker.connect()
    try:
        with locker.atomic():
            locker.execute_sql(f'SELECT id FROM "{Endpoint._meta.table_name}" WHERE script_id = '
                               f'(SELECT id FROM "{Script._meta.table_name}" WHERE public_id = %s) '
                               "FOR UPDATE", (sid,))
            calls = [Call(lambda: core.regenerate_secret(OWNER, gid, sid, replaces=seen))
                     for _ in range(2)]
            for call in calls:
                _start_waiting(locker, call)
    finally:
        locker.close()
    for call in calls:
        call.join(30)
    answered = [c.result for c in calls if c.error is None]
    refused = [c.error for c in calls if c.error is not None]
    count = len(answered)               # counted first: a failure never prints a secret
    assert count == 1, refused
    assert isinstance(refused[0], core.ConflictError) and refused[0].code == "secret_changed"
    target = load_target(gid, sid, DEFAULT_PLANS)
    assert target is not None and verify_secret(target.secret_hash, answered[0]["secret"])


def test_a_save_racing_a_delete_never_writes_into_the_tombstone(pg: str) -> None:
    # Red team, session 35: the save was answered "saved", its source written
    # into the deleted script's row and a version of it kept.
    gid = make_guild()
    sid = make_script(gid)
    delete, save = _behind_a_delete(pg, gid, sid, lambda: core.update_script(
        OWNER, gid, sid, "on endpoint(event):\n    event.reply('SAVED-IN-RACE')\n"))
    assert delete.error is None and delete.result["deleted"] is True, delete.error
    assert isinstance(save.error, core.NotFoundError), save.error
    row = Script.get(Script.public_id == sid)
    assert row.deleted_at is not None and row.source == ""
    assert not ScriptVersion.select().where(ScriptVersion.script == row.id).exists()


def test_an_endpoint_switched_on_while_its_script_is_deleted_stays_off(pg: str) -> None:
    gid = make_guild()
    sid = make_script(gid)
    delete, enable = _behind_a_delete(pg, gid, sid, lambda: core.enable_endpoint(OWNER, gid, sid))
    assert delete.error is None, delete.error
    assert isinstance(enable.error, core.NotFoundError), enable.error
    row = Script.get(Script.public_id == sid)
    assert not Endpoint.get(Endpoint.script == row.id).enabled
