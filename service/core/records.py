"""The record store: what the batched writer appends after requests.

`write_batch(items)` takes `RequestRecordIn` (history), `ErrorRecordIn` (error
log) and `StatHit` (statistics) items and, in ONE transaction:
- appends the request records and prunes an endpoint to the `keep` newest
  (the plan's history size, carried by the item) once it may have grown past
  `keep` by its slack (`prune_slack`, below), on its first write since the
  process started, and when `keep` changed;
- appends the error records and prunes each endpoint to the last 100;
- adds every `StatHit` to per-minute (kept 24 h) and per-hour (kept 30 days)
  counters with a latency histogram, to per-minute latency sketches (kept
  24 h, `service.core.sketch`), and counts caller IPs per hour.

Statistics come ONLY from `StatHit`: the HTTP layer sends one per request,
whatever its outcome (401/403/413/429 included), and a `RequestRecordIn` only
for requests that belong in history, so nothing is counted twice.

Secret headers (`authorization`, `x-service-secret`, cookies) are dropped
here as well as in the HTTP layer; bodies and output are capped at 8 KB with
a flag.  Items for an endpoint that no longer exists are dropped, so one
deleted script cannot make a whole batch fail.
"""
from __future__ import annotations

import bisect
import threading
from collections import Counter, defaultdict
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Sequence

from models import Endpoint, ErrorRecord, RequestRecord, StatBucket, StatIp, StatSketch, database
from models.clock import to_db, utcnow
from models.bulk import insert_rows
from models.stats import HOUR, LATENCY_BOUNDS_MS, MINUTE
from service.core.record_items import (BODY_CAP, OUTPUT_CAP, SECRET_HEADERS, TEXT_CAP,
                                       ErrorRecordIn, Item, RequestRecordIn, StatHit, cap_body,
                                       cap_text, json_text, redact_headers, short_text, storable_ms)
from service.core.journal_marks import Mark, set_mark
from service.core.sketch import key_of

ERROR_KEEP = 100
MINUTE_RETENTION = timedelta(hours=24)
HOUR_RETENTION = timedelta(days=30)
IP_RETENTION = timedelta(days=30)
SWEEP_EVERY = timedelta(minutes=1)
_last_sweep: dict[int, datetime] = {}
#: Every endpoint's expired statistics, swept once an hour per process: the
#: per-endpoint sweep runs only when an endpoint is written again, so an
#: endpoint flooded once and then quiet kept its rows past their retention
#: (security review, session 16).
GLOBAL_SWEEP_EVERY = timedelta(hours=1)
_last_global_sweep = datetime.min

# Request history is pruned lazily.  Every reader shows only the plan's newest
# `keep` rows of an endpoint (service.core.reads, record_queries, pages,
# testcalls), so rows past `keep` are invisible until pruned, and pruning after
# every write (one DELETE per endpoint per batch: with many endpoints called in
# turn, one per request) buys nothing a reader can see.  Instead each process
# counts the rows it inserted per endpoint since it last pruned that endpoint,
# and prunes once the count exceeds the slack: an endpoint then holds at most
# keep + slack rows per writing process.  A quarter of `keep` bounds the
# extra storage at 25 %, and at one row per write prunes one write in
# slack + 1 (1 in 51 at keep 200); the floor of 8 keeps small plans from
# pruning nearly every write (1 in 9 at keep 20) for a few rows more.
PRUNE_SLACK_MIN = 8
PRUNE_SLACK_FRACTION = 4
#: Bound of the memo below; clearing it only costs one prune per endpoint.
PRUNE_MEMO_MAX = 100_000
# endpoint id -> (keep, rows this process inserted since it last pruned it).
# Not in it (first write since start, or after a clear): prune, as rows left by
# an earlier process or another node are bounded then too.
_since_prune: dict[int, tuple[int, int]] = {}
_since_prune_lock = threading.Lock()


