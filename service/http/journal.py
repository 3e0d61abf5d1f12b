"""The records journal: answered requests survive a crash of the service process.

Every finished invoke request is appended, as the answer is sent, to a local
journal file: msgpack copied into a shared memory mapping of the file, so it
is in the page cache at once with no system call per request (no `fsync`
unless `records.fsync = true`). The record writer seals the current
segment each time it takes a batch from its queue, and empties the sealed
segments once their batch is in the database (emptied segments are reused). At start-up, segments left by a
process that died are written to the database first (`replay`), then removed.

What this guarantees: a crash (SIGKILL, OOM kill, a segfault) of the service
loses no answered request's records. Not a power loss or a kernel crash —
what is in the page cache but not on disk is lost then — unless
`records.fsync = true` (an fsync per request: slow). Nothing is written
twice: segment files are named after the journal's run (a random id per
opening), each batch the writer commits stores the position of its last
journaled entry under that run in the same transaction (`JournalMark`,
`service.core.journal_marks`), and replay skips what the mark covers — a
crash between two batches of one turn, or between a commit and the emptying
of its segments, replays only what was not yet in the database.

The presented secret is never journaled: the headers carrying secrets are
left out, and every value holding it is redacted before it is written (as in
history; `service.http.redaction`). Other credential-named values are
redacted when records are made (`JournaledRequest.records`), so the files
hold them until the segment is reused or deleted (docs/security.md).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]

from service.http.journal_facts import FIELDS, JournaledRequest

log = logging.getLogger("logic.records")

#: A segment's file name: its number, and the run that wrote it (none before marks).
_SEGMENT = re.compile(r"segment-(\d{12})(?:-([0-9a-f]{16}))?\.journal")
_LENGTH = struct.Struct("<I")
_ZERO = bytes(4)
#: Size of a segment file; its blocks are reserved when it is made.
SEGMENT_BYTES = 8 * 1024 * 1024


class JournalInUse(OSError):
    """Another running process owns the journal directory."""


class JournalUnusable(Exception):
    """The journal directory cannot be made or opened (the message names the key)."""


class _Segment:
    """One segment file, open and mapped shared for as long as this process uses it."""

    __slots__ = ("path", "number", "fd", "map", "offset")

    def __init__(self, path: Path, number: int, fd: int, mapping: mmap.mmap) -> None:
        self.path = path
        self.number = number  # in its name, and stamped on every entry of this use
        self.fd = fd
        self.map = mapping
        self.offset = 0

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class Journal:
    """Append-only segment files in one directory; thread-safe.

    Segments are recycled: once a sealed segment's batch is in the database
    its first entry is zeroed (replay then finds nothing in it) and it waits,
    still open and mapped, to become a later segment. Writing into pages that
    are already in the page cache and mapped takes no page fault; a fresh
    file's pages each took one (a file-system block reservation) and its
    deletion freed them again, a few microseconds of kernel time per request
    (docs/performance.md).
    """

    #: Emptied segments kept for reuse; more are deleted.
    KEEP_FREE = 2

    def __init__(self, directory: str | Path, fsync: bool = False) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            # One process per journal: another one's live segment is no leftover.
            self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            raise JournalUnusable(f"records.journal: cannot use {self.directory} as the "
                                  f"records journal: {err.strerror or err}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise JournalInUse(f"the records journal {self.directory} is used by another "
                               "process; give each one its own records.journal") from None
        self._fsync = fsync
        #: This opening's id, in its segments' names: the record writer's marks
        #: say how far the run is in the database (`service.core.journal_marks`).
        self.run = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._packer = msgpack.Packer(use_bin_type=True)
        existing = [int(m.group(1)) for p in self.directory.iterdir()
                    if (m := _SEGMENT.fullmatch(p.name))]
        self._number = max(existing, default=0)
        self._sealed: list[_Segment] = []   # sealed, not yet handed out by `seal`
        self._pending: dict[Path, _Segment] = {}  # handed out, batch not yet written
        self._free: list[_Segment] = []
        #: None: not made yet (`begin`, else the first append) or none could be (a full disk).
        self._segment: _Segment | None = None
        self._retry_at = 0.0
        self._last_errno = 0

    def begin(self) -> None:
        """Make the first segment, after the start-up's replay: a start that
        fails or is killed before it (a database locked or down) then leaves
        nothing behind, where each such start once left another 8 MiB file;
        and the live segment is never among what the replay or the
        installation check moves or deletes."""
        with self._lock:
            if self._segment is not None:
                return
            try:
                self._segment = self._open_next()
            except OSError as err:
                self._retry_at, self._last_errno = time.monotonic() + 1.0, err.errno or errno.EIO
                log.warning("records journal %s: cannot make a segment (%s); answered requests "
                            "are journaled again once one can be made", self.directory,
                            err.strerror or err)

    @property
    def lock(self) -> threading.Lock:
        """Held while appending: `RecordWriter` queues under it too, so a
        sealed segment holds exactly the entries queued before the seal."""
        return self._lock

    def _path(self, number: int) -> Path:
        return self.directory / f"segment-{number:012d}-{self.run}.journal"

    def _open_next(self, size: int = SEGMENT_BYTES) -> _Segment:
        """The next segment: an emptied one renamed, or a new file of `size`
        bytes (its blocks reserved), mapped shared. Its first length word is zero."""
        self._number += 1
        path = self._path(self._number)
        if self._free and size <= SEGMENT_BYTES:
            segment = self._free.pop()
            try:
                os.rename(segment.path, path)  # numbers keep the replay order
            except OSError:
                segment.close()
                segment.path.unlink(missing_ok=True)
                raise
            segment.path = path
            segment.number = self._number
            segment.offset = 0
            return segment
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # The blocks are reserved now, so a full disk is an OSError here:
            # a store into a page of a mapping the file system cannot back
            # is a SIGBUS, which would end the process.
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return _Segment(path, self._number, fd, mapping)

    def _reopen(self) -> _Segment:
        """A new segment after none could be made, tried at most once a second
        (a full disk would otherwise cost a file made and removed per request)."""
        now = time.monotonic()
        if now < self._retry_at:
            raise OSError(self._last_errno, os.strerror(self._last_errno))
        try:
            return self._open_next()
        except OSError as err:
            self._retry_at, self._last_errno = now + 1.0, err.errno or errno.EIO
            raise

    def append(self, facts: tuple[Any, ...]) -> tuple[str, int, int]:
        """Journal one request (call with `lock` held); returns its mark (run,
        segment number, the byte just past it).

        A copy into a shared mapping of the segment: in the page cache at
        once (a process crash cannot lose it), and no system call. The entry
        is followed by a zero length word (a recycled segment holds older
        entries past it), and its own length is written last, so a torn
        entry reads as the end. Each entry carries the segment's number:
        should the zero word be lost while the entry was not (a power loss
        writes pages back in any order), replay stops at the first entry
        of an earlier use of the file instead of replaying it again.
        """
        segment = self._segment
        if segment is None:   # none could be made: try again (OSError if not)
            segment = self._segment = self._reopen()
        data = self._packer.pack((segment.number, facts))
        size = len(data)
        if segment.offset + 4 + size + 4 > len(segment.map):
            self._finish_segment()
            segment = self._segment = self._open_next(max(SEGMENT_BYTES, size + 16))
            data = self._packer.pack((segment.number, facts))
            size = len(data)
        mapping = segment.map
        offset = segment.offset
        start = offset + 4
        end = start + size
        mapping[start:end] = data
        mapping[end:end + 4] = _ZERO
        _LENGTH.pack_into(mapping, offset, size)
        segment.offset = end
        if self._fsync:
            mapping.flush()
        return self.run, segment.number, end

    def _finish_segment(self) -> None:
        """The current segment waits for `seal`, at its full size: cutting the
        file to its entries would drop its pages from the page cache, and its
        next use would fault every page in again (replay stops at the zero
        length word that follows the last entry)."""
        segment, self._segment = self._segment, None
        if segment is None:
            return
        if segment.offset:
            self._sealed.append(segment)
        elif len(self._free) < self.KEEP_FREE and len(segment.map) == SEGMENT_BYTES:
            self._free.append(segment)  # nothing in it: reused as it is
        else:
            segment.close()
            segment.path.unlink(missing_ok=True)

    def seal(self) -> list[Path]:
        """Start a new segment (call with `lock` held); returns the ones sealed so far."""
        if self._segment is not None and self._segment.offset:
            self._finish_segment()
            try:
                self._segment = self._open_next()
            except OSError:
                pass  # the next append tries again, and counts its failure
        sealed, self._sealed = self._sealed, []
        for segment in sealed:
            self._pending[segment.path] = segment
        return [segment.path for segment in sealed]

    def discard(self, segments: list[Path]) -> None:
        """Their records are in the database: empty them for reuse (or delete)."""
        with self._lock:
            for path in segments:
                segment = self._pending.pop(path, None)
                if segment is None:  # an earlier process's leftover
                    path.unlink(missing_ok=True)
                    continue
                _LENGTH.pack_into(segment.map, 0, 0)  # replay now finds nothing here
                if len(self._free) < self.KEEP_FREE and len(segment.map) == SEGMENT_BYTES:
                    self._free.append(segment)
                else:
                    segment.close()
                    path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._finish_segment()  # what it holds stays for the next start-up
            for segment in [*self._sealed, *self._pending.values()]:
                segment.close()  # not written: replayed at the next start-up
            for segment in self._free:
                segment.close()
                segment.path.unlink(missing_ok=True)
            self._sealed, self._pending, self._free = [], {}, []
            os.close(self._lock_fd)

    def leftovers(self) -> list[Path]:
        """Segments of an earlier process (none of this process's own)."""
        own = {*(s.path for s in [self._segment] if s is not None), *self._pending, *(s.path for s in self._sealed),
               *(s.path for s in self._free)}
        return sorted(p for p in self.directory.iterdir()
                      if _SEGMENT.fullmatch(p.name) and p not in own)


def run_of(path: Path) -> str | None:
    """The run that wrote the segment at `path` (None: named before runs were)."""
    match = _SEGMENT.fullmatch(path.name)
    return match.group(2) if match else None


def read_segments(paths: list[Path],
                  damaged: list[tuple[Path, int]] | None = None) -> Iterator[JournaledRequest]:
    """The requests journaled in `paths`, each up to its first empty or torn
    entry (where the writing process stopped), or an entry that is
    unreadable or stamped with another segment number (left by an earlier
    use of a recycled file): nothing after such an entry can be trusted.
    Where an entry is unreadable (damage, not an earlier use), its file and
    offset are added to `damaged`."""
    for path in paths:
        match = _SEGMENT.fullmatch(path.name)
        number = int(match.group(1)) if match else None
        run = match.group(2) if match else None
        data = path.read_bytes()
        offset = 0
        while offset + 4 <= len(data):
            size = _LENGTH.unpack_from(data, offset)[0]
            if size == 0 or offset + 4 + size > len(data):
                break
            facts = _entry(data[offset + 4:offset + 4 + size], number)
            if facts is _STALE:
                log.warning("journal %s: an entry of an earlier use of the file at byte %d; "
                            "the rest of the file is not replayed", path.name, offset)
                break
            if facts is None:
                log.warning("journal %s: an unreadable entry at byte %d; the rest of the file "
                            "is not replayed", path.name, offset)
                if damaged is not None:
                    damaged.append((path, offset))
                break
            offset += 4 + size
            entry = JournaledRequest(facts)
            if run is not None and number is not None:
                entry.mark = (run, number, offset)
            yield entry


#: `_entry`'s answer for an entry of an earlier use of a recycled segment.
_STALE: tuple[Any, ...] = ()


def _entry(raw: bytes, number: int | None) -> tuple[Any, ...] | None:
    """The facts of one entry, None when it is unreadable, `_STALE` when it is
    not of this use of the segment. (A version before entries were stamped
    wrote the bare list of facts: its leftover files are read as it read
    them, without the check.)"""
    try:
        entry = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=False)
    except Exception:  # noqa: BLE001 - any undecodable bytes (TypeError: a map keyed by a list)
        return None
    if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list):
        stamp, facts = entry
        if stamp != number:
            return _STALE
    else:
        facts = entry
    if not isinstance(facts, list) or len(facts) != len(FIELDS):
        return None
    return tuple(facts)
