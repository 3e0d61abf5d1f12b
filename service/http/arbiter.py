"""The arbiter: N front processes on one port (`server.processes` > 1), supervised.

In the manner of gunicorn's arbiter and uvicorn's multiprocess supervisor:
signal handlers only queue the signal and the main loop handles it
(`handle_<name>`); each pass reaps dead fronts and starts replacements.

- The arbiter binds one listening socket per front slot, all on the same port
  with SO_REUSEPORT (the kernel spreads connections over them), and keeps
  them open for its whole life: front N serves slot N's socket. Connections
  that arrive while a front is being replaced wait in its socket's backlog
  for the replacement instead of being refused, and during a reload the new
  and the old front of a slot accept from the same socket until the old one
  stops.
- Nothing with a thread or an event loop exists in the arbiter (tornado's
  process.py rule): each front, after the fork, opens its database
  connection and journal, starts its sandbox pool, then its loop.
- The records journal: front N writes DIR/front-N; a replacement takes the
  dead front's number and replays what it left at start-up. The arbiter
  replays every journal at its own start.
- Rate limits on `memory://` storage live in shared memory
  (`service.http.shared_windows`), created here before the first fork.
- A per-run directory (removed at exit) holds the windows' lock file and
  `metrics/`, exported as PROMETHEUS_MULTIPROC_DIR unless already set; a dead
  front's live-gauge files are removed with prometheus-client's
  `mark_process_dead` when it is installed.

Signals: SIGTERM/SIGINT drain every front (each does the single process's
graceful stop) and exit; SIGHUP re-reads the configuration, starts a new set
of fronts, waits until they listen, then drains the old set; SIGCHLD reaps.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib
import logging
import os
import select
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from tornado.netutil import bind_sockets

from models.migrate import SchemaBehindError
from service.http.journal import JournalInUse
from service.http.server import (FRONT_JOURNAL, HANDOFF_SIGNAL, journal_path, open_front,
                                 run_front)
from service.http.shared_windows import SharedWindows
from service.settings import Settings, SettingsError

log = logging.getLogger("logic.arbiter")

#: A front that exits with this code could not start (bad database, journal in use).
EXIT_BOOT = 3
#: A front that dies sooner than this after its start counts towards the back-off.
QUICK_DEATH_S = 30.0
#: Longest wait before replacing a front that keeps dying.
MAX_BACKOFF_S = 30.0
#: How long new fronts may take to listen, at start or on a reload.
BOOT_TIMEOUT_S = 120.0
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)


class FrontStartError(RuntimeError):
    """The front processes could not start (the reason is in the lines logged before)."""


@dataclass
class Front:
    """One front process as the arbiter sees it."""

    pid: int
    slot: int
    journal: int                  # DIR/front-<journal>
    generation: int
    ready_fd: int                 # read end of the pipe the front writes to when it listens
    started: float
    ready: bool = False
    retiring: bool = False


@dataclass
class _Slot:
    sockets: list[socket.socket]
    quick_deaths: int = 0
    respawn_at: float | None = None


class Arbiter:
    """Supervises `settings.server.process_count` fronts until SIGTERM/SIGINT."""

    def __init__(self, settings: Settings, reload: Callable[[], Settings] | None = None,
                 drain_seconds: float = 30.0) -> None:
        self.settings = settings
        self.reload = reload
        self.drain_seconds = drain_seconds
        self.count = settings.server.process_count
        self.fronts: dict[int, Front] = {}
        self.slots: list[_Slot] = []
        self.port = 0
        self.generation = 0
        self.pending: int | None = None     # generation being started by a reload
        self.pending_since = 0.0
        self.new_settings = settings
        self.booted = False
        self.stopping = False
        self.stop_deadline = 0.0
        self.respawn_journal: dict[int, int] = {}   # slot -> journal of its dead front
        self.windows: SharedWindows | None = None
        self.run_dir = ""
        self.queue: list[int] = []
        self.wake_r = self.wake_w = -1

    def run(self) -> None:
        """Start the fronts and supervise them; returns after a graceful stop.

        Raises `OSError` when the address cannot be bound, `SchemaBehindError`,
        `JournalInUse`, `FrontStartError` when the fronts cannot start.
        """
        database, journal = open_front(self.settings, journal_path(self.settings),
                                       check_schema=True)
        if journal is not None:
            journal.close()
        database.close()
        self.run_dir = tempfile.mkdtemp(prefix="logic-run-")
        try:
            self._bind()
            self.windows = (SharedWindows(os.path.join(self.run_dir, "ratelimit.lock"))
                            if self.settings.ratelimit.storage.startswith("memory://") else None)
            metrics = os.path.join(self.run_dir, "metrics")
            os.mkdir(metrics, 0o700)
            os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", metrics)
            self._install_signals()
            for slot in range(self.count):
                self._spawn(slot, self.generation, journal=slot)
            self._await_boot(self.generation)
            log.info("fronts ready: %d front processes (pids %s) on http://%s:%d",
                     self.count, " ".join(str(f.pid) for f in self._live(self.generation)),
                     self.settings.server.host, self.port)
            self._loop()
        finally:
            self._kill_all()
            for entry in self.slots:
                for sock in entry.sockets:
                    sock.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # ------------------------------------------------------------ set-up

    def _bind(self) -> None:
        server = self.settings.server
        first = bind_sockets(server.port, server.host, family=socket.AF_UNSPEC, reuse_port=True)
        self.port = first[0].getsockname()[1]
        self.slots = [_Slot(first)]
        for _ in range(1, self.count):
            self.slots.append(_Slot(bind_sockets(self.port, server.host, family=socket.AF_UNSPEC,
                                                 reuse_port=True)))

    def _install_signals(self) -> None:
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        for sig in SIGNALS:
            signal.signal(sig, self._queue_signal)

    def _queue_signal(self, signum: int, frame: object) -> None:
        if len(self.queue) < 16:
            self.queue.append(signum)

    # ------------------------------------------------------------ fronts

    def _spawn(self, slot: int, generation: int, journal: int,
               settings: Settings | None = None) -> None:
        settings = settings or self.settings
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:  # the front: never returns
            code = 1
            try:
                os.close(ready_r)
                code = self._front_main(settings, slot, journal, ready_w)
            except BaseException:  # noqa: BLE001 - the front's last word, then exit
                log.exception("front %d failed", slot)
            finally:
                logging.shutdown()
                os._exit(code)
        os.close(ready_w)
        self.fronts[pid] = Front(pid, slot, journal, generation, ready_r, time.monotonic())

    def _front_main(self, settings: Settings, slot: int, journal: int, ready_w: int) -> int:
        """Runs in the forked front: its journal, pool and loop; returns the exit code."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, HANDOFF_SIGNAL):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # reloads are the arbiter's
        os.close(self.wake_r)
        os.close(self.wake_w)
        for other in self.fronts.values():
            os.close(other.ready_fd)
        own = self.slots[slot].sockets
        for index, entry in enumerate(self.slots):
            if index != slot:
                for sock in entry.sockets:
                    sock.close()
        try:
            directory = os.path.join(journal_path(settings), f"{FRONT_JOURNAL}{journal}")
            database, front_journal = open_front(settings, directory, check_schema=False)
        except (JournalInUse, SchemaBehindError, OSError) as err:
            log.error("front %d cannot start: %s", slot, err)
            return EXIT_BOOT
        if self.windows is not None:
            self.windows.attach()

        def ready() -> None:
            os.write(ready_w, b"1")
            os.close(ready_w)

        run_front(settings, database, own, front_journal, self.drain_seconds,
                  windows=self.windows, on_ready=ready)
        return 0

    def _live(self, generation: int) -> list[Front]:
        return [f for f in self.fronts.values() if f.generation == generation and not f.retiring]

    def _await_boot(self, generation: int) -> None:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while not all(f.ready for f in self._live(generation)) or \
                len(self._live(generation)) < self.count:
            if time.monotonic() > deadline:
                raise FrontStartError("the front processes did not start in time")
            self._wait(1.0)
            self._reap()
            if self.stopping or self.queue and any(s in (signal.SIGTERM, signal.SIGINT)
                                                   for s in self.queue):
                raise FrontStartError("stopped while the front processes were starting")
            if len(self._live(generation)) < self.count:
                raise FrontStartError("a front process could not start; see the lines above")

    def _wait(self, timeout: float) -> None:
        """Sleep until a signal, a front's readiness, or `timeout`."""
        waiting = {f.ready_fd: f for f in self.fronts.values() if not f.ready}
        try:
            readable, _, _ = select.select([self.wake_r, *waiting], [], [], timeout)
        except InterruptedError:
            return
        for fd in readable:
            if fd == self.wake_r:
                try:
                    while os.read(self.wake_r, 64):
                        pass
                except BlockingIOError:
                    pass
            elif fd in waiting:
                front = waiting[fd]
                front.ready = os.read(fd, 1) == b"1"
                if front.ready:
                    log.info("front %d (pid %d) listening", front.slot, front.pid)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            front = self.fronts.pop(pid, None)
            if front is None:
                continue
            os.close(front.ready_fd)
            self._front_gone(front, status)

    def _front_gone(self, front: Front, status: int) -> None:
        try:  # the front's live gauges end with it (prometheus-client's multiprocess mode)
            importlib.import_module("prometheus_client.multiprocess").mark_process_dead(front.pid)
        except (ImportError, KeyError, OSError):  # not installed, or no multiprocess dir
            pass
        if front.retiring or self.stopping:
            log.info("front %d (pid %d) stopped", front.slot, front.pid)
            return
        how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
               else f"exit code {os.WEXITSTATUS(status)}")
        if front.generation == self.pending:
            log.error("front %d (pid %d) of the reload died (%s); keeping the running fronts",
                      front.slot, front.pid, how)
            self._abort_reload()
            return
        if front.generation != self.generation:
            return
        if not self.booted:
            return  # a start-up failure: `_await_boot` stops the arbiter
        slot = self.slots[front.slot]
        slot.quick_deaths = (slot.quick_deaths + 1
                             if time.monotonic() - front.started < QUICK_DEATH_S else 0)
        # The first death is replaced at once; each further quick one waits twice as long.
        delay = (min(MAX_BACKOFF_S, 0.5 * 2 ** (slot.quick_deaths - 1))
                 if slot.quick_deaths > 1 else 0.0)
        log.warning("front %d (pid %d) died (%s), replacing%s", front.slot, front.pid, how,
                    f" in {delay:.1f} s" if delay else "")
        slot.respawn_at = time.monotonic() + delay
        self.respawn_journal[front.slot] = front.journal

    def _maintain(self) -> None:
        """Start the replacements that are due."""
        now = time.monotonic()
        for index, slot in enumerate(self.slots):
            if slot.respawn_at is not None and slot.respawn_at <= now:
                slot.respawn_at = None
                journal = self.respawn_journal.pop(index, index)
                self._spawn(index, self.generation, journal)

    # ------------------------------------------------------------ main loop

    def _loop(self) -> None:
        self.booted = True
        while True:
            while self.queue:
                signum = self.queue.pop(0)
                name = signal.Signals(signum).name[3:].lower()
                getattr(self, f"handle_{name}")()
            if self.stopping:
                if not self.fronts:
                    log.info("stopped: every front drained")
                    return
                if time.monotonic() > self.stop_deadline:
                    log.warning("fronts still running after the drain time; killing them")
                    self._kill_all()
                    return
            self._wait(0.5)
            self._reap()
            if not self.stopping:
                self._maintain()
                self._check_reload()

    def handle_chld(self) -> None:
        self._reap()

    def handle_term(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.stop_deadline = time.monotonic() + self.drain_seconds + 15
        log.info("stopping: draining %d fronts", len(self.fronts))
        for front in self.fronts.values():
            self._signal(front.pid, signal.SIGTERM)

    handle_int = handle_term

    def handle_hup(self) -> None:
        if self.pending is not None:
            log.warning("reload already in progress; SIGHUP ignored")
            return
        if self.reload is None:
            log.warning("no configuration to reload; SIGHUP ignored")
            return
        try:
            fresh = self.reload()
        except SettingsError as err:
            log.error("reload failed, keeping the running fronts: %s", err)
            return
        old, new = self.settings.server, fresh.server
        kept = {k: getattr(old, k) for k in ("host", "port", "processes")}
        if any(getattr(new, k) != v for k, v in kept.items()):
            log.warning("server.host, server.port and server.processes change only on a "
                        "restart; kept %s:%d with %d fronts", old.host, old.port, self.count)
        self.new_settings = dataclasses.replace(fresh, server=dataclasses.replace(new, **kept))
        self.pending = self.generation + 1
        self.pending_since = time.monotonic()
        used = {f.journal for f in self.fronts.values()}
        free = (n for n in range(2 * self.count + len(used)) if n not in used)
        log.info("reloading: starting %d new fronts", self.count)
        for slot in range(self.count):
            self._spawn(slot, self.pending, next(free), self.new_settings)

    def _check_reload(self) -> None:
        if self.pending is None:
            return
        fresh = self._live(self.pending)
        if len(fresh) == self.count and all(f.ready for f in fresh):
            old = [f for f in self.fronts.values() if f.generation != self.pending]
            self.settings, self.generation, self.pending = self.new_settings, self.pending, None
            for slot in self.slots:
                slot.respawn_at, slot.quick_deaths = None, 0
            log.info("reloaded: %d new fronts ready (pids %s); handing over from %d old ones",
                     len(fresh), " ".join(str(f.pid) for f in fresh), len(old))
            for front in old:
                front.retiring = True
                self._signal(front.pid, HANDOFF_SIGNAL)
        elif time.monotonic() - self.pending_since > BOOT_TIMEOUT_S:
            log.error("reload: the new fronts did not start in time; keeping the running fronts")
            self._abort_reload()

    def _abort_reload(self) -> None:
        for front in self.fronts.values():
            if front.generation == self.pending:
                front.retiring = True
                self._signal(front.pid, signal.SIGKILL)
        self.pending = None

    def _signal(self, pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except OSError as err:
            if err.errno != errno.ESRCH:
                raise

    def _kill_all(self) -> None:
        """SIGKILL whatever is left and reap it (the end of a failed start or a stop)."""
        for pid in list(self.fronts):
            self._signal(pid, signal.SIGKILL)
        for pid in list(self.fronts):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            front = self.fronts.pop(pid)
            os.close(front.ready_fd)

