"""One front process under the arbiter (`server.processes` > 1): what the arbiter
knows of it (`Front`, `Slot`), and what runs after the fork.

The child resets the arbiter's signal handling, opens its own database
connection and records journal (replaying what a dead front left in it), then
serves exactly as one process does (`service.http.server.run_front`), tells
the arbiter through a pipe when it listens, and then writes a byte on that
pipe every `BEAT_S` from its event loop (the arbiter kills a front that stops).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
from dataclasses import dataclass

from peewee import DatabaseError

from models.migrate import SchemaBehindError
from service.http.journal import JournalInUse
from service.http.ports import rejoin
from service.http.server import FRONT_JOURNAL, HANDOFF_SIGNAL, journal_path, open_front, run_front
from service.http.shared_windows import SharedWindows
from service.settings import Settings

log = logging.getLogger("logic.arbiter")


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
    #: `time.monotonic()` of its last sign of life on that pipe (once it listens).
    beat_at: float = 0.0
    killed: bool = False          # for its silence (see Arbiter._watch)

    def silent(self, limit: float, now: float) -> bool:
        """Listening, serving, not yet killed, and no sign of life from its event
        loop for `limit` s (stuck or stopped: the kernel would keep giving it its
        share of new connections)."""
        return (self.ready and not self.retiring and not self.killed
                and now - self.beat_at > limit)


@dataclass
class Slot:
    """One front's place: its listening sockets and its back-off."""

    sockets: list[socket.socket]
    quick_deaths: int = 0
    respawn_at: float | None = None

    def park(self) -> None:
        """Close its sockets while no front accepts on them: the kernel would
        queue connections there, unanswered (the port's group lives on in the
        other slots')."""
        for sock in self.sockets:
            sock.close()
        self.sockets = []

    def rejoin(self, host: str | None, port: int) -> None:
        """Listening sockets again, when parked; raises OSError."""
        if not self.sockets:
            self.sockets = rejoin(host, port)


#: A front that exits with this code could not start (bad database, journal in use).
EXIT_BOOT = 3
#: Seconds between a front's signs of life on its ready pipe (see the arbiter).
BEAT_S = 1.0
_PR_SET_PDEATHSIG = 1


def front_main(settings: Settings, slot: int, journal: int, sockets: list[socket.socket],
               ready_w: int, *, windows: SharedWindows | None, drain_seconds: float,
               arbiter: int) -> int:
    """Serve as front `slot` until told to stop; returns the exit code."""
    _drain_with_parent(arbiter)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, HANDOFF_SIGNAL):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # reloads are the arbiter's
    try:
        directory = os.path.join(journal_path(settings), f"{FRONT_JOURNAL}{journal}")
        database, front_journal = open_front(settings, directory, check_schema=False)
    except (JournalInUse, SchemaBehindError, OSError, DatabaseError) as err:
        # DatabaseError: e.g. the SQLite file removed or replaced since the start.
        log.error("front %d cannot start: %s", slot, err)
        return EXIT_BOOT
    def ready() -> None:
        os.write(ready_w, b"1")
        os.set_blocking(ready_w, False)
        # Then a sign of life every BEAT_S from the event loop: the arbiter
        # kills a front whose loop stops beating (stuck, or stopped).
        loop = asyncio.get_running_loop()

        def beat() -> None:
            try:
                os.write(ready_w, b".")
            except BlockingIOError:
                pass   # the arbiter has not read the last ones yet
            except OSError:
                return  # the arbiter is gone
            loop.call_later(BEAT_S, beat)

        loop.call_later(BEAT_S, beat)

    run_front(settings, database, sockets, front_journal, drain_seconds,
              windows=windows, on_ready=ready)
    return 0


def _drain_with_parent(arbiter: int) -> None:
    """A front gets SIGTERM (its graceful drain) if the arbiter dies, e.g. SIGKILLed (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: a front outlives a killed arbiter
        return
    if os.getppid() != arbiter:  # the arbiter died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)
