"""Lazy pruning of request history, on SQLite and PostgreSQL.

The writer prunes an endpoint's history only once this process may have let
it grow `prune_slack(keep)` past the plan's `keep` (and at once on the first
write since the process started, or after a plan change); every reader shows
only the newest `keep` rows, pruned or not.
"""
from __future__ import annotations

import random

import pytest

from models import RequestRecord
from service import core
from service.core import pages, records
from service.core.invoke_target import load_target
from service.core.records import prune_slack, reset_sweeps, write_batch
from service.core.testcalls import replay_request
from tests.factories import OPERATOR, OWNER, make_guild, make_request, make_script


def _endpoint(gid: str, sid: str) -> int:
    target = load_target(gid, sid)
    assert target is not None
    return target.endpoint_id


def _stored(endpoint_id: int) -> int:
    return int(RequestRecord.select().where(RequestRecord.endpoint == endpoint_id).count())


def _stored_ids(endpoint_id: int) -> list[str]:
    """Request ids of every stored row, newest first (pruned or not)."""
    return [r.request_id for r in RequestRecord.select(RequestRecord.request_id)
            .where(RequestRecord.endpoint == endpoint_id).order_by(RequestRecord.id.desc())]


def _grow_past_keep(endpoint_id: int, keep: int) -> int:
    """Write one request per batch until rows past `keep` are stored (as a
    process leaves them); returns how many were written."""
    n = 0
    while _stored(endpoint_id) <= keep:
        write_batch([make_request(endpoint_id, n, keep=keep)])
        n += 1
        assert n <= keep + prune_slack(keep) + 1, "every write pruned"
    return n


def _listed(gid: str, sid: str) -> dict[str, list[str]]:
    """What each history reader lists, newest first."""
    return {
        "reads.history": [r["requestId"] for r in core.history(OWNER, gid, sid)["records"]],
        "record_queries.history_page": [
            r["requestId"] for r in core.history_page(OWNER, gid, sid)["records"]],
        "pages.history_page": [
            r["requestId"] for r in pages.history_page(OWNER, gid, sid, limit=200)["items"]],
    }


def test_readers_never_show_more_than_keep_while_unpruned_rows_exist(db):
    gid = make_guild("plus")                      # keeps 20
    sid = make_script(gid)
    eid = _endpoint(gid, sid)
    keep = 20
    most = 0
    for n in range(keep + 3 * (prune_slack(keep) + 1)):    # one request per batch
        write_batch([make_request(eid, n, keep=keep)])
        newest = [f"r{m}" for m in range(n, max(-1, n - keep), -1)]
        listed = _listed(gid, sid)
        assert listed == {reader: newest for reader in listed}, n
        most = max(most, _stored(eid))
        stored = _stored_ids(eid)
        if len(stored) > keep:
            # A row past the newest `keep` is still stored, yet nowhere to be read.
            hidden = stored[keep]
            for read in (core.history_record, pages.history_record, replay_request):
                with pytest.raises(core.NotFoundError):
                    read(OWNER, gid, sid, hidden)
            # ... while the oldest of the newest `keep` is.
            assert core.history_record(OWNER, gid, sid, stored[keep - 1])["requestId"] == stored[keep - 1]
            assert pages.history_record(OWNER, gid, sid, stored[keep - 1])["requestId"] == stored[keep - 1]
            assert replay_request(OWNER, gid, sid, stored[keep - 1])[1].replay_of == stored[keep - 1]
    assert most > keep, "no batch left unpruned rows: the readers were not put to the test"


