"""Chart series (service.core.charts) and their SVG (service.dashboard.charts)."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest

from models import Endpoint, Script
from models.clock import utcnow
from service import core
from service.core.charts import request_series, status_class
from service.core.records import StatHit, write_batch
from service.dashboard.charts import bar_chart
from tests.factories import OWNER, STRANGER, make_guild, make_script


def test_series_count_by_status_class_in_fixed_slots(db):
    gid = make_guild("pro")                       # the charts are advanced statistics
    sid = make_script(gid)
    endpoint_id = Endpoint.get(Endpoint.script == Script.get(Script.public_id == sid).id).id
    now = utcnow().replace(second=30, microsecond=0)
    hits = [StatHit(endpoint_id, now, 200, 1.0, "1.2.3.4"), StatHit(endpoint_id, now, 201, 1.0, "1.2.3.4"),
            StatHit(endpoint_id, now, 404, 1.0, "1.2.3.4"), StatHit(endpoint_id, now, 503, 1.0, "1.2.3.4"),
            StatHit(endpoint_id, now - timedelta(minutes=5), 500, 1.0, "1.2.3.4", test=True),
            StatHit(endpoint_id, now - timedelta(hours=3), 200, 1.0, "1.2.3.4")]
    write_batch(hits)
    series = request_series(OWNER, gid, sid, now=now)
    minutes, hours = series["perMinute"], series["perHour"]
    assert len(minutes) == 60 and len(hours) == 720
    assert {k: minutes[-1][k] for k in ("2xx", "3xx", "4xx", "5xx")} == {
        "2xx": 2, "3xx": 0, "4xx": 1, "5xx": 1}
    assert minutes[-6]["5xx"] == 1
    assert sum(p["2xx"] for p in minutes) == 2               # the 3-hour-old one is out of the hour
    assert sum(p["2xx"] + p["4xx"] + p["5xx"] for p in hours) == 6
    with pytest.raises(core.NotFoundError):
        request_series(STRANGER, gid, sid)


def test_series_are_advanced_statistics(db):
    for plan in ("plus", "free"):
        gid = make_guild(plan)
        sid = make_script(gid)
        with pytest.raises(core.QuotaError) as refused:
            request_series(OWNER, gid, sid)
        assert refused.value.code == "plan_feature"


def test_status_classes():
    assert [status_class(s) for s in (100, 200, 302, 404, 429, 500, 504)] == [
        "2xx", "2xx", "3xx", "4xx", "4xx", "5xx", "5xx"]


def test_svg_is_inert_and_scaled():
    points = [{"time": '2026-11-24T10:00:00.000Z"><script>x</script>', "2xx": 4, "5xx": 2},
              {"time": "2026-11-24T10:01:00.000Z", "2xx": 0}]
    svg = bar_chart(points, title="Requests <b>", label_every=1)
    assert "<script>" not in svg and "<b>" not in svg and "&lt;script&gt;" in svg
    assert "style=" not in svg and " on" not in re.sub(r'"[^"]*"', "", svg)
    heights = sorted(float(h) for h in re.findall(r'<rect [^>]*height="([\d.]+)"', svg))
    assert len(heights) == 2 and heights[1] == pytest.approx(2 * heights[0], rel=0.01)
    assert 'aria-label="Requests &lt;b&gt;: 4 2xx, 2 5xx"' in svg
