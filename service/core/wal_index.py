"""Whether anything committed to a SQLite database since the last look, read from
its WAL index without a system call.

`PRAGMA data_version` answers that exactly, but its read transaction costs
three system calls (two `fcntl` locks and an `fstat`), about 6 % of the
invoke path's throughput (docs/performance.md). In WAL mode every commit,
from any connection of any process, rewrites the WAL index header at the
start of the database's `-shm` file (SQLite's `walIndexWriteHdr`: a change
counter, the last frame, checksums and salts) before the committing
connection lets go of its write lock; every connection of every process
reads that header through a shared mapping of the file, and the pragma
itself is computed from it. `WalIndex` maps the same file read-only and
compares the header (both of its copies, 96 bytes) with what it read at the
previous look: one memory read.

- SQLite truncates and re-initialises `-shm` only when no connection of any
  process holds its dead-man lock, and deletes it only under an exclusive
  lock on the database: neither can happen while a connection of this
  process is open, and a `WalIndex` serves one open connection
  (`TargetCache` makes a new one whenever its connection changes). A file
  re-created after every connection closed is a new inode (the descriptor
  kept here holds the old one), so it gets a mapping of its own.
- POSIX locks belong to the process: closing *any* descriptor of a file
  drops every lock the process holds on it, SQLite's own (its dead-man and
  read locks on the index) included. So the one descriptor opened here per
  file and its mapping (made through libc: `mmap.mmap` would duplicate the
  descriptor and close the duplicate) are kept for the life of the process
  (`_MAPS`, at most `MAX_MAPS` files; past that the pragma answers).
- A header whose change counter is 0 (a fresh index, or one SQLite rebuilt
  after a process died while writing it) could repeat an earlier one: the
  pragma answers too while it is.
- As a tripwire against a SQLite that behaves otherwise, the pragma also
  runs once every `CROSS_CHECK_S`: if it saw a commit that the header did
  not show, this `WalIndex` answers with the pragma from then on (logged).
- The lookups must not leave a statement unfinished on the connection: its
  read transaction would pin an old snapshot that a lookup could then store
  under a new header (`load_target` reads its one row and finishes).

Outside WAL mode, or when the file cannot be mapped, the pragma answers.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sqlite3
import threading
import time
from typing import Callable

log = logging.getLogger("logic.targets")

#: Both copies of the WAL index header (SQLite's `WalIndexHdr`, 48 bytes each).
HEADER_BYTES = 96
#: The change counter (`iChange`) of the first copy.
_CHANGE = slice(8, 12)
_NO_CHANGE = bytes(4)
#: How often the pragma cross-checks the header (seconds).
CROSS_CHECK_S = 1.0
#: Index files mapped per process (tests open many databases; a service one).
MAX_MAPS = 64

#: (device, inode) of an index file -> its mapping (None: too small to map). Its
#: descriptor is never closed, nor is a second one a race between the `stat` and
#: the `open` below may leave.
_MAPS: dict[tuple[int, int], memoryview | None] = {}
_MAPS_LOCK = threading.Lock()


class WalIndex:
    """What has committed to the database of one open WAL-mode connection."""

    __slots__ = ("conn", "_map", "_clock", "_checked_at", "_pragma", "_header_then")

    def __init__(self, conn: sqlite3.Connection,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.conn = conn
        self._clock = clock
        _data_version(conn)   # a read in WAL mode: the connection maps the index
        self._map: memoryview | None = _map_index(conn)
        # The cross-check's last header (read before its pragma) and pragma.
        self._header_then = self._map[:HEADER_BYTES].tobytes() if self._map is not None else b""
        self._pragma = _data_version(conn)
        self._checked_at = clock()

    def changes(self) -> object:
        """A value that differs from the last one whenever anything committed in
        between (and sometimes when nothing did)."""
        m = self._map
        if m is None:
            return _data_version(self.conn)
        header = m[:HEADER_BYTES].tobytes()
        now = self._clock()
        if now - self._checked_at >= CROSS_CHECK_S:
            header = self._cross_check(header, now)
            if self._map is None:
                return _data_version(self.conn)
        if header[_CHANGE] == _NO_CHANGE:
            return header, _data_version(self.conn)
        return header

    def _cross_check(self, before: bytes, now: float) -> bytes:
        """Run the pragma; the header read after it."""
        # Any commit the pragma saw since its last run came after the header read
        # before that run and before the header read after this one: if those two
        # are equal, the header missed it.
        pragma = _data_version(self.conn)
        m = self._map
        assert m is not None
        after = m[:HEADER_BYTES].tobytes()
        if pragma != self._pragma and after == self._header_then:
            log.warning("the SQLite WAL index did not show a commit that PRAGMA data_version "
                        "saw; endpoint lookups on this connection run the pragma from now on")
            self._map = None
        self._header_then, self._pragma, self._checked_at = before, pragma, now
        return after


def _data_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA data_version").fetchone()[0])


def _map_index(conn: sqlite3.Connection) -> memoryview | None:
    """The read-only mapping of the `-shm` file of ``conn``'s main database, or
    None when it is not in WAL mode or has no such file (an in-memory database)."""
    try:
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        rows = conn.execute("PRAGMA database_list").fetchall()
    except sqlite3.Error:
        return None
    path = next((row[2] for row in rows if row[1] == "main"), "")
    if str(mode).lower() != "wal" or not path:
        return None
    shm = path + "-shm"
    with _MAPS_LOCK:
        try:
            st = os.stat(shm, follow_symlinks=False)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino)
        if key in _MAPS:
            return _MAPS[key]
        if len(_MAPS) >= MAX_MAPS:
            return None
        try:
            fd = os.open(shm, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        # From here on `fd` is never closed (it would drop SQLite's locks).
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        if key not in _MAPS:   # (in it: the file was replaced between the stat and the open)
            _MAPS[key] = _map_page(fd) if st.st_size >= mmap.PAGESIZE else None
        return _MAPS[key]


def _map_page(fd: int) -> memoryview | None:
    """The first page of ``fd``, mapped shared and read-only, never unmapped.

    Through libc, not `mmap.mmap`: that one works on a duplicate of the
    descriptor, which it closes when the mapping fails or is freed, and that
    close would drop SQLite's locks."""
    addr = _libc_mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return None
    return memoryview((ctypes.c_char * mmap.PAGESIZE).from_address(addr)).cast("B")


_libc_mmap = ctypes.CDLL(None, use_errno=True).mmap
_libc_mmap.restype = ctypes.c_void_p
_libc_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value