@pytest.mark.parametrize("plan,keep", [("plus", 20), ("pro", 200)])
def test_storage_stays_within_keep_plus_slack_over_many_batches(db, plan, keep):
    gid = make_guild(plan)
    sids = [make_script(gid, f"s{i}") for i in range(3)]
    eids = [_endpoint(gid, sid) for sid in sids]
    bound = keep + prune_slack(keep)
    rng = random.Random(7)
    written = {eid: 0 for eid in eids}
    most = 0
    for _ in range(60):
        batch = []
        for eid in eids:                           # interleaved, as requests arrive
            for _ in range(rng.choice([0, 1, 1, 2, 3, prune_slack(keep) // 2, keep // 3])):
                batch.append(make_request(eid, written[eid], keep=keep))
                written[eid] += 1
        batch.sort(key=lambda r: int(r.request_id[1:]))   # endpoints interleaved
        write_batch(batch)
        for eid in eids:
            stored = _stored(eid)
            assert stored <= bound, (eid, stored, bound)
            most = max(most, stored)
    assert most > keep                             # the slack was used, not pruned away
    for sid, eid in zip(sids, eids):
        assert [r["requestId"] for r in core.history(OWNER, gid, sid)["records"]] == \
            [f"r{n}" for n in range(written[eid] - 1, written[eid] - keep - 1, -1)]


def test_one_request_per_batch_reaches_keep_plus_slack_and_no_more(db):
    gid = make_guild("plus")
    sid = make_script(gid)
    eid = _endpoint(gid, sid)
    keep = 20
    sizes = []
    for n in range(keep + 4 * (prune_slack(keep) + 1)):
        write_batch([make_request(eid, n, keep=keep)])
        sizes.append(_stored(eid))
    assert max(sizes) == keep + prune_slack(keep) == 28
    assert sizes.count(keep) >= 3                  # pruned again and again, to exactly keep


def test_a_smaller_keep_prunes_at_the_next_write(db, monkeypatch):
    # A slack so large that nothing but the plan change (or a process start)
    # can make the writer prune.
    monkeypatch.setattr(records, "PRUNE_SLACK_MIN", 10_000)
    gid = make_guild("pro")                        # keeps 200
    sid = make_script(gid)
    eid = _endpoint(gid, sid)
    write_batch([make_request(eid, n, keep=200) for n in range(150)])
    write_batch([make_request(eid, 150, keep=200)])
    assert _stored(eid) == 151
    core.set_plan(OPERATOR, gid, "plus")           # keeps 20: shown at once ...
    assert len(core.history(OWNER, gid, sid)["records"]) == 20
    assert _stored(eid) == 151                     # ... stored until the next write
    write_batch([make_request(eid, 151, keep=20)])
    assert _stored_ids(eid) == [f"r{n}" for n in range(151, 131, -1)]
    # And the same again for the new size: no prune while within the slack.
    write_batch([make_request(eid, 152, keep=20)])
    assert _stored(eid) == 21


def test_the_first_write_after_a_process_start_prunes_what_was_left(db):
    gid = make_guild("plus")
    sid = make_script(gid)
    eid = _endpoint(gid, sid)
    keep = 20
    n = _grow_past_keep(eid, keep)                 # an earlier process leaves unpruned rows
    left = _stored(eid)
    assert keep < left <= keep + prune_slack(keep)
    reset_sweeps()                                 # as a new process starts with no memo
    write_batch([make_request(eid, n, keep=keep)])
    assert _stored_ids(eid) == [f"r{m}" for m in range(n, n - keep, -1)]


def test_keep_zero_deletes_everything_at_once(db):
    gid = make_guild("plus")
    sid = make_script(gid)
    eid = _endpoint(gid, sid)
    write_batch([make_request(eid, n, keep=20) for n in range(5)])
    write_batch([make_request(eid, 5, keep=0)])
    assert _stored(eid) == 0


def test_a_failed_batch_makes_the_next_write_prune(db, monkeypatch):
    gid = make_guild("plus")
    sid = make_script(gid)
    eid = _endpoint(gid, sid)
    keep = 20
    n = _grow_past_keep(eid, keep)

    def broken(*args, **kwargs):
        raise RuntimeError("the database went away")

    monkeypatch.setattr(records, "_write_stats", broken)
    request = make_request(eid, n, keep=keep)
    with pytest.raises(RuntimeError):
        write_batch([request, records.StatHit(eid, request.time, 200, 1.0, "203.0.113.7")])
    assert _stored(eid) > keep                     # rolled back: nothing written, nothing pruned
    monkeypatch.undo()
    write_batch([make_request(eid, n, keep=keep)])  # its prune count was voided: prunes
    assert _stored(eid) == keep
