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
