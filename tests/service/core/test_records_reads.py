"""The record store and the reads over it, on SQLite and PostgreSQL."""
from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

import pytest

from models import ALL_MODELS, Endpoint, Script, StatBucket
from service import core
from service.core.invoke_target import load_target
from service.core.records import ErrorRecordIn, StatHit, write_batch
from tests.factories import MANAGER, OPERATOR, OWNER, make_guild, make_request, make_script

NOW = datetime.now(timezone.utc)


def _endpoint(gid: str, sid: str) -> int:
    target = load_target(gid, sid)
    assert target is not None
    return target.endpoint_id


@pytest.mark.parametrize("plan,keep", [("plus", 20), ("pro", 200)])
def test_retention_keeps_exactly_the_newest_n(db, plan, keep):
    gid = make_guild(plan)
    sid, other = make_script(gid), make_script(gid, "other")
    eid, other_eid = _endpoint(gid, sid), _endpoint(gid, other)
    total = keep + 37
    for start in range(0, total, 50):   # batches as the writer sends them
        write_batch([make_request(eid, n, keep=keep) for n in range(start, min(start + 50, total))]
                    + [make_request(other_eid, 0, keep=keep)])
    records = core.history(OWNER, gid, sid)["records"]
    assert [r["requestId"] for r in records] == [f"r{n}" for n in range(total - 1, total - keep - 1, -1)]
    assert len(core.history(OWNER, gid, other)["records"]) == min(keep, len(range(0, total, 50)))


def test_one_batch_larger_than_the_plan_keeps_exactly_the_newest_n(db):
    # Under load the writer sends batches of hundreds: only the newest `keep`
    # of each endpoint are written, and they are the right ones, in order.
    gid = make_guild("plus")
    sid, other = make_script(gid), make_script(gid, "other")
    eid, other_eid = _endpoint(gid, sid), _endpoint(gid, other)
    batch = []
    for n in range(120):
        batch.append(make_request(eid, n, keep=20))
        if n % 10 == 0:
            batch.append(make_request(other_eid, n, keep=20))
    write_batch(batch)
    records = core.history(OWNER, gid, sid)["records"]
    assert [r["requestId"] for r in records] == [f"r{n}" for n in range(119, 99, -1)]
    others = core.history(OWNER, gid, other)["records"]
    assert [r["requestId"] for r in others] == [f"r{n}" for n in range(110, -1, -10)]


def test_history_shape_caps_and_redaction(db):
    gid = make_guild("plus")
    sid = make_script(gid)
    eid = _endpoint(gid, sid)
    write_batch([
        make_request(eid, 1, headers={"Authorization": "Bearer x", "X-Service-Secret": "y",
                                      "Cookie": "a=b", "X-Ok": "1"},
                     body=b"a" * 9000, response_body=b"\xff\xfe\x00", output="o" * 9000),
    ])
    [record] = core.history(MANAGER, gid, sid)["records"]
    assert set(record) >= {"id", "time", "method", "status", "ip", "userAgent", "query", "headers",
                           "body", "responseBody", "durationMs", "output", "error"}
    assert record["headers"] == {"x-ok": "1"}
    assert record["bodyTruncated"] is True and len(record["body"]) == 8192
    assert record["responseBodyEncoding"] == "base64" and record["responseBody"] == "//4A"
    assert record["output"].endswith("[truncated]") and record["time"].endswith("Z")
    assert record["query"] == {"a": "1"} and record["durationMs"] == 3.5


def test_error_log_keeps_last_100_and_needs_the_plan(db):
    gid = make_guild("plus")
    sid = make_script(gid)
    eid = _endpoint(gid, sid)
    write_batch([ErrorRecordIn(eid, f"r{n}", NOW, "script_error", f"boom {n}", n, "tb")
                 for n in range(130)])
    errors = core.error_log(OWNER, gid, sid)["errors"]
    assert len(errors) == 100 and errors[0]["message"] == "boom 129" and errors[-1]["line"] == 30
    assert set(errors[0]) >= {"id", "time", "requestId", "kind", "message", "line"}
    core.set_plan(OPERATOR, gid, "free")
    with pytest.raises(core.QuotaError) as err:
        core.error_log(OWNER, gid, sid)
    assert err.value.code == "plan_feature"
    assert core.history(OWNER, gid, sid)["records"] == []


def test_items_of_a_missing_endpoint_are_dropped(db):
    gid = make_guild()
    eid = _endpoint(gid, make_script(gid))
    write_batch([make_request(eid, 1), make_request(999_999, 2),
                 StatHit(999_999, NOW, 200, 1.0, "192.0.2.1")])
    assert [r["requestId"] for r in core.history(OWNER, gid, load_target_sid(gid))["records"]] == ["r1"]


def load_target_sid(gid: str) -> str:
    return core.list_scripts(OWNER, gid)["scripts"][0]["logicScriptId"]


def test_basic_stats_count_every_outcome(db):
    gid = make_guild("plus")
    sid = make_script(gid)
    eid = _endpoint(gid, sid)
    hits = [StatHit(eid, NOW, s, 2.0, "192.0.2.1") for s in (200, 200, 401, 403, 413, 429, 500)]
    write_batch(hits[:3])
    write_batch(hits[3:])
    stats = core.stats(MANAGER, gid, sid)
    assert stats["total"] == 7 and stats["last24h"] == 7
    assert stats["byStatus"] == {"200": 2, "401": 1, "403": 1, "413": 1, "429": 1, "500": 1}
    assert "latency" not in stats and stats["advanced"] is False


