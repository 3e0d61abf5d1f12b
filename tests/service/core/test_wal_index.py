"""`WalIndex`: on SQLite in WAL mode the endpoint cache learns that something
committed from the WAL index header (a memory read), not from `PRAGMA
data_version` (three system calls), and misses no commit of any process.

The other process is real (a `python -c` child committing through its own
connection, with checkpoints that reset the WAL in between), and the pragma's
once-a-second cross-check is turned off where a test shows that the header
alone sees every commit.
"""
from __future__ import annotations

import logging
import mmap
import os
import sqlite3
import subprocess
import sys
from contextlib import closing
from typing import Any

import pytest

from service.core import wal_index
from service.core.invoke_target import TargetCache
from service.core.wal_index import WalIndex
from tests.service.core.test_target_cache import endpoint  # noqa: F401 - a fixture

SQLITE_ONLY = pytest.mark.parametrize("db", ["sqlite"], indirect=True)

#: Commits one change per line it reads ("N KIND": the script's source becomes
#: "# N"; KIND asks for a checkpoint first), answering "ok" once it committed.
WRITER = r"""
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=10, isolation_level=None)
for line in sys.stdin:
    n, kind = line.split()
    if kind != "-":
        conn.execute(f"PRAGMA wal_checkpoint({kind})").fetchall()
    conn.execute("UPDATE script SET source = ? WHERE public_id = ?", (f"# {n}\n", sys.argv[2]))
    print("ok", flush=True)
"""


@SQLITE_ONLY
def test_lookups_read_the_wal_index_not_the_pragma(db, endpoint, monkeypatch):
    gid, sid = endpoint
    monkeypatch.setattr(wal_index, "CROSS_CHECK_S", 1e9)
    cache = TargetCache()
    assert cache(gid, sid) is not None          # the index is mapped on the first lookup
    statements: list[str] = []
    db.connection().set_trace_callback(statements.append)
    try:
        for _ in range(50):
            assert cache(gid, sid) is not None
    finally:
        db.connection().set_trace_callback(None)
    assert not [s for s in statements if "data_version" in s], statements
    assert statements == []                      # nor the lookup's query: remembered


