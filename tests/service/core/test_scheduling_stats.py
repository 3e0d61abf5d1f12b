"""Statistics per endpoint count how often requests waited for a sandbox worker,
were refused 503 busy, or waited while their guild was deprioritised."""
from __future__ import annotations

from datetime import datetime, timezone

from service import core
from service.core.invoke_target import load_target
from service.core.records import StatHit, write_batch
from tests.factories import MANAGER, make_guild, make_script

NOW = datetime.now(timezone.utc)


def test_stats_count_queued_busy_and_deprioritised(db):
    gid = make_guild("plus")
    sid = make_script(gid)
    target = load_target(gid, sid)
    assert target is not None
    eid = target.endpoint_id
    write_batch([
        StatHit(eid, NOW, 200, 1.0, "192.0.2.1"),                     # ran at once
        StatHit(eid, NOW, 200, 9.0, "192.0.2.1", queued=True),               # waited
        StatHit(eid, NOW, 504, 900.0, "192.0.2.1", queued=True, deprioritised=True),       # waited, deprioritised
        StatHit(eid, NOW, 503, 2000.0, "192.0.2.1", queued=True),            # waited, then busy
        StatHit(eid, NOW, 503, 0.5, "192.0.2.1"),                     # queue full: busy at once
    ])
    write_batch([StatHit(eid, NOW, 200, 9.0, "192.0.2.1", queued=True, deprioritised=True)])
    stats = core.stats(MANAGER, gid, sid)
    assert stats["scheduling"] == {"queued": 4, "busy": 2, "deprioritised": 2}
    assert stats["total"] == 6


def test_an_endpoint_that_goes_quiet_loses_its_expired_statistics_too(db, monkeypatch):
    # Security review, session 16: statistics were swept only when their own
    # endpoint was written again: a flood against an endpoint that then went
    # quiet stayed on disk past the 24 h / 30 day retention.
    from datetime import timedelta

    from models import StatBucket, StatIp, StatSketch
    from service.core import records
    gid = make_guild("pro")
    quiet, busy = (load_target(gid, make_script(gid, name)) for name in ("quiet", "busy"))
    assert quiet is not None and busy is not None
    then = NOW - timedelta(days=45)
    monkeypatch.setattr(records, "utcnow", lambda: then.replace(tzinfo=None))
    write_batch([StatHit(quiet.endpoint_id, then, 200, 1.0, f"192.0.2.{i}") for i in range(50)])

    def rows() -> int:
        return sum(m.select().where(m.endpoint == quiet.endpoint_id).count()
                   for m in (StatBucket, StatIp, StatSketch))
    assert rows() > 50
    monkeypatch.undo()
    write_batch([StatHit(busy.endpoint_id, NOW, 200, 1.0, "192.0.2.1")])   # another endpoint
    assert rows() == 0


def test_caller_rows_per_endpoint_hour_are_bounded(db, monkeypatch):
    # Security review, session 16: one statistics row per distinct caller
    # address, ~1,000 new rows a second from one client rotating addresses.
    from models import StatIp
    from service.core import records
    monkeypatch.setattr(records, "CALLERS_PER_HOUR", 5)
    gid = make_guild("pro")
    sid = make_script(gid)
    target = load_target(gid, sid)
    assert target is not None
    hits = [StatHit(target.endpoint_id, NOW, 200, 1.0, f"198.51.100.{i}") for i in range(40)]
    hits += [StatHit(target.endpoint_id, NOW, 200, 1.0, "198.51.100.0")] * 9   # a known caller
    write_batch(hits)
    write_batch([StatHit(target.endpoint_id, NOW, 200, 1.0, f"203.0.113.{i}") for i in range(40)])
    rows = {r.ip: r.count for r in StatIp.select().where(StatIp.endpoint == target.endpoint_id)}
    assert len(rows) == 5 + 1 and rows["other"] == 35 + 40 and rows["198.51.100.0"] == 10
    top = core.stats(MANAGER, gid, sid)["topIps"]
    assert "other" not in {t["ip"] for t in top} and top[0] == {"ip": "198.51.100.0", "count": 10}
