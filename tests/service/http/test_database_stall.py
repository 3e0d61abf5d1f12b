"""PostgreSQL stalled behind a proxy: connections stay open, nothing is answered.

`logic serve` reaches the test server through `StallingProxy`
(`private_servers.py`); the test stalls it with records waiting, then stops
the server with SIGTERM.

Outside attack pass, session 34: the records writer's statements had no
time bound, so on such a database it blocked in one statement for ever,
never logged that the database was unreachable, and at SIGTERM the stop line
said `stopped: 1 records written, 0 dropped` while 70 answered requests were
never written (lost with the journal off; replayed at the next start with it
on). Now each statement of the writer is bounded (`WRITE_TIMEOUT_S`), the
outage is logged once, and the stop line counts what was not written.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from service.http.record_outage import WRITE_TIMEOUT_S
from tests.dbsupport import PgSchema, pg_base_url, pg_unreachable_reason
from tests.service.http.conftest import CONFIG
from tests.service.http.harness import LOGIC, Server
from tests.service.http.private_servers import StallingProxy, poll
from tests.service.http.test_database_outage import _make_endpoints, _stat_counts

#: Requests answered while the database is stalled.
ANSWERED = 30


@pytest.fixture()
def schema_url() -> Iterator[str]:
    reason = pg_unreachable_reason()
    if reason:
        pytest.skip(reason)
    schema = PgSchema()
    try:
        subprocess.run([LOGIC, "--database-url", schema.url, "db", "upgrade"], check=True,
                       capture_output=True)
        yield schema.url
    finally:
        schema.drop()


def _through(proxy: StallingProxy, url: str) -> str:
    parts = urlsplit(url)
    return url.replace(parts.netloc, f"{parts.username or 'postgres'}@127.0.0.1:{proxy.port}", 1)


def _stop_line(srv: Server) -> tuple[int, int, int]:
    """(written, dropped, kept in the journal) from the server's last line."""
    match = re.search(r"stopped: (\d+) records written, (\d+) dropped"
                      r"(?:, (\d+) kept in the journal)?", srv.log)
    assert match, srv.log[-3000:]
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def _stall_with_records_waiting(url: str, journal: str, tmp_path: Path
                                ) -> tuple[Server, tuple[str, str, str, int]]:
    """A server through a proxy, one request written, then the proxy stalled and
    ANSWERED more requests answered (from memory) whose records cannot be written."""
    config = tmp_path / "logic.toml"
    config.write_text(f'[records]\njournal = "{journal}"\n'
                      '[database]\noutage_serve_s = 600\n' + CONFIG)
    ep = _make_endpoints(url, config, 0, 1)[0]
    guild_id, script_id, secret, endpoint_id = ep
    host = urlsplit(pg_base_url())
    proxy = StallingProxy(host.hostname or "127.0.0.1", host.port or 5432)
    srv = Server(_through(proxy, url), str(config)).start()
    srv.proxy = proxy  # type: ignore[attr-defined]
    path = f"/endpoints/{guild_id}/{script_id}"
    assert poll(lambda: srv.request("/readyz", method="GET").json
                ["dependencies"]["database"].get("changeFeed") == "listening", 30)
    assert srv.request(path, secret=secret, json_body={}).status == 200
    assert poll(lambda: _stat_counts(url, endpoint_id) == {"m": 1, "h": 1}, 30)
    proxy.stall()
    statuses = [srv.request(path, secret=secret, json_body={}, timeout=30).status
                for _ in range(ANSWERED)]
    assert statuses == [200] * ANSWERED, srv.log[-3000:]
    return srv, ep


def _stop(srv: Server) -> float:
    started = time.monotonic()
    try:
        srv.stop(60)
    finally:
        srv.proxy.close()  # type: ignore[attr-defined]
    return time.monotonic() - started


def test_a_stalled_database_bounds_the_writer_and_the_stop_counts_the_unwritten_as_dropped(
        schema_url: str, tmp_path: Path) -> None:
    srv, (_, _, _, endpoint_id) = _stall_with_records_waiting(schema_url, "off", tmp_path)
    try:
        # The writer's statement is given up on: the outage is said.
        said = poll(lambda: "the database is unreachable (timed out" in srv.log,
                    WRITE_TIMEOUT_S + 15)
    finally:
        took = _stop(srv)
    # Every answered request not written is counted dropped (journal off).
    assert _stop_line(srv) == (1, ANSWERED, 0), srv.log[-3000:]
    assert said, srv.log[-3000:]
    assert srv.log.count("the database is unreachable (timed out") == 1, srv.log[-3000:]
    assert took < 30, took
    assert _stat_counts(schema_url, endpoint_id) == {"m": 1, "h": 1}


def test_a_stop_during_a_stall_counts_the_unwritten_kept_in_the_journal(
        schema_url: str, tmp_path: Path) -> None:
    journal = str(tmp_path / "journal")
    srv, (_, _, _, endpoint_id) = _stall_with_records_waiting(schema_url, journal, tmp_path)
    try:
        said = poll(lambda: "the database is unreachable (timed out" in srv.log,
                    WRITE_TIMEOUT_S + 15)
    finally:
        _stop(srv)
    assert _stop_line(srv) == (1, 0, ANSWERED), srv.log[-3000:]
    assert said, srv.log[-3000:]
    # The next start (the database answering) writes what the journal kept.
    again = Server(schema_url, str(tmp_path / "logic.toml")).start()
    try:
        assert f"replayed {ANSWERED} journaled requests" in again.log
        assert _stat_counts(schema_url, endpoint_id) == {"m": 1 + ANSWERED, "h": 1 + ANSWERED}
    finally:
        again.stop()
