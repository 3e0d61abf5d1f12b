"""Record-store benchmark: append 10,000 request records (with their stat
hits) in batches as the writer sends them, pruning each endpoint to N=200,
on SQLite and on PostgreSQL; prints records/s.

    python bench/records_bench.py [--records 10000] [--batch 50] [--keep 200]
        [--endpoints 4] [--sqlite PATH] [--postgres URL | --no-postgres]

The PostgreSQL run uses a throw-away schema that is dropped afterwards.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from urllib.parse import quote

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from models.db import connect, database, open_database  # noqa: E402
from models.migrate import Runner  # noqa: E402
from service import core  # noqa: E402
from service.core.invoke_target import load_target  # noqa: E402
from service.core.records import RequestRecordIn, StatHit, write_batch  # noqa: E402
from models.migrate import _sql  # noqa: E402


def setup(endpoints: int) -> list[int]:
    operator, owner = core.Actor.operator(), core.Actor.user("1")
    core.create_guild(operator, "777", "1", "pro")
    ids = []
    for i in range(endpoints):
        sid = core.create_script(owner, "777", f"bench{i}", "on endpoint(e):\n    pass\n")["logicScriptId"]
        target = load_target("777", sid)
        assert target is not None
        ids.append(target.endpoint_id)
    return ids


def run(url: str, records: int, batch: int, keep: int, endpoints: int) -> float:
    db = connect(url)
    Runner(db).upgrade()
    ids = setup(endpoints)
    body = b'{"player": "steve", "score": 1234, "note": "' + b"x" * 200 + b'"}'
    start = time.perf_counter()
    for offset in range(0, records, batch):
        now = datetime.now(timezone.utc)
        items: list[RequestRecordIn | StatHit] = []
        for n in range(offset, min(offset + batch, records)):
            eid = ids[n % len(ids)]
            items.append(RequestRecordIn(
                endpoint_id=eid, request_id=uuid.uuid4().hex, time=now, method="POST",
                query={}, headers={"content-type": "application/json", "user-agent": "bench"},
                body=body, ip="198.51.100.7", user_agent="bench/1", status=200,
                response_headers={"content-type": "application/json"},
                response_body=b'{"ok": true}', duration_ms=2.5, output="", error=None, keep=keep))
            items.append(StatHit(eid, now, 200, 2.5, "198.51.100.7"))
        write_batch(items)
    elapsed = time.perf_counter() - start
    from models import RequestRecord
    kept = RequestRecord.select().count()
    assert kept == min(records, keep * endpoints), kept
    db.close()
    database.initialize(None)
    return records / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--keep", type=int, default=200)
    parser.add_argument("--endpoints", type=int, default=4)
    parser.add_argument("--sqlite", default=None, help="SQLite file (default: a temp file)")
    parser.add_argument("--postgres", default=os.environ.get(
        "TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()
    shape = f"{args.records} records, batches of {args.batch}, keep {args.keep}, {args.endpoints} endpoints"

    with tempfile.TemporaryDirectory() as tmp:
        path = args.sqlite or os.path.join(tmp, "bench.db")
        rate = run(f"sqlite:///{path}", args.records, args.batch, args.keep, args.endpoints)
        print(f"sqlite      {rate:10,.0f} records/s  ({shape})")

    if not args.no_postgres:
        schema = f"bench_{uuid.uuid4().hex[:8]}"
        admin = open_database(args.postgres)
        _sql(admin, f'CREATE SCHEMA "{schema}"')
        try:
            sep = "&" if "?" in args.postgres else "?"
            url = f"{args.postgres}{sep}options={quote(f'-c search_path={schema}')}"
            rate = run(url, args.records, args.batch, args.keep, args.endpoints)
            print(f"postgresql  {rate:10,.0f} records/s  ({shape})")
        finally:
            _sql(admin, f'DROP SCHEMA "{schema}" CASCADE')
            admin.close()


if __name__ == "__main__":
    main()
