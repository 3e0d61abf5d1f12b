"""A slow admin API call never delays invocations: service-layer calls run in the
API's thread pool, off the event loop."""
from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.service.api.conftest import Api
from tests.service.http.harness import wait_until


def test_a_blocked_stats_query_does_not_hold_up_invocations(server, world, http_env) -> None:
    if not http_env.database_url.startswith("postgres"):
        pytest.skip("needs a lock that blocks readers: PostgreSQL's LOCK TABLE (SQLite "
                    "readers in WAL mode are never blocked)")
    from models.db import open_database
    w = world()
    path = w.script_path
    w.owner("PATCH", path + "/endpoint", {"enabled": True})
    secret = w.owner("POST", path + "/endpoint/secret").json["secret"]
    invoke = f"/endpoints/{w.guild_id}/{w.script_id}"
    assert server.request(invoke, json_body={}, secret=secret).status == 200

    locker = open_database(http_env.database_url)
    locker.connect()
    result: dict[str, Any] = {}
    try:
        with locker.atomic():
            # The statistics table is locked: a stats read waits for it (a slow query).
            locker.execute_sql("LOCK TABLE stat_bucket IN ACCESS EXCLUSIVE MODE")
            slow = threading.Thread(target=lambda: result.update(
                resp=Api(server, w.manager.token)("GET", path + "/stats")))
            slow.start()
            waiting = ("SELECT count(*) FROM pg_locks WHERE NOT granted "
                       "AND relation = 'stat_bucket'::regclass")
            assert wait_until(lambda: locker.execute_sql(waiting).fetchone()[0] >= 1, timeout=20)
            # While it waits, invocations (and other API calls) are answered.
            for i in range(20):
                resp = server.request(invoke, json_body={"i": i}, secret=secret, timeout=10)
                assert resp.status == 200
            assert w.manager("GET", path).status == 200
            assert slow.is_alive() and "resp" not in result   # still blocked
    finally:
        locker.close()
    slow.join(30)
    assert result["resp"].status == 200
    # The records writer waited for the lock too; nothing was lost.
    assert wait_until(lambda: w.manager("GET", path + "/stats").json["total"] == 21, timeout=20)
