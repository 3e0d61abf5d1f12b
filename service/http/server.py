"""Running the service: start the sandbox pool, serve HTTP, drain and stop on a signal.

Order matters (see tornado/process.py and gunicorn's arbiter): the pool forks
before the event loop or any thread exists; then the loop, the argon2 thread
pool and the record writer start. On SIGTERM or SIGINT the listener closes,
requests in flight finish (up to `drain_seconds`), queued records are written,
and the pool stops gracefully.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

from peewee import Database
from tornado.netutil import bind_sockets

from models.change_feed import CHANNEL, TOKENS_CHANNEL, ChangeFeed
from models.db import is_postgres
from models.db_watch import DeadlineWatch
from sandbox.hardening import make_undumpable
from sandbox.budget import WORKER_FDS
from sandbox.pool import Pool
from service.http.app import make_app
from service.http.auth import SecretVerifier
from service.http.base import render_connection_error
from service.http.context import AppContext
from service.http.deadlines import quiet
from service.http.listener import HTTP1Server, ServerLimits
from service.http.invoke import INVOKE_METHODS, PREFIX, InvokeEndpoint
from service.http.memory_windows import MemoryWindows
from service.http.priority import background_executor
from service.http.ratelimit import RateLimits
from service.http.journal import Journal
from service.http.journal_replay import replay_journal
from service.http.record_outage import SERVER_MARGIN_S, WRITE_TIMEOUT_S
from service.http.records import RecordWriter
from service.settings import Settings

log = logging.getLogger("logic.server")

#: The arbiter's request to a front to hand its port over (a reload) and stop.
HANDOFF_SIGNAL = signal.SIGUSR2
#: How long a front handing over still answers requests on its open connections.
HANDOFF_GRACE_S = 5.0

#: Descriptors never used for client connections (plus 8 per sandbox worker).
FD_RESERVE = 256


def serve(settings: Settings, *, drain_seconds: float = 30.0,
          reload: Callable[[], Settings] | None = None, run_dir: str | None = None) -> None:
    """Run the service until SIGTERM/SIGINT; blocks.

    `server.processes` > 1 runs the fronts under an arbiter
    (`service.http.arbiter`; `reload` re-reads the configuration on SIGHUP;
    `run_dir` from `service.http.run_dir`, else the arbiter makes one).
    Raises `SchemaBehindError` for a database that is behind, `OSError` when
    the address cannot be bound.
    """
    if settings.server.process_count > 1:
        from service.http.arbiter import Arbiter

        Arbiter(settings, reload=reload, drain_seconds=drain_seconds, run_dir=run_dir).run()
        return
    # One process has no arbiter to start new fronts: a SIGHUP (`systemctl
    # reload`) must not end it undrained (the default action). A handler, not
    # SIG_IGN: the sandbox's processes reset handlers (an ignored signal would
    # stay ignored in them, across exec too); the loop's replaces it (`_run`).
    signal.signal(signal.SIGHUP, _sighup_ignored)
    database, journal = open_front(settings, journal_path(settings), check_schema=True)
    # Bind first, so a taken port fails before anything is forked. The fork
    # server and the workers close every inherited descriptor but their channel.
    sockets = bind_sockets(settings.server.port, settings.server.host, family=socket.AF_UNSPEC)
    run_front(settings, database, sockets, journal, drain_seconds)


def _sighup_ignored(signum: int, frame: Any) -> None:
    log.warning("SIGHUP ignored: a reload needs server.processes above 1; restart to apply "
                "a changed configuration")


#: The SQLite file (device, inode) each database URL named when the first
#: process of this start opened it (inherited by the fronts it forks).
_FILE_IDENTITY: dict[str, tuple[int, int]] = {}


def open_front(settings: Settings, journal_dir: str | None, *,
               check_schema: bool) -> tuple[Database, Journal | None]:
    """Connect, check the schema, open the records journal and replay what a
    crashed process left in it; the connection is closed again (the loop
    thread and the writer thread each open their own). With `check_schema`
    (the first process of a start), the journals of earlier front processes
    (`front-N` beside the segments) are replayed too.

    Raises `SchemaBehindError`, `JournalInUse`.
    """
    from models.db import connect
    from models.installation import installation_id
    from models.migrate import Runner
    from service.http.journal_owner import bind_to_installation

    # Never makes a SQLite file: one removed while the service runs is an
    # error on the next connection, not a new empty database. A front forked
    # later (a replacement, a reload) knows the file the first process
    # opened, and refuses another one put in its place meanwhile.
    url = settings.database.url
    database = connect(url, create=False, identity=_FILE_IDENTITY.get(url))
    if check_schema:
        Runner(database).check()  # refuses a database that is behind (SchemaBehindError)
        identity = getattr(database, "identity", None)
        if identity is not None:
            _FILE_IDENTITY[url] = identity
    journal = None
    if settings.records.journal != "off" and journal_dir is not None:
        journal = Journal(journal_dir, fsync=settings.records.fsync)
        if check_schema:   # the first process of a start: no front journals in use
            bind_to_installation(journal.directory, installation_id())
        replay_journal(journal)  # records a crashed process answered but had not written
        if check_schema:
            for sub in sorted(journal.directory.glob(f"{FRONT_JOURNAL}*")):
                front = Journal(sub, fsync=False)
                replay_journal(front)
                front.close()
        journal.begin()
    database.close()
    return database, journal


def run_front(settings: Settings, database: Database, sockets: list[socket.socket],
              journal: Journal | None, drain_seconds: float, *,
              windows: MemoryWindows | None = None, on_ready: Callable[[], None] | None = None) -> None:
    """Start the sandbox pool, then serve on `sockets` until SIGTERM/SIGINT (one front)."""
    if os.geteuid() != 0:
        # Without root the workers keep the service's uid: make the service's
        # /proc/<pid>/mem and environ unreadable to them (docs/security.md).
        ok, why = make_undumpable()
        if not ok:
            log.warning("could not make the service undumpable: %s", why)
    box = settings.sandbox
    pool = Pool(size=box.workers, queue_timeout_ms=box.queue_timeout_ms,
                max_workers=box.max_workers or None, guild_share=box.guild_share,
                guild_budget_s=box.guild_budget_s, memory_budget_mb=box.memory_budget_mb or None,
                idle_retire_s=box.idle_retire_s)
    pool.start()  # forks; logs every isolation layer this host cannot provide
    try:
        _event_loop_runner()(_run(settings, pool, database, sockets, drain_seconds, journal,
                                  windows=windows, on_ready=on_ready))
    finally:
        database.close()


async def _run(settings: Settings, pool: Pool, db: Database, sockets: list[socket.socket],
               drain_seconds: float, journal: Journal | None = None, *,
               windows: MemoryWindows | None = None,
               on_ready: Callable[[], None] | None = None) -> None:
    from models.installation import installation_id
    from service.core import journal_marks
    from service.core.invoke_target import TargetCache
    from service.core.records import write_batch
    from service.core.secrets import configure, upgrade_secret_hash, verify_secret

    configure(settings.server.cookie_secret)   # the secrets' keyed verifier
    # Shared Redis windows are named after the installation (none in memory://).
    installation = ""
    if not settings.ratelimit.storage.startswith("memory://"):
        with db.connection_context():   # this thread keeps no connection for it
            installation = installation_id()

    # PostgreSQL: a LISTEN connection lets the endpoint lookup cache (SQLite
    # has PRAGMA data_version instead); started after the pool's fork.
    feed = (ChangeFeed.for_database(db, channels=(CHANNEL, TOKENS_CHANNEL)).start()
            if is_postgres(db) else None)

    # Below the loop's priority: a flood of unknown secrets takes only CPU
    # the loop does not want, so it cannot slow authenticated requests.
    executor = background_executor(2, "logic-argon2")
    # A SQLite file replaced while serving: models.db refuses every write
    # (the writer holds its records, as for an unreachable database).
    replaced = getattr(db, "file_replaced", None)
    # PostgreSQL: every statement of the writer's thread is bounded (service.http.record_outage).
    watch = (DeadlineWatch(WRITE_TIMEOUT_S, WRITE_TIMEOUT_S + SERVER_MARGIN_S,
                           name="logic-records-watch") if hasattr(db, "watch_thread") else None)

    def writer_started() -> None:
        if watch is not None:
            db.watch_thread(watch)  # type: ignore[attr-defined]
        db.connect(reuse_if_open=True)

    def writer_stopped() -> None:
        db.close()
        if watch is not None:
            watch.detach()
            watch.close()

    records = RecordWriter(
        write_batch,
        on_thread_start=writer_started,
        on_thread_stop=writer_stopped,
        journal=journal,
        forget_run=lambda run: journal_marks.forget([run]),
    )
    records.start()

    ping_state = {"replaced": False}

    def db_ping() -> bool:
        if replaced is not None and replaced():
            # Not ready, said once per episode (docs/deployment.md: stop the
            # node before putting a file in place).
            if not ping_state["replaced"]:
                ping_state["replaced"] = True
                log.error("the database file %s was removed or replaced while the service "
                          "ran: not ready; stop the service before putting the right file "
                          "in place", db.database)
            return False
        if ping_state["replaced"]:
            ping_state["replaced"] = False
            log.warning("the database file %s is the one the service opened again: ready",
                        db.database)
        try:
            db.execute_sql("SELECT 1")  # type: ignore[no-untyped-call]
        except Exception:  # noqa: BLE001 - any failure means "not ready"
            return False
        return True

    context = AppContext(
        settings=settings,
        pool=pool,
        limits=RateLimits(settings.ratelimit.storage, ipv6_prefix=settings.ratelimit.ipv6_prefix,
                          on_storage_error=settings.ratelimit.on_storage_error,
                          storage_timeout_s=settings.ratelimit.storage_timeout_ms / 1000,
                          windows=windows, installation=installation),
        verifier=SecretVerifier(verify_secret, executor, workers=2,
                                max_pending=settings.ratelimit.auth_queue,
                                per_endpoint=settings.ratelimit.auth_queue_per_endpoint,
                                upgrade=upgrade_secret_hash),
        records=records,
        load_target=TargetCache(settings.plans, feed=feed,
                                outage_serve_s=settings.database.outage_serve_s),
        change_feed=feed,
        db_ping=db_ping,
    )
    max_body = max((p.body_bytes for p in settings.plans.values()), default=0) + 1
    app = make_app(context)
    server = HTTP1Server(app, prefixes=[(PREFIX, InvokeEndpoint(context))],
                         limits=ServerLimits(max_body_bytes=max_body, idle_timeout=60,
                                             body_timeout=30,
                                             max_pipelined=settings.server.max_pipelined,
                                             write_high_water=settings.server.write_buffer_bytes,
                                             socket_send_buffer=(
                                                 settings.server.socket_send_buffer_bytes),
                                             socket_receive_buffer=(
                                                 settings.server.socket_receive_buffer_bytes),
                                             buffer_budget_bytes=(
                                                 settings.server.buffer_budget_bytes)),
                         render_error=context.metrics.counting(render_connection_error),
                         max_connections=settings.server.max_connections,
                         max_connections_per_ip=settings.server.max_connections_per_ip,
                         # Descriptors kept free for the pool (a worker's pipes
                         # and socket on respawn), the database and the log.
                         fd_reserve=(FD_RESERVE + 8 * settings.sandbox.worker_count
                                     + WORKER_FDS * (pool.max_workers + 1)),
                         cap_exempt=settings.server.trusted_proxies,
                         ipv6_prefix=settings.ratelimit.ipv6_prefix,
                         methods_for=lambda target: (
                             INVOKE_METHODS if urlsplit(target).path.startswith(PREFIX)
                             else app.methods_for(target)))
    await server.add_sockets(sockets)
    port = sockets[0].getsockname()[1]
    log.info("listening on http://%s:%d (%d sandbox workers, %s event loop, "
             "at most %d connections)", settings.server.host, port, pool.live_workers,
             type(asyncio.get_running_loop()).__module__.split(".")[0], server.max_connections)

    pool.attach()  # watch the workers from the loop now, not at the first request
    context.metrics_export.start()  # multiprocess mode: this front's values, every second
    _tune_gc()
    stop = asyncio.Event()
    handoff = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_ready is None:
        loop.add_signal_handler(signal.SIGHUP, _sighup_ignored, signal.SIGHUP, None)
    else:  # a front under the arbiter (service.http.arbiter)
        def hand_over() -> None:
            handoff.set()
            stop.set()

        loop.add_signal_handler(HANDOFF_SIGNAL, hand_over)
        on_ready()
    await stop.wait()

    if handoff.is_set():
        # A reload: the new fronts accept on the same sockets already. Answer
        # what arrives on the connections this front holds (a client may have
        # just connected), each answer closing its connection, then drain.
        log.info("handing over: %d connections open", len(server.connections))
        server.stop()
        for conn in list(server.connections):
            conn.closing = True
        deadline = loop.time() + HANDOFF_GRACE_S
        while server.connections and loop.time() < deadline:
            await asyncio.sleep(0.05)
        # Quiet past the grace (nothing served, nothing of an answer unread,
        # nothing of a request unread): closed, not left open into the drain,
        # where a request on them would be refused 503 while the new fronts
        # serve (review, session 30); the client's next request goes to a new
        # front. One still taking its answers is left to finish them.
        for conn in list(server.connections):
            if quiet(conn):
                conn.close_now()
        # The others hold a request still arriving (its head began within the
        # grace: answered, not refused 503 as by a node shutting down; red
        # team, session 35) or an answer still being taken. Each closes after
        # its answer; the connection deadlines bound how long a client takes.
        drain_end = loop.time() + drain_seconds
        while server.connections and loop.time() < drain_end:
            await asyncio.sleep(0.05)
        drain_seconds = max(0.0, drain_end - loop.time())

    log.info("stopping: draining %d requests in flight", context.in_flight)
    context.draining = True
    server.stop()
    if not await context.wait_idle(drain_seconds):
        log.warning("drain timed out with %d requests in flight", context.in_flight)
    await server.close_all_connections()
    await loop.run_in_executor(None, records.stop)
    await pool.stop()
    await context.limits.close()
    context.metrics_export.stop()
    executor.shutdown(wait=False)
    context.load_target.close()
    if feed is not None:
        feed.stop()
    # Every record this process did not write is counted: dropped, or kept by the journal.
    log.info("stopped: %d records written, %d dropped%s (%d failed batches)", records.written,
             records.dropped, f", {records.kept} kept in the journal" if records.kept else "",
             records.failed_batches)


#: Front process N of `server.processes` > 1 journals in DIR/front-N.
FRONT_JOURNAL = "front-"


def journal_path(settings: Settings) -> str:
    """`records.journal`, or beside a SQLite file (`FILE.records-journal`), or
    ./logic-journal (`off`: none)."""
    if settings.records.journal:
        return settings.records.journal
    url = settings.database.url
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        # Not "-journal": that is SQLite's own rollback journal file.
        return url[len("sqlite:///"):].split("?", 1)[0] + ".records-journal"
    return "logic-journal"


def _event_loop_runner() -> Callable[[Coroutine[Any, Any, None]], None]:
    """`uvloop.run` where uvloop is installed (Linux, macOS), else `asyncio.run`.

    uvloop's transports and loop are written in C on libuv: on the invoke
    path they cost ~10-15 % less CPU per request than the standard loop
    (docs/performance.md). Tornado and the sandbox pool run on either.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


#: Collector thresholds while serving (Python's defaults: 700, 10, 10).
GC_THRESHOLDS = (10_000, 20, 100)


def _tune_gc() -> None:
    """Keep the cyclic garbage collector from pausing the event loop.

    Start-up objects (modules, the app, settings) never become garbage:
    `gc.freeze()` takes them out of every collection. The request path makes
    no reference cycles (connections and handlers drop their links when an
    answer is done), so collections are made rarer: with the defaults, the
    records waiting for the writer (~0.25 s of requests) kept triggering full
    collections of 20-90 ms, the service's p99 latency (docs/performance.md).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