def prune_slack(keep: int) -> int:
    """How many rows past `keep` an endpoint may grow (per writing process)
    before its history is pruned: `max(PRUNE_SLACK_MIN, keep // PRUNE_SLACK_FRACTION)`."""
    return max(PRUNE_SLACK_MIN, keep // PRUNE_SLACK_FRACTION)




def _bucket(time: datetime, granularity: str) -> datetime:
    time = to_db(time)
    if granularity == MINUTE:
        return time.replace(second=0, microsecond=0)
    return time.replace(minute=0, second=0, microsecond=0)


def latency_bin(duration_ms: float) -> int:
    """Index of the histogram bin for a duration."""
    return bisect.bisect_left(LATENCY_BOUNDS_MS, duration_ms)


# ------------------------------------------------------------------ write
_REQUEST_COLUMNS = (
    "endpoint", "request_id", "time", "method", "query", "headers", "body", "body_encoding",
    "body_truncated", "ip", "user_agent", "status", "response_headers", "response_body",
    "response_body_encoding", "response_body_truncated", "duration_ms", "output", "error", "test",
    "script_version")
_ERROR_COLUMNS = ("endpoint", "request_id", "time", "kind", "message", "line", "traceback",
                  "script_version")
_BUCKET_KEY = ("endpoint", "granularity", "start", "status")
_BUCKET_ADD = (("count", "duration_sum") + tuple(f"h{i}" for i in range(len(LATENCY_BOUNDS_MS) + 1))
               + ("test_count", "queued", "deprioritised"))


def _request_row(item: RequestRecordIn) -> tuple[Any, ...]:
    body, body_enc, body_cut = cap_body(item.body)
    rbody, rbody_enc, rbody_cut = cap_body(item.response_body)
    return (
        item.endpoint_id, short_text(item.request_id, 64), to_db(item.time), short_text(item.method, 16),
        json_text(item.query), json_text(redact_headers(item.headers)),
        body, body_enc, body_cut, short_text(item.ip, 45), short_text(item.user_agent, TEXT_CAP),
        item.status,
        json_text(redact_headers(item.response_headers)), rbody, rbody_enc, rbody_cut,
        storable_ms(item.duration_ms), cap_text(item.output or "", OUTPUT_CAP),
        cap_text(item.error, TEXT_CAP), bool(item.test), item.script_version,
    )


def _prune(model: type[RequestRecord] | type[ErrorRecord], endpoint_id: int, keep: int) -> None:
    # Delete everything older than the keep-th newest id; when there are
    # fewer rows the subquery is empty (NULL) and nothing is deleted.
    if keep <= 0:
        model.delete().where(model.endpoint == endpoint_id).execute()
        return
    alias = model.alias()
    cutoff = (alias.select(alias.id).where(alias.endpoint == endpoint_id)
              .order_by(alias.id.desc()).limit(1).offset(keep - 1))
    model.delete().where((model.endpoint == endpoint_id) & (model.id < cutoff)).execute()


def _write_stats(hits: list[StatHit], now: datetime) -> None:
    # Aggregate in Python first: PostgreSQL refuses an upsert that touches
    # the same row twice in one statement, and fewer rows are cheaper anyway.
    bins = len(LATENCY_BOUNDS_MS) + 1
    buckets: dict[tuple[int, str, datetime, int], list[float]] = {}
    ips: dict[tuple[int, datetime, str], int] = defaultdict(int)
    sketch: dict[tuple[int, datetime, int], int] = defaultdict(int)
    # Bucket starts by whole minute since the epoch, computed once per minute
    # of the batch: a batch holds thousands of hits of the same minute or two.
    starts: dict[int, tuple[datetime, datetime]] = {}
    for hit in hits:
        when = hit.time
        stamp = (when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)).timestamp()
        minute = int(stamp // 60)
        pair = starts.get(minute)
        if pair is None:
            pair = starts[minute] = (_bucket(when, MINUTE), _bucket(when, HOUR))
        ms = storable_ms(hit.duration_ms)
        latency = 2 + latency_bin(ms)
        status = int(hit.status)
        for gran, start in ((MINUTE, pair[0]), (HOUR, pair[1])):
            key = (hit.endpoint_id, gran, start, status)
            acc = buckets.get(key)
            if acc is None:
                acc = buckets[key] = [0.0] * (5 + bins)
            acc[0] += 1
            acc[1] += ms
            acc[latency] += 1
            if hit.test:
                acc[2 + bins] += 1
            if hit.queued:
                acc[3 + bins] += 1
                if hit.deprioritised:
                    acc[4 + bins] += 1
        if hit.ip:
            ips[(hit.endpoint_id, pair[1], _caller(hit.endpoint_id, pair[1], hit.ip))] += 1
        sketch[(hit.endpoint_id, pair[0], key_of(ms))] += 1
    rows = [(endpoint_id, gran, start, status, int(acc[0]), acc[1], *(int(n) for n in acc[2:]))
            for (endpoint_id, gran, start, status), acc in sorted(buckets.items())]
    insert_rows(StatBucket, _BUCKET_KEY + _BUCKET_ADD, rows, conflict=_BUCKET_KEY, add=_BUCKET_ADD)
    insert_rows(StatIp, ("endpoint", "start", "ip", "count"),
                [(e, s, ip, n) for (e, s, ip), n in sorted(ips.items())],
                conflict=("endpoint", "start", "ip"), add=("count",))
    insert_rows(StatSketch, ("endpoint", "start", "key", "count"),
                [(e, s, k, n) for (e, s, k), n in sorted(sketch.items())],
                conflict=("endpoint", "start", "key"), add=("count",))
    # Expiry works at minute granularity, so each endpoint is swept at most
    # once a minute per process: two statements fewer on most batches.
    global _last_global_sweep
    if _last_global_sweep <= now - GLOBAL_SWEEP_EVERY:
        _last_global_sweep = now
        _sweep_stats(None, now)
        return
    touched = sorted(e for e in {h.endpoint_id for h in hits}
                     if _last_sweep.get(e, datetime.min) <= now - SWEEP_EVERY)
    if not touched:
        return
    for e in touched:
        _last_sweep[e] = now
    if len(_last_sweep) > 100_000:     # bound the memo; a sweep too many is harmless
        _last_sweep.clear()
    _sweep_stats(touched, now)


def _sweep_stats(endpoints: list[int] | None, now: datetime) -> None:
    """Delete the expired statistics of `endpoints` (None: of every endpoint)."""
    def scoped(model: Any, expired: Any) -> Any:
        return expired if endpoints is None else model.endpoint.in_(endpoints) & expired
    StatBucket.delete().where(scoped(StatBucket, (
        ((StatBucket.granularity == MINUTE) & (StatBucket.start < now - MINUTE_RETENTION))
        | ((StatBucket.granularity == HOUR) & (StatBucket.start < now - HOUR_RETENTION))))).execute()
    StatIp.delete().where(scoped(StatIp, StatIp.start < now - IP_RETENTION)).execute()
    StatSketch.delete().where(scoped(StatSketch,
                                     StatSketch.start < now - MINUTE_RETENTION)).execute()


#: Distinct caller addresses kept per endpoint and hour (per process); the
#: others of that hour are counted together as `OTHER_CALLERS`, so an
#: endpoint's caller rows stay bounded however many addresses call it.
CALLERS_PER_HOUR = 100
OTHER_CALLERS = "other"
_callers: dict[tuple[int, datetime], set[str]] = {}
_callers_lock = threading.Lock()


def _caller(endpoint_id: int, hour: datetime, ip: str) -> str:
    """`ip` as its statistics row names it: itself, or `OTHER_CALLERS` once
    the endpoint's hour already has `CALLERS_PER_HOUR` addresses."""
    ip = short_text(ip, 45)
    with _callers_lock:
        seen = _callers.get((endpoint_id, hour))
        if seen is None:
            if len(_callers) > 20_000:          # hours gone by; an early reset is harmless
                _callers.clear()
            seen = _callers[(endpoint_id, hour)] = set()
        if ip in seen:
            return ip
        if len(seen) >= CALLERS_PER_HOUR:
            return OTHER_CALLERS
        seen.add(ip)
        return ip


def reset_sweeps() -> None:
    """Forget when endpoints were last swept and pruned, as a process start
    does (tests; after switching databases): each endpoint's next write prunes."""
    global _last_global_sweep
    _last_sweep.clear()
    _last_global_sweep = datetime.min
    with _callers_lock:
        _callers.clear()
    with _since_prune_lock:
        _since_prune.clear()


def _due_prunes(keep: dict[int, int], inserted: Counter[int]) -> list[int]:
    """The endpoints to prune now, counting this batch's rows in the memo.

    Prune when the endpoint is not in the memo, when its `keep` changed (a
    plan change: at once), when `keep <= 0` (as before: everything goes), or
    when the rows inserted since its last prune exceed `prune_slack(keep)`.
    The memo is updated here, under a lock, so that concurrent batches of one
    process add up (the service writes from one thread: rows of a batch still
    in flight while another prunes could outlive that prune until the next);
    a batch that fails makes `write_batch` forget its endpoints."""
    due: list[int] = []
    with _since_prune_lock:
        for endpoint_id, n in sorted(keep.items()):
            seen = _since_prune.get(endpoint_id)
            count = (seen[1] if seen is not None else 0) + inserted[endpoint_id]
            if n <= 0 or seen is None or seen[0] != n or count > prune_slack(n):
                due.append(endpoint_id)
                # After a later prune the count starts at 0; after the first
                # one (or a plan change) at a phase of the endpoint's own, in
                # 0..slack, so that endpoints first written together (all of
                # them, at a process start) do not all fall due in the same
                # later batch.  Counting high only makes a prune come sooner.
                count = 0 if seen is not None and seen[0] == n else endpoint_id % (prune_slack(n) + 1)
            _since_prune[endpoint_id] = (n, count)
        if len(_since_prune) > PRUNE_MEMO_MAX:   # a prune too many is harmless
            _since_prune.clear()
    return due


def _forget(endpoint_ids: Iterable[int]) -> None:
    """Drop endpoints from the prune memo (their next write prunes): after a
    batch that failed, whose counts and prunes were rolled back."""
    with _since_prune_lock:
        for endpoint_id in endpoint_ids:
            _since_prune.pop(endpoint_id, None)


def _newest(requests: list[RequestRecordIn], keep: dict[int, int]) -> list[RequestRecordIn]:
    """The last `keep[endpoint]` requests of each endpoint, in their original order."""
    left = dict(keep)
    picked: list[RequestRecordIn] = []
    for r in reversed(requests):
        if left[r.endpoint_id] > 0:
            left[r.endpoint_id] -= 1
            picked.append(r)
    picked.reverse()
    return picked


def write_batch(items: Sequence[Item], mark: Mark | None = None) -> None:
    """Append a batch of records and statistics in one transaction (see the
    module docstring), with the journal mark of the entries they came from
    (`service.core.journal_marks`).  Raises peewee database errors (the
    writer retries)."""
    if not items and mark is None:
        return
    now = utcnow()
    wanted = {i.endpoint_id for i in items}
    keep: dict[int, int] = {}     # endpoint -> its plan's history size
    try:
        with database.atomic():
            existing = {e.id for e in Endpoint.select(Endpoint.id)
                        .where(Endpoint.id.in_(sorted(wanted)))}
            requests = [i for i in items
                        if isinstance(i, RequestRecordIn) and i.endpoint_id in existing]
            errors = [i for i in items if isinstance(i, ErrorRecordIn) and i.endpoint_id in existing]
            hits = [i for i in items if isinstance(i, StatHit) and i.endpoint_id in existing]
            if requests:
                for r in requests:        # the newest item carries the current plan
                    keep[r.endpoint_id] = r.keep
                # Only each endpoint's newest `keep` of this batch can survive a
                # prune: older ones are not even converted (under load a batch
                # holds far more requests than a plan keeps).
                requests = _newest(requests, keep)
                insert_rows(RequestRecord, _REQUEST_COLUMNS, [_request_row(r) for r in requests])
                for endpoint_id in _due_prunes(keep, Counter(r.endpoint_id for r in requests)):
                    _prune(RequestRecord, endpoint_id, keep[endpoint_id])
            if errors:
                insert_rows(ErrorRecord, _ERROR_COLUMNS, [
                    (e.endpoint_id, short_text(e.request_id, 64), to_db(e.time), short_text(e.kind, 32),
                     cap_text(e.message, TEXT_CAP) or "", e.line, cap_text(e.traceback, OUTPUT_CAP),
                     e.script_version)
                    for e in errors])
                # Pruned on every write: not every error reader caps to
                # ERROR_KEEP (pages.errors_page pages through all rows).
                for endpoint_id in sorted({e.endpoint_id for e in errors}):
                    _prune(ErrorRecord, endpoint_id, ERROR_KEEP)
            if hits:
                _write_stats(hits, now)
            if mark is not None:
                set_mark(mark)
    except BaseException:
        # Rolled back: the prune counts this batch took are void, so its
        # endpoints are forgotten and their next write prunes.
        _forget(keep)
        raise


__all__ = ["ErrorRecordIn", "Item", "RequestRecordIn", "StatHit", "write_batch",
           "redact_headers", "cap_body", "prune_slack", "reset_sweeps", "BODY_CAP", "ERROR_KEEP",
           "PRUNE_SLACK_MIN", "SECRET_HEADERS"]