def test_advanced_stats_on_pro(db):
    gid = make_guild("pro")
    sid = make_script(gid)
    eid = _endpoint(gid, sid)
    hits = ([StatHit(eid, NOW, 200, 3.0, "192.0.2.1")] * 90
            + [StatHit(eid, NOW, 200, 40.0, "192.0.2.2")] * 9
            + [StatHit(eid, NOW - timedelta(hours=2), 504, 1200.0, "2001:db8::1")])
    write_batch(hits)
    stats = core.stats(OWNER, gid, sid)
    assert stats["total"] == 100
    # Percentiles of the recorded durations (within the stated 1 %), not the
    # histogram's bin bounds (which said 5.0 / 5.0 / 50.0 here).
    latency = stats["latency"]
    assert latency["relativeError"] == 0.01 and latency["count"] == 100
    for p, real in (("p50", 3.0), ("p90", 3.0), ("p99", 40.0)):
        assert abs(latency[p] - real) <= 0.01 * real, (p, latency[p])
    assert sum(latency["histogram"]["counts"]) == 100
    assert [p["total"] for p in stats["perMinute"]] == [1, 99]
    assert sum(p["total"] for p in stats["perHour"]) == 100
    assert stats["topIps"][0] == {"ip": "192.0.2.1", "count": 90}
    assert {"ip": "2001:db8::1", "count": 1} in stats["topIps"]


def test_old_buckets_are_pruned(db):
    gid = make_guild("pro")
    sid = make_script(gid)
    eid = _endpoint(gid, sid)
    write_batch([StatHit(eid, NOW - timedelta(hours=25), 200, 1.0, "192.0.2.1"),
                 StatHit(eid, NOW - timedelta(days=31), 200, 1.0, "192.0.2.1")])
    write_batch([StatHit(eid, NOW, 200, 1.0, "192.0.2.1")])
    minutes = StatBucket.select().where(StatBucket.granularity == "m").count()
    hours = StatBucket.select().where(StatBucket.granularity == "h").count()
    assert (minutes, hours) == (1, 2)
    assert core.stats(OWNER, gid, sid)["total"] == 2


def _dump(db) -> str:
    """Every row of every table as text."""
    parts = []
    for model in ALL_MODELS:
        for row in model.select().tuples():
            parts.append(repr(row))
    return "\n".join(parts)


def test_the_secret_is_never_stored_or_logged(db, caplog):
    caplog.set_level(logging.DEBUG)
    gid = make_guild("pro")
    sid = make_script(gid)
    core.enable_endpoint(OWNER, gid, sid)
    secret = core.regenerate_secret(OWNER, gid, sid)["secret"]
    eid = _endpoint(gid, sid)
    write_batch([
        make_request(eid, 1, headers={"authorization": f"Bearer {secret}",
                                      "x-service-secret": secret, "cookie": f"s={secret}"}),
        ErrorRecordIn(eid, "r1", NOW, "script_error", "boom", 1, None),
        StatHit(eid, NOW, 401, 1.0, "192.0.2.1"),
    ])
    core.show_endpoint(OWNER, gid, sid)
    core.history(OWNER, gid, sid)
    core.set_plan(OPERATOR, gid, "plus")
    dump = _dump(db)
    assert Endpoint.select().count() == 1 and Script.select().count() == 1
    assert secret not in dump and secret[4:] not in dump
    assert secret not in caplog.text and "created" in caplog.text
    # peewee's query log (with parameters) stays off even under DEBUG.
    assert "SELECT" not in caplog.text and "event.reply" not in caplog.text


def test_concurrent_writers_from_a_thread_pool(db):
    """Each thread gets its own connection; batches serialise cleanly."""
    from concurrent.futures import ThreadPoolExecutor

    gid = make_guild("plus")
    sid = make_script(gid)
    eid = _endpoint(gid, sid)

    def work(t: int) -> None:
        try:
            for b in range(5):
                write_batch([make_request(eid, t * 100 + b * 10 + i, keep=20) for i in range(10)]
                            + [StatHit(eid, NOW, 200, 1.0, f"192.0.2.{t}")] * 10)
        finally:
            db.close()      # the worker thread's own connection

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(work, range(4)))
    assert len(core.history(OWNER, gid, sid)["records"]) == 20
    assert core.stats(OWNER, gid, sid)["total"] == 200


def test_hostile_text_cannot_fail_a_batch(db):
    """NUL characters (PostgreSQL refuses them in text), lone surrogates and
    oversized fields are stored safely instead of failing the whole batch."""
    gid = make_guild("pro")
    sid = make_script(gid)
    eid = _endpoint(gid, sid)
    bad = "a\x00b\ud800c"
    write_batch([
        make_request(eid, 1, request_id="r" * 200 + bad, method=bad, ip=bad, user_agent=bad,
                     body="text\x00with nul", response_body=b"ok\x00", output=bad, error=bad,
                     query={"q": "x" * 20_000}, headers={"x-h": bad}),
        ErrorRecordIn(eid, bad, NOW, bad, bad, 3, bad),
        StatHit(eid, NOW, 200, 1.0, bad),
        StatHit(eid, NOW, 200, float("nan"), "192.0.2.1"),
        make_request(eid, 2, duration_ms=float("inf")),
    ])
    record = core.history(OWNER, gid, sid)["records"][1]
    assert record["bodyEncoding"] == "base64" and record["output"] == "a\ufffdb?c"
    assert record["responseBodyEncoding"] == "base64" and len(record["requestId"]) == 64
    assert list(record["query"]) == ["…"] and record["headers"]["x-h"] == "a\ufffdb?c"
    [error] = core.error_log(OWNER, gid, sid)["errors"]
    assert error["message"] == "a\ufffdb?c"
