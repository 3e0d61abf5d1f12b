"""The records journal: answered requests survive a SIGKILL of the service."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.http.journal import Journal, read_segments
from service.http.journal_facts import FIELDS
from tests.service.http.harness import Server, wait_until
from tests.service.http.test_checks import ECHO


def test_records_of_answered_requests_survive_sigkill(make_server, make_endpoint, read_history,
                                                      http_env, bind, tmp_path: Path) -> None:
    from service.core import reads
    from service.core.access import Actor
    from tests.service.http.conftest import OWNER

    journal = tmp_path / "journal"
    extra = f'[records]\njournal = "{journal}"'
    server: Server = make_server(extra=extra)
    ep = make_endpoint(source=ECHO, plan="bench")
    for n in range(100):
        assert server.request(ep.path + f"?n={n}", json_body={"n": n},
                              secret=ep.secret).status == 200
    server.kill()  # SIGKILL right after the last answer: the writer had no time
    restarted: Server = make_server(extra=extra)
    assert "replayed" in restarted.log or len(read_history(ep)) == 100

    def total() -> Any:
        bind()
        return reads.stats(Actor.user(OWNER), ep.guild_id, ep.script_id,
                           plans=http_env.plans)["total"]

    assert wait_until(lambda: len(read_history(ep)) == 100 and total() == 100, timeout=20), \
        (len(read_history(ep)), total())
    history = read_history(ep)
    assert sorted(int(r["query"]["n"]) for r in history) == list(range(100))
    assert ep.secret not in str(history)
    assert restarted.request("/healthz", method="GET").status == 200


def _killed_with_journal(make_server, make_endpoint, tmp_path: Path,
                         requests: int) -> tuple[Path, str, Any, Server]:
    """A server journaling into tmp_path/journal answers `requests` requests
    and is SIGKILLed right after (the writer had no time): (journal, its
    config line, the endpoint, the server)."""
    journal = tmp_path / "journal"
    extra = f'[records]\njournal = "{journal}"'
    server: Server = make_server(extra=extra)
    ep = make_endpoint(source=ECHO, plan="bench")
    for n in range(requests):
        assert server.request(ep.path, json_body={"n": n}, secret=ep.secret).status == 200
    server.kill()
    return journal, extra, ep, server


def test_a_journal_of_another_database_is_set_aside_not_replayed(
        make_server, make_endpoint, read_history, bind, tmp_path: Path) -> None:
    # Review, session 27: the journal names endpoints by row id, so a journal
    # left by another installation (another database) was replayed into
    # whatever endpoint had that id here: one guild's bodies in another's
    # history. Here the database becomes "another" by a new installation id.
    from models.installation import renew_installation_id

    # Leaves journaled records behind, as in the test above.
    journal, extra, ep, _ = _killed_with_journal(make_server, make_endpoint, tmp_path, 20)
    bind()
    before = len(read_history(ep))
    renew_installation_id()
    restarted: Server = make_server(extra=extra)
    assert wait_until(lambda: "was written for another database" in restarted.log), \
        restarted.log
    quarantined = [p for d in journal.glob("quarantine-*") for p in d.iterdir()]
    assert quarantined and all(p.name.endswith(".journal") for p in quarantined)
    assert "journaled requests" not in restarted.log   # no "replayed N journaled requests"
    assert len(read_history(ep)) == before        # nothing of it written here
    assert (journal / "installation").read_text() != ""
    assert restarted.request(ep.path, json_body={"n": 99}, secret=ep.secret).status == 200


def _segments(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("segment-"))


def test_a_journal_set_aside_takes_none_of_the_new_runs_own_segments(
        make_server, make_endpoint, read_history, bind, tmp_path: Path) -> None:
    # The start made its own segment before it set another database's journal
    # aside, and moved it too: what it then journaled was in the quarantine,
    # never replayed after its own crash (review, session 29).
    from models.installation import renew_installation_id

    journal, extra, ep, _ = _killed_with_journal(make_server, make_endpoint, tmp_path, 5)
    left = _segments(journal)
    renew_installation_id()
    restarted: Server = make_server(extra=extra)
    assert wait_until(lambda: "was written for another database" in restarted.log)
    (quarantine,) = journal.glob("quarantine-*")
    assert sorted(p.name for p in quarantine.iterdir()) == left
    bind()
    before = len(read_history(ep))
    for n in range(30):
        assert restarted.request(ep.path, json_body={"n": n}, secret=ep.secret).status == 200
    restarted.kill()
    again: Server = make_server(extra=extra)
    assert wait_until(lambda: len(read_history(ep)) == before + 30, timeout=20), \
        (len(read_history(ep)), before, again.log)


def _locked(directory: Path) -> bool:
    """Whether a process holds the journal in `directory`."""
    import fcntl
    try:
        fd = os.open(directory / "lock", os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def test_starts_killed_during_their_replay_leave_no_segments_behind(
        make_server, make_endpoint, read_history, http_env, tmp_path: Path) -> None:
    # Each start made its 8 MiB segment before it replayed; a start killed
    # while its replay waited for a locked database left one more file, so a
    # restart loop grew the directory by 8 MiB a start (review, session 29).
    import sqlite3
    import time

    from tests.service.http.harness import LOGIC

    if not http_env.database_url.startswith("sqlite:///"):
        pytest.skip("the database is locked through its SQLite file")
    journal, extra, ep, server = _killed_with_journal(make_server, make_endpoint, tmp_path, 20)
    left = _segments(journal)
    assert left
    lock = sqlite3.connect(http_env.database_url[len("sqlite:///"):], isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")   # the replay's writes wait (10 s busy timeout)
    try:
        for _ in range(3):
            proc = subprocess.Popen([LOGIC, "--database-url", http_env.database_url, "--config",
                                     str(server.config), "serve", "--port", "0"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                assert wait_until(lambda: _locked(journal), timeout=30)
                time.sleep(0.5)        # in its replay, waiting for the database
            finally:
                proc.kill()
                proc.wait()
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert _segments(journal) == left
    restarted: Server = make_server(extra=extra)
    assert wait_until(lambda: len(read_history(ep)) >= 20, timeout=20), restarted.log
    assert len(_segments(journal)) <= len(left) + 1


def test_the_journal_directory_and_its_files_are_private(make_server, make_endpoint,
                                                         tmp_path: Path) -> None:
    """docs/security.md: the directory is created 0700, its files 0600 (they
    hold request bodies and headers, other credential-named values as sent),
    whatever the umask lets through (the ordinary 022 here)."""
    import stat

    journal = tmp_path / "journal"
    umask = os.umask(0o022)
    try:
        server: Server = make_server(extra=f'[records]\njournal = "{journal}"')
    finally:
        os.umask(umask)
    ep = make_endpoint(source=ECHO, plan="bench")
    assert server.request(ep.path, json_body={"n": 1}, secret=ep.secret).status == 200
    assert stat.S_IMODE(journal.stat().st_mode) == 0o700
    files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in journal.iterdir()}
    assert "lock" in files and any(name.startswith("segment-") for name in files), files
    assert all(mode == 0o600 for mode in files.values()), files


def test_journal_holds_no_secret_and_a_torn_entry_is_skipped(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    facts = {name: None for name in FIELDS}
    facts.update(endpoint_id=1, keep=10, error_logs=True, accepted=True, request_id="req_1",
                 started=1.0, finished=1.5, status=200, ip="127.0.0.1", method="POST",
                 query={"a": "1"}, headers={}, body=b"{}", user_agent="", response_headers=[],
                 response_body=b"", output="", error_message="")
    with journal.lock:
        journal.append(tuple(facts.values()))
        journal.append(tuple(facts.values()))
        sealed = journal.seal()
    assert len(sealed) == 1
    # A crash mid-append: the third entry's bytes are in the file, its
    # length word (written last) is not. (Segments keep their full size, so
    # the torn bytes go where the next entry would start.)
    data = bytearray(sealed[0].read_bytes())
    first = 4 + int.from_bytes(data[:4], "little")
    end = 2 * first
    assert data[end:end + 4] == bytes(4)
    data[end + 4:end + first] = data[4:first]
    sealed[0].write_bytes(bytes(data))
    entries = list(read_segments(sealed))
    assert len(entries) == 2 and entries[0].history_slot() == (1, 10)
    journal.close()


def _facts(n: int, body: bytes = b"{}") -> tuple[Any, ...]:
    facts: dict[str, Any] = {name: None for name in FIELDS}
    facts.update(endpoint_id=1, keep=10, error_logs=True, accepted=True, request_id=f"req_{n}",
                 started=1.0, finished=1.5, status=200, ip="127.0.0.1", method="POST",
                 query={"n": str(n)}, headers={}, body=body, user_agent="",
                 response_headers=[], response_body=b"", output="", error_message="")
    return tuple(facts.values())


def _ids(paths: list[Path]) -> list[str]:
    return [entry.facts[4] for entry in read_segments(paths)]


def test_a_written_segment_is_emptied_and_reused(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    with journal.lock:
        for n in range(5):
            journal.append(_facts(n))
        first = journal.seal()
    journal.discard(first)  # in the database: nothing in it is replayed any more
    assert _ids(first) == []
    with journal.lock:
        journal.append(_facts(100))
        journal.append(_facts(101))
        second = journal.seal()
    assert _ids(second) == ["req_100", "req_101"]
    assert len(list((tmp_path / "j").glob("segment-*"))) <= 1 + Journal.KEEP_FREE
    journal.close()  # what was not written stays for the next start-up; the rest goes
    assert sorted((tmp_path / "j").glob("segment-*")) == second


CRASHER = """
import os, sys
sys.path[:0] = [{root!r}]
from tests.service.http.test_journal import _facts
from service.http.journal import Journal
journal = Journal({path!r})
for round in range(3):
    with journal.lock:
        for n in range(50):
            journal.append(_facts(round * 1000 + n))
        sealed = journal.seal()
    journal.discard(sealed)          # in the database: emptied and recycled
