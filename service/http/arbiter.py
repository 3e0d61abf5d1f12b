"""The arbiter: N front processes on one port (`server.processes` > 1), supervised.

As gunicorn's arbiter: handlers only queue signals, the main loop calls `handle_<name>`;
each pass reaps dead fronts and respawns one per slot (backing off while they die).

- One SO_REUSEPORT listening socket per front slot, bound here and kept open
  until SIGTERM: a replacement or reloaded front accepts from its predecessor's.
- Nothing with a thread, event loop or database connection exists here when a
  front is forked (tornado's rule): it sets itself up after (`service.http.front`).
- Records journal: front N writes DIR/front-N; a dead front's journal goes to
  the next front started, which replays it; the arbiter replays all at start.
- `memory://` rate limits live in shared memory (`service.http.shared_windows`).
- The per-run directory (`service.http.run_dir`, removed at exit) holds
  `metrics/` (PROMETHEUS_MULTIPROC_DIR); a dead front's live gauges go with it.

Signals: SIGTERM/SIGINT drain every front, then exit; SIGHUP re-reads the config,
starts new fronts, and once all listen has the old ones hand over and stop
(`server.HANDOFF_SIGNAL`); SIGCHLD reaps.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import select
import shutil
import signal
import time
from collections.abc import Callable

from service.http.front import Front, Slot, front_main
from service.http.metrics import mark_front_dead, prepare_multiprocess_dir
from service.http.ports import bind_shared
from service.http.run_dir import METRICS_ENV, make_run_dir
from service.http.server import HANDOFF_SIGNAL, journal_path, open_front
from service.http.shared_windows import SharedWindows
from service.settings import Settings, SettingsError

log = logging.getLogger("logic.arbiter")

#: A front that dies sooner than this after its start counts towards the back-off.
QUICK_DEATH_S = 30.0
#: Longest wait before replacing a front that keeps dying.
MAX_BACKOFF_S = 30.0
#: How long new fronts may take to listen, at start or on a reload.
BOOT_TIMEOUT_S = 120.0
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)


class FrontStartError(RuntimeError):
    """The front processes could not start (the reason is in the lines logged before)."""


class Arbiter:
    """Supervises `settings.server.process_count` fronts until SIGTERM/SIGINT."""

    def __init__(self, settings: Settings, reload: Callable[[], Settings] | None = None,
                 drain_seconds: float = 30.0, run_dir: str | None = None) -> None:
        self.settings = settings
        self.reload = reload
        self.drain_seconds = drain_seconds
        self.count = settings.server.process_count
        self.fronts: dict[int, Front] = {}
        self.slots: list[Slot] = []
        self.port = 0
        self.generation = 0
        self.pending: int | None = None     # generation being started by a reload
        self.pending_since = 0.0
        self.new_settings = settings
        self.booted = False
        self.stopping = False
        self.stop_deadline = 0.0
        self.orphans: list[int] = []    # journals of fronts that died, not yet replayed
        self.windows: SharedWindows | None = None
        self.run_dir = run_dir or ""   # service.http.run_dir; removed at exit
        self.queue: list[int] = []
        self.wake_r = self.wake_w = -1
        self.pid = os.getpid()

    def run(self) -> None:
        """Start the fronts and supervise them; returns after a graceful stop.

        Raises `OSError` when the address cannot be bound, `SchemaBehindError`,
        `JournalInUse`, `FrontStartError` when the fronts cannot start.
        """
        self.run_dir = self.run_dir or make_run_dir()
        try:
            # Counters of an earlier run in an operator-chosen directory
            # would be added to this run's: start it empty.
            prepare_multiprocess_dir(os.environ.get(METRICS_ENV)
                                     or os.path.join(self.run_dir, "metrics"))
            database, journal = open_front(self.settings, journal_path(self.settings),
                                           check_schema=True)
            if journal is not None:
                journal.close()
            database.close()
            self._bind()
            # Made even for Redis storage: a reload may switch to memory://.
            self.windows = SharedWindows(fronts=self.count)
            self._install_signals()
            for slot in range(self.count):
                self._spawn(slot, self.generation, journal=slot)
            self._await_boot(self.generation)
            log.info("fronts ready: %d front processes (pids %s) on http://%s:%d; run "
                     "directory %s", self.count,
                     " ".join(str(f.pid) for f in self._live(self.generation)),
                     self.settings.server.host, self.port, self.run_dir)
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
        self.slots = [Slot(sockets) for sockets in bind_shared(server.host, server.port,
                                                                self.count)]
        self.port = self.slots[0].sockets[0].getsockname()[1]

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
        try:
            self.slots[slot].rejoin(self.settings.server.host, self.port)
        except OSError as err:
            log.warning("front %d: its listening socket cannot be made again (%s); "
                        "trying again in 1 s", slot, err.strerror)
            self.slots[slot].respawn_at = time.monotonic() + 1.0
            self.orphans.insert(0, journal)   # not used: the next spawn takes it
            return
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:  # the front: never returns
            code = 1
            try:
                os.close(ready_r)
                for fd in [self.wake_r, self.wake_w, *(f.ready_fd for f in self.fronts.values())]:
                    os.close(fd)
                for index, entry in enumerate(self.slots):
                    if index != slot:
                        for sock in entry.sockets:
                            sock.close()
                code = front_main(settings, slot, journal, self.slots[slot].sockets, ready_w,
                                  windows=self.windows, drain_seconds=self.drain_seconds,
                                  arbiter=self.pid)
            except BaseException:  # noqa: BLE001 - the front's last word, then exit
                log.exception("front %d failed", slot)
            finally:
                logging.shutdown()
                os._exit(code)
        os.close(ready_w)
        self.fronts[pid] = Front(pid, slot, journal, generation, ready_r, time.monotonic())

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
        """Sleep until a signal, a front's readiness or sign of life, or `timeout`."""
        waiting = {f.ready_fd: f for f in self.fronts.values()}
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
                if front.ready:
                    if os.read(fd, 4096):   # its signs of life (nothing: it is exiting)
                        front.beat_at = time.monotonic()
                    continue
                front.ready = os.read(fd, 1) == b"1"
                if front.ready:
                    front.beat_at = time.monotonic()
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
        try:  # the front's live gauges end with it; its totals stay
            mark_front_dead(front.pid)
        except (KeyError, OSError):
            pass
        clean = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        if not clean:
            self.orphans.append(front.journal)  # the next front to start writes what it holds
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
        if front.generation != self.generation or not self.booted:
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
        if delay and any(f.slot != front.slot for f in self._live(self.generation)):
            slot.park()   # until the replacement (up to 30 s, or never)

    def _journal_number(self) -> int:
        """A dead front's journal first (its replacement replays it), else the lowest free."""
        if self.orphans:
            return self.orphans.pop(0)
        used = {f.journal for f in self.fronts.values()}
        return next(n for n in range(len(used) + 1) if n not in used)

    def _watch(self) -> None:
        """Kill a front gone silent (`Front.silent`); it is replaced as any front that dies."""
        limit = self.settings.server.front_timeout_s
        for front in [f for f in self.fronts.values() if f.silent(limit, time.monotonic())]:
            log.error("front %d (pid %d) gave no sign of life for %d s; killing it",
                      front.slot, front.pid, limit)
            front.killed = True
            self._signal(front.pid, signal.SIGKILL)

    def _maintain(self) -> None:
        """Spawn back to one front per slot in the current generation (once its back-off ends)."""
        now = time.monotonic()
        served = {f.slot for f in self._live(self.generation)}
        for index, slot in enumerate(self.slots):
            if index not in served and (slot.respawn_at is None or slot.respawn_at <= now):
                slot.respawn_at = None
                self._spawn(index, self.generation, self._journal_number())

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
                self._watch()
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
        for sock in (s for slot in self.slots for s in slot.sockets):
            sock.close()   # no new connections (the fronts close their copies)

    handle_int = handle_term

    def handle_hup(self) -> None:
        if self.stopping:
            return
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
        journal = self.settings.records.journal
        if any(getattr(new, k) != v for k, v in kept.items()) or fresh.records.journal != journal:
            log.warning("server.host, server.port, server.processes and records.journal change "
                        "only on a restart; kept %s:%d with %d fronts", old.host, old.port,
                        self.count)
        self.new_settings = dataclasses.replace(
            fresh, server=dataclasses.replace(new, **kept),
            records=dataclasses.replace(fresh.records, journal=journal))
        self.pending = self.generation + 1
        self.pending_since = time.monotonic()
        log.info("reloading: starting %d new fronts", self.count)
        for slot in range(self.count):
            self._spawn(slot, self.pending, self._journal_number(), self.new_settings)

    def _check_reload(self) -> None:
        if self.pending is None:
            return
        fresh = self._live(self.pending)
        if len(fresh) == self.count and all(f.ready for f in fresh):
            old = [f for f in self.fronts.values() if f.generation != self.pending]
            self.settings, self.generation, self.pending = self.new_settings, self.pending, None
            for entry in self.slots:
                entry.respawn_at, entry.quick_deaths = None, 0
            log.info("reloaded: %d new fronts ready (pids %s); handing over from %d old ones",
                     len(fresh), " ".join(str(f.pid) for f in fresh), len(old))
            for front in old:
                front.retiring = True
                self._signal(front.pid, HANDOFF_SIGNAL)
        elif time.monotonic() - self.pending_since > BOOT_TIMEOUT_S:
            log.error("reload: the new fronts did not start in time; keeping the running fronts")
            self._abort_reload()

    def _abort_reload(self) -> None:
        """Give up a reload: its fronts go, the running ones stay. A new front
        that already listens may be answering requests on the shared sockets:
        it hands over like an old front at the end of a reload (it stops
        accepting and finishes what it has); one not listening yet is killed."""
        for front in self.fronts.values():
            if front.generation == self.pending:
                front.retiring = True
                self._signal(front.pid, HANDOFF_SIGNAL if front.ready else signal.SIGKILL)
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

