"""Giving up on a thread's PostgreSQL statements (`models.db_watch`), against a
private cluster the test pauses (`tests/service/http/private_servers.py`; the
shared server is never touched). Skipped, saying why, only when the server
binaries are missing."""
from __future__ import annotations

import threading
from typing import Any

import pytest

from models.db import open_database
from models.db_watch import DeadlineWatch
from tests.service.http.private_servers import PrivatePostgres


def test_a_commit_is_never_given_up_on_so_a_batch_is_never_written_twice() -> None:
    # Review, session 34: the records writer's deadline gave up on a COMMIT the
    # stalled server had already received; the batch, retried, was then
    # written twice. A COMMIT now waits for its answer; statements before it
    # are still given up on.
    pg = PrivatePostgres()
    reason = pg.missing()
    if reason:
        pytest.skip(reason)
    pg.init().start()
    try:
        db = open_database(pg.url)
        db.execute_sql("CREATE TABLE t (x int)")
        db.close()
        out: dict[str, Any] = {}

        def writer() -> None:
            watch = DeadlineWatch(0.5, 5.0)
            db.watch_thread(watch)
            db.connect(reuse_if_open=True)
            try:
                with db.atomic():
                    db.execute_sql("INSERT INTO t VALUES (1)")
                    pg.pause()                       # stalls as the COMMIT goes out
                    threading.Timer(2.0, pg.resume).start()
            except Exception as err:  # noqa: BLE001 - what the writer would see
                out["error"] = repr(err)[:200]
            out["gave_up"] = watch.gave_up
            try:
                db.execute_sql("SELECT pg_sleep(2)")  # not a COMMIT: given up on
            except Exception as err:  # noqa: BLE001
                out["sleep"] = type(err).__name__
            out["gave_up_after"] = watch.gave_up
            db.close()
            watch.close()

        thread = threading.Thread(target=writer)
        thread.start()
        thread.join(30)
        assert not thread.is_alive()
        assert "error" not in out and out["gave_up"] == 0, out
        assert out["sleep"] == "StatementTimedOut" and out["gave_up_after"] == 1, out
        check = open_database(pg.url)
        assert check.execute_sql("SELECT count(*) FROM t").fetchone()[0] == 1
        check.close()
    finally:
        pg.resume()
        pg.cleanup()
