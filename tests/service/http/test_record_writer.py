"""The batched record writer (`service.http.records`): what its users rely on.

Real threads throughout. The only stand-in is the writer's injected
dependency, `write_batch` (in the service: `service.core.records.write_batch`,
one database transaction per batch); here it is a plain function that records
what it receives, so the tests see exactly which batches reached the database.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from peewee import InterfaceError, OperationalError

from service.http.record_batches import expand
from service.http.records import RecordWriter


def wait_for(condition: Callable[[], bool], timeout: float = 2.0) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


class Sink:
    """The writer's injected `write_batch`: appends every batch it receives.

    `fail_times` makes the next N calls raise (a database error); `fail_always`
    makes every call raise until it is switched off.
    """

    def __init__(self, fail_times: int = 0) -> None:
        self.batches: list[list[Any]] = []
        self.calls = 0
        self.fail_times = fail_times
        self.fail_always = False
        self.poison: set[Any] = set()   # items that can never be written
        self.error: type[Exception] = RuntimeError
        self._lock = threading.Lock()

    def __call__(self, items: Sequence[Any]) -> None:
        with self._lock:
            self.calls += 1
            if self.fail_always or self.fail_times > 0:
                self.fail_times = max(0, self.fail_times - 1)
                raise self.error("database is down")
            if any(item in self.poison for item in items):
                raise OverflowError("Python int too large to convert to SQLite INTEGER")
            self.batches.append(list(items))

    @property
    def items(self) -> list[Any]:
        with self._lock:
            return [item for batch in self.batches for item in batch]


class Entry:
    """A fake finished request (the `Recordable` protocol).

    It belongs to `endpoint_id`, whose plan keeps `keep` history rows; `tag`
    identifies it in the records it produces.
    """

    def __init__(self, endpoint_id: int | None, keep: int, tag: str) -> None:
        self.endpoint_id = endpoint_id
        self.keep = keep
        self.tag = tag

    def history_slot(self) -> tuple[int, int] | None:
        return None if self.endpoint_id is None else (self.endpoint_id, self.keep)

    def records(self, history: bool) -> list[Any]:
        out: list[Any] = [("stat", self.tag)]
        if history:
            out.append(("history", self.tag))
        return out


@pytest.fixture
def make_writer() -> Iterator[Callable[..., RecordWriter]]:
    """Build writers; every one is stopped (its thread joined) at teardown."""
    writers: list[RecordWriter] = []

    def make(sink: Sink, **kwargs: Any) -> RecordWriter:
        writer = RecordWriter(sink, **kwargs)
        writers.append(writer)
        return writer

    yield make
    for writer in writers:
        writer.stop(timeout=5)


# --- stop() loses nothing ---------------------------------------------------------------------

@pytest.mark.parametrize("max_batch", [20_000, 1_000])
def test_stop_writes_everything_queued(make_writer, max_batch):
    """Entries put just before stop() are written; a long interval means only
    the final drain can have written them (in batches of max_batch)."""
    sink = Sink()
    writer = make_writer(sink, interval=10.0, max_batch=max_batch)
    writer.start()
    for n in range(5_000):
        writer.put(("item", n))
    started = time.monotonic()
    writer.stop()
    assert time.monotonic() - started < 2.0, "stop() must not wait for the interval"
    assert sink.items == [("item", n) for n in range(5_000)]
    assert writer.written == 5_000
    assert writer.dropped == 0 and writer.failed_batches == 0
    assert all(len(batch) <= max_batch for batch in sink.batches)


def test_a_stop_that_outwaits_a_write_that_does_not_end_counts_what_was_not_written(
        make_writer, caplog):
    # Outside attack pass, session 34: a writer stuck in a statement (a stalled
    # database) outlived the stop's wait, and the stop line said "0 dropped"
    # for every answered request it never wrote. Now the batch in flight and
    # everything queued behind it are counted (dropped: no journal here).
    entered, release = threading.Event(), threading.Event()

    def stuck(items: Sequence[Any], mark: Any = None) -> None:
        entered.set()
        release.wait(30)

    writer = make_writer(stuck, interval=0.02)
    writer.start()
    try:
        for n in range(5):
            writer.put(n)
        assert entered.wait(5)
        for n in range(3):
            writer.put(n)          # queued behind the batch in flight
        with caplog.at_level(logging.WARNING, logger="logic.records"):
            writer.stop(timeout=0.3)
        assert (writer.written, writer.dropped, writer.kept) == (0, 8, 0)
        assert any("stopping with 8 records unwritten" in r.getMessage() for r in caplog.records)
    finally:
        release.set()


def test_a_database_unreachable_as_the_writer_starts_does_not_end_it(make_writer, caplog):
    """The writer's thread connects when it starts; a database unreachable
    then ended the thread, and nothing was ever written (found in session 34's
    review). It says so once and writes when its batches can be."""
    def unreachable() -> None:
        raise OperationalError("could not connect to server")

    sink = Sink()
    with caplog.at_level(logging.WARNING, logger="logic.records"):
        writer = make_writer(sink, interval=0.01, on_thread_start=unreachable)
        writer.start()
        writer.put(("item", 1))
        assert wait_for(lambda: sink.items == [("item", 1)])
    assert writer.written == 1
    assert [r.getMessage() for r in caplog.records] == [
        "the records writer could not connect at its start (OperationalError): it tries "
        "again with its first batch"]


def test_stop_while_a_producer_is_putting(make_writer):
    """The writer is busy (short interval) while another thread puts; stop()
    right after the last put still writes every entry, once, in order."""
    sink = Sink()
    writer = make_writer(sink, interval=0.005, max_batch=500)
    writer.start()

    def produce() -> None:
        for n in range(5_000):
            writer.put(n)

    producer = threading.Thread(target=produce)
    producer.start()
    producer.join()
    writer.stop()
    assert sink.items == list(range(5_000))
    assert writer.written == 5_000 and writer.dropped == 0


def test_stop_without_start_is_harmless(make_writer):
    writer = make_writer(Sink())
    writer.stop()
    writer.stop()


# --- batching -------------------------------------------------------------------------------

def test_entries_are_written_in_batches(make_writer):
    sink = Sink()
    writer = make_writer(sink, interval=0.2)
    writer.start()
    for n in range(1_000):
        writer.put(n)
    assert wait_for(lambda: writer.written == 1_000, timeout=3.0)
    assert sink.calls <= 3, f"{sink.calls} write_batch calls for 1,000 quick entries"
    assert sink.items == list(range(1_000))


def test_max_batch_wakes_the_writer_before_the_interval(make_writer):
    sink = Sink()
    writer = make_writer(sink, interval=10.0, max_batch=100)
    writer.start()
    time.sleep(0.02)  # let the thread reach its wait, so the wake-up is what ends it
    started = time.monotonic()
    for n in range(100):
        writer.put(n)
    assert wait_for(lambda: writer.written == 100, timeout=1.0), "not woken by max_batch"
    assert time.monotonic() - started < 1.0
    assert sink.batches == [list(range(100))]


class Hit:
    """A statistics item of one endpoint, as `service.core.records.StatHit` is."""

    def __init__(self, endpoint_id: int) -> None:
        self.endpoint_id = endpoint_id


def test_a_batch_over_many_endpoints_makes_the_next_wait_longer(make_writer):
    """Requests spread over many endpoints each cost their own statistics rows
    in a batch: after a batch over more than `spread_endpoints` endpoints the
    writer waits `spread_interval`, so the next batch gathers more requests
    per endpoint; a batch over few endpoints brings the short wait back."""
    sink = Sink()
    writer = make_writer(sink, interval=0.05, spread_interval=1.5, spread_endpoints=10)
    writer.start()
    for n in range(11):                       # 11 endpoints: spread
        writer.put(Hit(n))
    assert wait_for(lambda: writer.written == 11)
    assert writer.next_wait == 1.5
    time.sleep(0.05)                          # the writer is in its long wait now
    put_at = time.monotonic()
    writer.put(Hit(1))
    time.sleep(0.5)                           # ten short intervals
    assert writer.written == 11, "written before the long wait ended"
    assert wait_for(lambda: writer.written == 12, timeout=3.0)
    assert time.monotonic() - put_at < 3.0
    assert writer.next_wait == 0.05           # one endpoint: the short wait again
    for n in range(50):                       # many requests, few endpoints: short wait
        writer.put(Hit(n % 10))
    assert wait_for(lambda: writer.written == 62)
    assert writer.next_wait == 0.05


def test_writer_passes_expanded_records_to_write_batch(make_writer):
    """Recordable entries reach write_batch as their record items, not as entries."""
    sink = Sink()
    writer = make_writer(sink, interval=10.0)
    writer.start()
    writer.put(Entry(1, 1, "a1"))
    writer.put(Entry(1, 1, "a2"))
    writer.put(("plain", 0))
    writer.stop()
    assert sink.items == [("stat", "a1"), ("stat", "a2"), ("history", "a2"), ("plain", 0)]
    assert writer.written == 3  # entries, not record items


# --- expand() -------------------------------------------------------------------------------

def test_expand_keeps_history_for_each_endpoints_newest_entries():
    a1, b1, a2, a3, b2 = (Entry(1, 2, "a1"), Entry(2, 1, "b1"), Entry(1, 2, "a2"),
                          Entry(1, 2, "a3"), Entry(2, 1, "b2"))
    no_history = Entry(None, 5, "n1")  # history_slot() None: statistics only
    plain = ("plain", 42)              # no `records`: passes through unchanged
    assert expand([a1, b1, plain, a2, no_history, a3, b2]) == [
        ("stat", "a1"),                                 # endpoint 1 keeps 2: a2, a3
        ("stat", "b1"),                                 # endpoint 2 keeps 1: b2
        ("plain", 42),
        ("stat", "a2"), ("history", "a2"),
        ("stat", "n1"),
        ("stat", "a3"), ("history", "a3"),
        ("stat", "b2"), ("history", "b2"),
    ]


def test_expand_every_entry_counts_in_statistics():
    entries = [Entry(n % 3, 1, f"e{n}") for n in range(30)]
    items = expand(entries)
    assert [i for i in items if i[0] == "stat"] == [("stat", f"e{n}") for n in range(30)]
    assert [i for i in items if i[0] == "history"] == [("history", "e27"), ("history", "e28"),
                                                       ("history", "e29")]


def test_expand_newest_entrys_keep_wins():
    # The plan was downgraded mid-batch: the newest entry carries the current N.
    shrunk = [Entry(1, 5, "old1"), Entry(1, 5, "old2"), Entry(1, 5, "old3"), Entry(1, 1, "new")]
    assert [i for i in expand(shrunk) if i[0] == "history"] == [("history", "new")]
    # ... and upgraded: the newest entry's larger N applies to the older ones too.
    grown = [Entry(1, 1, "old1"), Entry(1, 1, "old2"), Entry(1, 1, "old3"), Entry(1, 3, "new")]
    assert [i for i in expand(grown) if i[0] == "history"] == [
        ("history", "old2"), ("history", "old3"), ("history", "new")]


def test_expand_keep_zero_and_empty_batch():
    assert expand([Entry(1, 0, "x"), Entry(1, 0, "y")]) == [("stat", "x"), ("stat", "y")]
    assert expand([]) == []


# --- failures -------------------------------------------------------------------------------

def test_a_failing_write_is_retried_and_written_once(make_writer):
    sink = Sink(fail_times=2)
    writer = make_writer(sink, interval=0.02)
    for n in range(10):
        writer.put(n)       # queued before start: one batch
    writer.start()
    assert wait_for(lambda: writer.written == 10, timeout=3.0)
    assert sink.calls == 3
    assert sink.batches == [list(range(10))]
    assert writer.failed_batches == 0 and writer.dropped == 0


def test_a_batch_that_keeps_failing_is_dropped_and_the_writer_goes_on(make_writer):
    sink = Sink()
    sink.fail_always = True
    writer = make_writer(sink, interval=0.02)
    for n in range(10):
        writer.put(n)
    writer.start()
    assert wait_for(lambda: writer.dropped == 10, timeout=3.0)
    # Three attempts, then each entry once alone before it is given up.
    assert sink.calls == 3 + 10 and writer.failed_batches == 1
    assert writer.dropped == 10 and writer.written == 0 and sink.batches == []
    sink.fail_always = False                     # the database is back
    for n in range(10, 15):
        writer.put(n)
    assert wait_for(lambda: writer.written == 5, timeout=2.0)
    writer.stop()
    assert sink.items == list(range(10, 15))
    assert writer.failed_batches == 1 and writer.dropped == 10


def test_an_entry_that_can_never_be_written_costs_only_itself(make_writer):
    # Security review, session 16: a compromised worker's error line of
    # 2**64-1 made SQLite refuse the batch, and the whole batch - other
    # guilds' history and statistics - was dropped after three attempts.
    sink = Sink()
    sink.poison = {4}
    writer = make_writer(sink, interval=0.02)
    for n in range(10):
        writer.put(n)
    writer.start()
    assert wait_for(lambda: writer.written == 9, timeout=3.0)
    writer.stop()
    assert sorted(sink.items) == [n for n in range(10) if n != 4]
    assert writer.dropped == 1 and writer.failed_batches == 1


def test_while_the_database_is_unreachable_records_wait_and_are_written_once_in_order(
        make_writer, caplog):
    sink = Sink()
    sink.error = OperationalError          # what peewee raises when the server is gone
    sink.fail_always = True
    writer = make_writer(sink, interval=0.02, max_batch=7)
    writer.start()
    with caplog.at_level(logging.WARNING, logger="logic.records"):
        for n in range(50):
            writer.put(n)
        assert wait_for(lambda: sink.calls >= 4, timeout=10.0)   # retried while down
        assert writer.database_down
        assert writer.pending == 50 and writer.written == 0 and writer.dropped == 0
        sink.fail_always = False                                 # the database is back
        assert wait_for(lambda: writer.written == 50, timeout=10.0)
    assert sink.items == list(range(50))                         # in order, each once
    assert not writer.database_down and writer.pending == 0 and writer.failed_batches == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("database is unreachable" in m for m in messages) == 1
    assert sum("reachable again" in m for m in messages) == 1


def test_a_full_sqlite_file_is_named_as_such_and_records_wait_for_room(make_writer, caplog,
                                                                       tmp_path):
    # Before, a full disk was logged as "the database is unreachable
    # (OperationalError)": nothing said what to do. A real SQLite file that
    # may not grow past its pages answers what a full disk does.
    from peewee import SqliteDatabase
    db = SqliteDatabase(str(tmp_path / "full.db"))
    db.execute_sql("CREATE TABLE t (v TEXT)")
    room = {"pages": 2}

    def write(items: Sequence[Any]) -> None:
        db.execute_sql(f"PRAGMA max_page_count = {room['pages']}")
        with db.atomic():
            for item in items:
                db.execute_sql("INSERT INTO t VALUES (?)", (str(item) * 2000,))

    writer = make_writer(write, interval=0.02, max_batch=5)
    with caplog.at_level(logging.WARNING, logger="logic.records"):
        writer.start()
        for n in range(20):
            writer.put(n)
        assert wait_for(lambda: writer.database_down, timeout=10.0)
        assert writer.pending == 20 and writer.dropped == 0
        room["pages"] = 10_000                  # space freed
        assert wait_for(lambda: writer.written == 20, timeout=10.0)
        writer.stop(timeout=5)
    assert db.execute_sql("SELECT COUNT(*) FROM t").fetchone() == (20,)
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split(":")[0] for m in messages] == [
        "writing records to the database fails (database or disk is full)",
        "writing records works again after " + messages[1].split("after ")[1].split(":")[0]]
    assert not any("unreachable" in m for m in messages)


def test_past_the_bound_while_down_records_are_dropped_counted_and_logged_once(
        make_writer, caplog):
    sink = Sink()
    sink.error = InterfaceError
    sink.fail_always = True
    writer = make_writer(sink, interval=0.02, max_queued=10)
    writer.start()
    with caplog.at_level(logging.WARNING, logger="logic.records"):
        for n in range(10):
            writer.put(n)
        assert wait_for(lambda: writer.database_down, timeout=10.0)
        for n in range(10, 25):
            writer.put(n)
        assert writer.dropped == 15 and writer.pending == 10
        sink.fail_always = False
        assert wait_for(lambda: writer.written == 10, timeout=10.0)
    assert sink.items == list(range(10))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("buffer is full" in m for m in messages) == 1
    assert any("15 dropped while the buffer was full" in m for m in messages)


def test_the_batch_being_written_counts_towards_the_bound(make_writer):
    """While a batch is in the database's hands it is neither queued nor held:
    the bound still counts it, so the write that finds the database down never
    leaves more than `max_queued` entries in memory."""
    inside, release = threading.Event(), threading.Event()
    sink = Sink()
    sink.error = InterfaceError

    def slow_down(items: Sequence[Any]) -> None:
        inside.set()
        release.wait(10.0)
        sink.fail_always = True       # the database went away during this write
        sink(items)

    writer = make_writer(slow_down, interval=0.02, max_queued=10)
    for n in range(10):
        writer.put(n)
    writer.start()
    assert inside.wait(10.0)          # all ten are being written
    for n in range(10, 25):
        writer.put(n)
    assert writer.pending == 10 and writer.dropped == 15
    release.set()
    # (The failed batch is held a moment after `database_down` turns true.)
    assert wait_for(lambda: writer.database_down and writer.pending == 10, timeout=10.0)
    assert writer.dropped == 15


# --- back-pressure --------------------------------------------------------------------------

def test_max_queued_drops_and_counts_the_excess(make_writer):
    sink = Sink()
    writer = make_writer(sink, interval=10.0, max_queued=10)
    for n in range(15):         # thread not started: nothing is taken off the queue
        writer.put(n)
    assert writer.dropped == 5
    writer.start()
    writer.stop()
    assert sink.items == list(range(10))   # the first max_queued were kept
    assert writer.written == 10 and writer.dropped == 5


# --- waiting for what was queued (test calls) -------------------------------------------------

def test_written_waits_for_what_was_queued_and_wakes_the_writer(make_writer):
    import asyncio

    from service.http.write_barrier import written

    sink = Sink()
    writer = make_writer(sink, interval=30.0)   # without the wake-up: 30 s
    writer.start()

    async def scenario() -> tuple[bool, float, list[Any]]:
        for n in range(50):
            writer.put(n)
        started = time.monotonic()
        ok = await written(writer)
        return ok, time.monotonic() - started, sink.items
    ok, took, items = asyncio.run(scenario())
    assert ok and took < 1.5 and items == list(range(50))
    assert writer.written == 50 and writer.pending == 0   # the barrier is no record


def test_written_gives_up_while_the_database_is_down_and_at_stop(make_writer):
    import asyncio

    from service.http.write_barrier import written

    sink = Sink()
    sink.error = OperationalError
    sink.fail_always = True
    writer = make_writer(sink, interval=0.05)
    writer.start()

    async def scenario() -> tuple[bool, float]:
        writer.put(1)
        first = await written(writer, timeout=1.0)   # the write fails: held, not written
        assert wait_for(lambda: writer.database_down, timeout=2.0)
        started = time.monotonic()
        second = await written(writer)               # known down: no wait at all
        return first or second, time.monotonic() - started
    ok, took = asyncio.run(scenario())
    assert not ok and took < 0.1
    sink.fail_always = False
    assert wait_for(lambda: sink.items == [1], timeout=5.0)