with journal.lock:
    journal.append(_facts(7001))
    journal.seal()                   # handed to the writer, not yet written
    journal.append(_facts(7002))     # queued, not yet sealed
os._exit(0)                          # no close: as a SIGKILL would leave it
"""


def test_after_a_crash_only_unwritten_entries_are_replayed(tmp_path: Path) -> None:
    import subprocess
    import sys
    root = str(Path(__file__).resolve().parents[3])
    path = str(tmp_path / "j")
    subprocess.run([sys.executable, "-c", CRASHER.format(root=root, path=path)], check=True,
                   cwd=root, timeout=60)
    journal = Journal(path)
    leftovers = journal.leftovers()
    assert sorted(_ids(leftovers)) == ["req_7001", "req_7002"]
    journal.discard(leftovers)
    assert journal.leftovers() == []
    journal.close()


def _used_for(journal: Journal, numbers: range) -> tuple[list[Path], bytes]:
    """Journal `numbers`, seal: (the sealed segments, their first file's bytes)."""
    with journal.lock:
        for n in numbers:
            journal.append(_facts(n))
        sealed = journal.seal()
    return sealed, sealed[0].read_bytes()


def test_a_lost_end_marker_never_replays_an_earlier_use_of_a_recycled_segment(
        tmp_path: Path) -> None:
    # A power loss writes pages back in any order: the page holding the end
    # marker after the newest entry may still hold an earlier use's entries.
    journal = Journal(tmp_path / "j")
    first, old = _used_for(journal, range(10, 60))   # ids of one length: entries of one size
    journal.discard(first)                            # written: emptied and reused
    second, new = _used_for(journal, range(60, 61))
    size = 4 + int.from_bytes(new[:4], "little")
    assert size == 4 + int.from_bytes(old[:4], "little")  # the earlier use lines up after it
    second[0].write_bytes(new[:size] + old[size:])    # the end marker lost, the old tail back
    assert _ids(second) == ["req_60"]
    journal.close()


def test_replay_stops_at_an_unreadable_entry(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    sealed, data = _used_for(journal, range(10, 13))
    size = 4 + int.from_bytes(data[:4], "little")
    garbled = bytearray(data)
    garbled[size + 4:2 * size] = b"\xc1" * (size - 4)   # 0xc1: never valid msgpack
    sealed[0].write_bytes(bytes(garbled))
    assert _ids(sealed) == ["req_10"]   # not req_12: nothing after a bad entry is trusted
    journal.close()



def test_a_segment_left_by_a_version_before_stamps_is_still_replayed(tmp_path: Path) -> None:
    # An upgrade after a crash: the old process's entries are bare lists of facts.
    import struct

    import msgpack  # type: ignore[import-untyped]

    path = tmp_path / "segment-000000000003.journal"
    data = b"".join(struct.pack("<I", len(b)) + b for b in
                    (msgpack.packb(_facts(n), use_bin_type=True) for n in (1, 2)))
    path.write_bytes(data + bytes(4))
    assert _ids([path]) == ["req_1", "req_2"]


def test_replay_stops_at_an_entry_msgpack_refuses_with_a_type_error(tmp_path: Path) -> None:
    # Outside review, session 19: a map keyed by a list (damaged bytes) made
    # msgpack raise TypeError, which the reader did not catch: every start failed.
    import struct
    path = tmp_path / "segment-000000000999.journal"
    good = msgpack_entry(999, _facts(1))
    bad = b"\x92\xcd\x03\xe7\x81\x90\x01"   # [999, {[]: 1}]
    path.write_bytes(struct.pack("<I", len(good)) + good + struct.pack("<I", len(bad)) + bad
                     + bytes(4))
    assert _ids([path]) == ["req_1"]


def _enabled_endpoint() -> int:
    """The id of a new pro guild's enabled endpoint."""
    from service import core
    from service.core.invoke_target import load_target
    from tests.factories import OWNER, make_guild, make_script
    gid = make_guild("pro")
    sid = make_script(gid)
    core.enable_endpoint(OWNER, gid, sid)
    return load_target(gid, sid).endpoint_id   # type: ignore[union-attr]


def msgpack_entry(stamp: int, facts: tuple[Any, ...]) -> bytes:
    import msgpack  # type: ignore[import-untyped]
    return bytes(msgpack.packb([stamp, list(facts)], use_bin_type=True))


def test_an_entry_that_cannot_be_stored_is_dropped_alone_at_replay(db, tmp_path: Path) -> None:
    # Outside review, session 19: one entry with a value no database column
    # takes (damaged bytes that still decode) failed the whole replay, so the
    # service could not start, and each attempt wrote the batches before it again.
    import struct

    from models import RequestRecord, StatBucket
    from service.http.journal_replay import replay_journal
    endpoint_id = _enabled_endpoint()
    journal = Journal(tmp_path / "j")
    path = tmp_path / "j" / "segment-000000000990.journal"
    entries = []
    import time
    for n in range(5):
        facts = list(_facts(n))
        facts[0] = endpoint_id
        facts[5], facts[6] = time.time(), time.time() + 0.01   # now: within the kept statistics
        if n == 2:
            facts[7] = 2 ** 64 - 1        # a status no column takes
        entries.append(msgpack_entry(990, tuple(facts)))
    path.write_bytes(b"".join(struct.pack("<I", len(e)) + e for e in entries) + bytes(4))
    replay_journal(journal, batch=2)
    kept = sorted(r.request_id for r in RequestRecord.select())
    assert kept == ["req_0", "req_1", "req_3", "req_4"]
    assert sum(b.count for b in StatBucket.select().where(StatBucket.granularity == "m")) == 4
    assert journal.leftovers() == []
    replay_journal(journal, batch=2)      # nothing left: nothing written twice
    assert RequestRecord.select().count() == 4
    journal.close()


def test_a_damaged_segment_is_set_aside_after_what_precedes_the_damage_is_written(
        db, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before, a segment unreadable from some entry on was deleted with the
    # rest of the replayed files: nothing left to look into.
    import logging
    import struct

    from models import RequestRecord
    from service.http.journal_replay import replay_journal
    endpoint_id = _enabled_endpoint()
    journal = Journal(tmp_path / "j")
    path = tmp_path / "j" / "segment-000000000991.journal"
    entries = []
    for n in range(4):
        facts = list(_facts(n))
        facts[0] = endpoint_id
        entries.append(msgpack_entry(991, tuple(facts)))
    entries[2] = b"\xc1" * len(entries[2])        # never valid msgpack
    path.write_bytes(b"".join(struct.pack("<I", len(e)) + e for e in entries) + bytes(4))
    damaged = bytes(path.read_bytes())
    with caplog.at_level(logging.ERROR, logger="logic.server"):
        replay_journal(journal)
    assert sorted(r.request_id for r in RequestRecord.select()) == ["req_0", "req_1"]
    aside = tmp_path / "j" / "damaged-segment-000000000991.journal"
    assert not path.exists() and aside.read_bytes() == damaged
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [
        "journal segment-000000000991.journal: unreadable from byte "
        f"{8 + len(entries[0]) + len(entries[1])} (damaged: the entries before it were "
        "written, the rest is lost)"]
    assert journal.leftovers() == []
    replay_journal(journal)                       # set aside: never replayed again
    assert RequestRecord.select().count() == 2 and aside.exists()
    journal.close()


@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 12 MiB file system of its own (tmpfs), so that filling it harms nothing else."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system for the journal needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m,mode=0700", "tmpfs", str(disk)],
                   check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(path: Path) -> None:
    """Write `path` until its file system has no block left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            while True:
                try:
                    os.write(fd, bytes(size))
                except OSError as err:
                    assert err.errno == errno.ENOSPC, err
                    break
    finally:
        os.close(fd)


def test_a_segment_is_made_only_with_its_blocks_and_a_full_disk_is_an_oserror(
        small_disk: Path) -> None:
    """Outside review, session 24: segments were sparse files, so a store into
    the mapping on a full file system was a SIGBUS that ended the service.
    Now a segment's blocks are reserved when it is made: a full disk is an
    OSError of `append` (the writer counts it and the request is answered),
    and journaling goes on once a segment can be made again."""
    journal = Journal(small_disk / "j")
    with journal.lock:
        journal.append(_facts(1))      # into the first segment, made before the disk filled
    _fill(small_disk / "filler")
    with journal.lock:
        for n in range(2, 200):        # ~8 MiB more than the disk has: no SIGBUS
            try:
                journal.append(_facts(n, body=bytes(60_000)))
            except OSError as err:
                assert err.errno == errno.ENOSPC
                break
        else:
            raise AssertionError("the segment never filled")
        with pytest.raises(OSError):   # asked again at once: not retried yet
            journal.append(_facts(500))
        sealed = journal.seal()        # what was journaled is there to write or replay
    assert _ids(sealed)[:2] == ["req_1", "req_2"]
    journal.discard(sealed)            # written: kept, emptied, for reuse
    journal._retry_at = 0.0            # (a second later)
    with journal.lock:
        journal.append(_facts(501))    # journaled again, in the reused segment
        again = journal.seal()
    assert _ids(again) == ["req_501"]
    journal.close()


def test_a_full_disk_under_the_journal_costs_journaling_not_the_service(
        small_disk: Path, make_server, make_endpoint, read_history) -> None:
    extra = f'[records]\njournal = "{small_disk / "journal"}"'
    server: Server = make_server(extra=extra)
    ep = make_endpoint(source=ECHO, plan="bench")
    assert server.request(ep.path, json_body={"n": 0}, secret=ep.secret).status == 200
    _fill(small_disk / "filler")
    for n in range(1, 40):
        resp = server.request(ep.path + f"?n={n}", json_body={"pad": "x" * 200_000},
                              secret=ep.secret)
        assert resp.status == 200, server.log
    assert wait_until(lambda: "writing the records journal failed" in server.log, timeout=10)
    assert "No space left on device" in server.log
    assert wait_until(lambda: len(read_history(ep)) == 40, timeout=20), len(read_history(ep))
    (small_disk / "filler").unlink()
    assert server.request("/healthz", method="GET").status == 200
    assert server.proc is not None and server.proc.poll() is None


KILLED_BETWEEN_BATCHES = """
import os, sys, time
sys.path[:0] = [{root!r}]
from models.db import connect
from service.core.records import write_batch
from service.http.journal import Journal
from service.http.records import RecordWriter
from tests.service.http.test_journal import _facts

db = connect({url!r})
commits = []

def sink(items, mark=None):
    write_batch(items, mark)
    commits.append(len(items))
    if len(commits) == 2:
        os._exit(0)   # killed after the turn's second batch, before its third

class Answered:
    def __init__(self, n):
        facts = list(_facts(n))
        facts[0], facts[1] = {endpoint_id}, 1000
        facts[5], facts[6] = time.time(), time.time() + 0.01
        self.facts = tuple(facts)
    def journal_facts(self):
        return self.facts

writer = RecordWriter(sink, max_batch=10, journal=Journal({path!r}),
                      on_thread_start=lambda: db.connect(reuse_if_open=True))
for n in range(50):
    writer.put(Answered(n))     # all queued: the writer's first turn takes them all
writer.start()
time.sleep(60)
"""


def test_a_crash_between_two_batches_of_a_turn_writes_nothing_twice(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside review, session 24: the writer empties a turn's journal
    segments once all its batches are in; a crash after some were committed
    replayed them again (a whole batch twice in history and statistics).
    Each batch now stores its journal mark in its own transaction, and
    replay skips what a mark covers; so does a second replay after a crash
    that came between the first one's commit and its emptying the segments."""
    import sys

    from models import JournalMark, RequestRecord, StatBucket
    from models.db import connect, database
    from models.migrate import Runner
    from service import core
    from service.core.invoke_target import load_target
    from service.http.journal_replay import replay_journal
    from tests.factories import OWNER, make_guild, make_script
    db = connect(db_url)
    Runner(db).upgrade()
    try:
        gid = make_guild("pro")
        sid = make_script(gid)
        core.enable_endpoint(OWNER, gid, sid)
        endpoint_id = load_target(gid, sid).endpoint_id   # type: ignore[union-attr]
        root = str(Path(__file__).resolve().parents[3])
        path = str(tmp_path / "j")
        subprocess.run([sys.executable, "-c", KILLED_BETWEEN_BATCHES.format(
            root=root, url=db_url, endpoint_id=endpoint_id, path=path)],
            check=True, cwd=root, timeout=120)
        assert RequestRecord.select().count() == 20        # two batches of ten were in
        with monkeypatch.context() as patch:
            patch.setattr(Journal, "discard", lambda self, paths: None)   # killed right after
            journal = Journal(path)
            replay_journal(journal, batch=7)
            journal.close()
        journal = Journal(path)
        assert journal.leftovers()
        replay_journal(journal, batch=7)
        assert journal.leftovers() == []
        ids = [r.request_id for r in RequestRecord.select()]
        assert sorted(ids) == sorted(f"req_{n}" for n in range(50))
        assert sum(b.count for b in StatBucket.select().where(StatBucket.granularity == "m")) == 50
        assert JournalMark.select().count() == 0       # gone with the run's last segment
        journal.close()
    finally:
        db.close()
        database.initialize(None)


def test_the_mark_of_a_run_killed_with_nothing_left_to_write_goes_with_its_files(
        db, tmp_path: Path) -> None:
    """Outside review, session 24: a run killed while idle (all written, its
    segments emptied) left its mark for 30 days: replay forgot only the
    runs whose files still held entries."""
    from models import JournalMark
    from service.core.journal_marks import set_mark
    from service.http.journal_replay import replay_journal
    dead = Journal(tmp_path / "j")
    with dead.lock:
        dead.append(_facts(1))
        mark = dead.append(_facts(2))
        sealed = dead.seal()
    set_mark(mark)                    # written by its writer...
    dead.discard(sealed)              # ...and emptied: then killed (no close)
    run = dead.run
    dead._lock_fd, fd = -1, dead._lock_fd
    os.close(fd)                      # (its lock goes with the process)
    journal = Journal(tmp_path / "j")
    assert journal.leftovers() and JournalMark.select().count() == 1
    replay_journal(journal)
    assert journal.leftovers() == []
    assert not JournalMark.select().where(JournalMark.run == run).exists()
    journal.close()