@SQLITE_ONLY
def test_every_commit_of_another_process_is_seen_by_the_next_lookup(db, endpoint, monkeypatch):
    # The header alone (no cross-check): each of another process's commits,
    # some right after a checkpoint that empties and restarts the WAL, is seen
    # by the very next lookup.
    gid, sid = endpoint
    monkeypatch.setattr(wal_index, "CROSS_CHECK_S", 1e9)
    cache = TargetCache()
    assert cache(gid, sid) is not None
    kinds = ["-", "-", "PASSIVE", "-", "TRUNCATE", "-", "RESTART", "FULL"]
    with subprocess.Popen([sys.executable, "-c", WRITER, db.database, sid],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as writer:
        assert writer.stdin is not None and writer.stdout is not None
        try:
            for n in range(400):
                writer.stdin.write(f"{n} {kinds[n % len(kinds)]}\n")
                writer.stdin.flush()
                assert writer.stdout.readline() == "ok\n"
                target = cache(gid, sid)
                assert target is not None and target.source == f"# {n}\n", (n, target)
        finally:
            writer.kill()


@SQLITE_ONLY
def test_a_header_that_missed_a_commit_hands_over_to_the_pragma(db, endpoint, caplog):
    # The tripwire: a header that did not move while the pragma saw a commit
    # (a SQLite that behaves otherwise) is abandoned for the pragma, logged.
    now = [0.0]
    index = WalIndex(db.connection(), clock=lambda: now[0])
    assert index._map is not None                # (the real mapping stays open)
    frozen = bytearray(mmap.PAGESIZE)            # a header that never changes,
    frozen[8:12] = b"\x01\x00\x00\x00"          # its change counter past 0
    index._map = memoryview(frozen)
    index._header_then = first = index.changes()
    _commit_elsewhere(db, endpoint[1], "# elsewhere\n")
    assert index.changes() == first              # missed, until the cross-check
    now[0] += wal_index.CROSS_CHECK_S
    with caplog.at_level(logging.WARNING, logger="logic.targets"):
        seen = index.changes()
    assert seen != first and index._map is None
    assert "did not show a commit" in caplog.text
    _commit_elsewhere(db, endpoint[1], "# again\n")
    assert index.changes() != seen               # the pragma, on every look now


@SQLITE_ONLY
def test_a_cross_check_during_commits_raises_no_false_alarm(db, endpoint, caplog):
    now = [0.0]
    index = WalIndex(db.connection(), clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="logic.targets"):
        for n in range(30):
            _commit_elsewhere(db, endpoint[1], f"# {n}\n")
            now[0] += wal_index.CROSS_CHECK_S
            index.changes()
    assert index._map is not None and "did not show" not in caplog.text


def test_outside_wal_mode_the_pragma_answers(tmp_path):
    path = tmp_path / "rollback.db"
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute("CREATE TABLE t (x)")
        index = WalIndex(conn)
        assert index._map is None
        before = index.changes()
        with closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("INSERT INTO t VALUES (1)")
        assert index.changes() != before


@SQLITE_ONLY
@pytest.mark.parametrize("kept_open", [False, True], ids=["index-re-created", "index-kept"])
def test_a_new_connection_sees_every_commit_after_it(db, endpoint, monkeypatch, kept_open):
    # The loop's connection closes and reopens: with another connection keeping
    # the -shm file, or with none (SQLite deletes it and re-creates it, a new
    # file); either way the new connection's lookups see each commit at once.
    monkeypatch.setattr(wal_index, "CROSS_CHECK_S", 1e9)
    gid, sid = endpoint
    cache = TargetCache()
    assert cache(gid, sid) is not None
    shm = db.database + "-shm"
    inode = os.stat(shm).st_ino
    with closing(sqlite3.connect(db.database)) as other:
        if kept_open:
            other.execute("PRAGMA data_version").fetchone()
        else:
            other.close()
        db.close()
        assert os.path.exists(shm) == kept_open
        db.connect()
        assert cache(gid, sid) is not None
        assert (os.stat(shm).st_ino == inode) == kept_open
        for n in range(3):
            _commit_elsewhere(db, sid, f"# {n}\n")
            target = cache(gid, sid)
            assert target is not None and target.source == f"# {n}\n", n


@SQLITE_ONLY
def test_lookups_leave_no_read_transaction_open(db, endpoint):
    # An unfinished statement would pin an old snapshot that a lookup could
    # store under a newer header: none is left (a checkpoint that must wait
    # for every reader completes at once).
    gid, sid = endpoint
    cache = TargetCache()
    for _ in range(3):
        assert cache(gid, sid) is not None
        assert cache("1" * 18, "logic_" + "x" * 22) is None
        _commit_elsewhere(db, sid, "# moved\n")
        assert cache(gid, sid) is not None
        with closing(sqlite3.connect(db.database, timeout=0)) as other:
            busy, _, _ = other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        assert busy == 0


@SQLITE_ONLY
def test_a_mapping_that_fails_leaves_sqlites_locks_and_the_pragma_answers(db, endpoint,
                                                                          monkeypatch):
    gid, sid = endpoint
    held = _locks_held(db.database + "-shm")
    monkeypatch.setattr(wal_index, "_MAPS", {})
    monkeypatch.setattr(wal_index, "_libc_mmap", lambda *args: wal_index._MAP_FAILED)
    cache = TargetCache()
    assert cache(gid, sid) is not None
    assert _locks_held(db.database + "-shm") == held
    _commit_elsewhere(db, sid, "# seen\n")
    target = cache(gid, sid)
    assert target is not None and target.source == "# seen\n"


@SQLITE_ONLY
def test_mapping_the_index_keeps_sqlites_own_locks(db, endpoint):
    # POSIX locks belong to the process: closing any descriptor of the -shm
    # file would drop the dead-man lock SQLite holds on it for this process's
    # connections (another process could then re-initialise the index under
    # them). The mapping is made once and its descriptor never closed.
    gid, sid = endpoint
    shm = db.database + "-shm"
    held = _locks_held(shm)
    assert held, "SQLite holds a lock on the index while a connection is open"
    for _ in range(3):
        cache = TargetCache()
        assert cache(gid, sid) is not None
        cache.close()
    assert _locks_held(shm) == held


def test_a_fresh_index_asks_the_pragma_too(tmp_path):
    # A change counter of 0 (a fresh or rebuilt index) could repeat an earlier
    # header: the pragma answers along with it until the first commit.
    path = str(tmp_path / "fresh.db")
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (x)")
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        index = WalIndex(conn)
        statements: list[str] = []
        conn.set_trace_callback(statements.append)
        first = index.changes()
        assert any("data_version" in s for s in statements)
        with closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("INSERT INTO t VALUES (1)")
        statements.clear()
        assert index.changes() != first and statements == []
        conn.set_trace_callback(None)


def _locks_held(path: str) -> list[str]:
    """This process's POSIX locks on `path` (/proc/locks: type, range)."""
    inode = os.stat(path).st_ino
    held = []
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if parts[1] == "POSIX" and parts[4] == str(os.getpid()) \
                    and parts[5].rsplit(":", 1)[1] == str(inode):
                held.append(" ".join(parts[3:4] + parts[6:8]))
    return sorted(held)


def _commit_elsewhere(db: Any, sid: str, source: str) -> None:
    with closing(sqlite3.connect(db.database, timeout=10)) as conn:
        with conn:
            conn.execute("UPDATE script SET source = ? WHERE public_id = ?", (source, sid))
