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
`records.fsync = true` (an fsync per request: slow). After a crash at the very
moment a batch was committed but its segment not yet deleted, that batch's
records are written twice.

The presented secret is never journaled: the headers carrying secrets are
left out, and every value holding it is redacted before it is written (as in
history; `service.http.redaction`). Other credential-named values are
redacted when records are made (`JournaledRequest.records`), so the files
hold them until the segment is reused or deleted (docs/security.md).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import struct
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]

from service.core.records import ErrorRecordIn, RequestRecordIn, StatHit
from service.http.auth import presented_secret
from service.http.event import parse_query, visible_headers
from service.http.redaction import Redactor

log = logging.getLogger("logic.records")

_SEGMENT = re.compile(r"segment-(\d{12})\.journal")
_LENGTH = struct.Struct("<I")
_ZERO = bytes(4)
#: Size of a segment file (sparse: only what is written takes disk space).
SEGMENT_BYTES = 8 * 1024 * 1024

#: The fields of a journaled request, in order (see `JournaledRequest`).
FIELDS = ("endpoint_id", "keep", "error_logs", "accepted", "request_id", "started", "finished",
          "status", "ip", "method", "query", "headers", "body", "user_agent",
          "response_headers", "response_body", "output", "error", "error_kind",
          "error_message", "error_line", "traceback", "queued", "deprioritised", "script_version")


class JournalInUse(OSError):
    """Another running process owns the journal directory."""


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
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        # One process per journal: another one's live segment is no leftover.
        self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise JournalInUse(f"the records journal {self.directory} is used by another "
                               "process; give each one its own records.journal") from None
        self._fsync = fsync
        self._lock = threading.Lock()
        self._packer = msgpack.Packer(use_bin_type=True)
        existing = [int(m.group(1)) for p in self.directory.iterdir()
                    if (m := _SEGMENT.fullmatch(p.name))]
        self._number = max(existing, default=0)
        self._sealed: list[_Segment] = []   # sealed, not yet handed out by `seal`
        self._pending: dict[Path, _Segment] = {}  # handed out, batch not yet written
        self._free: list[_Segment] = []
        self._segment = self._open_next()

    @property
    def lock(self) -> threading.Lock:
        """Held while appending: `RecordWriter` queues under it too, so a
        sealed segment holds exactly the entries queued before the seal."""
        return self._lock

    def _path(self, number: int) -> Path:
        return self.directory / f"segment-{number:012d}.journal"

    def _open_next(self, size: int = SEGMENT_BYTES) -> _Segment:
        """The next segment: an emptied one renamed, or a new sparse file of
        `size` bytes, mapped shared. Its first length word is zero."""
        self._number += 1
        path = self._path(self._number)
        if self._free and size <= SEGMENT_BYTES:
            segment = self._free.pop()
            os.rename(segment.path, path)  # numbers keep the replay order
            segment.path = path
            segment.number = self._number
            segment.offset = 0
            return segment
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return _Segment(path, self._number, fd, mapping)

    def append(self, facts: tuple[Any, ...]) -> None:
        """Journal one request (call with `lock` held).

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

    def _finish_segment(self) -> None:
        """The current segment waits for `seal`, at its full size: cutting the
        file to its entries would drop its pages from the page cache, and its
        next use would fault every page in again (replay stops at the zero
        length word that follows the last entry)."""
        segment = self._segment
        if segment.offset:
            self._sealed.append(segment)
        elif len(self._free) < self.KEEP_FREE and len(segment.map) == SEGMENT_BYTES:
            self._free.append(segment)  # nothing in it: reused as it is
        else:
            segment.close()
            segment.path.unlink(missing_ok=True)

    def seal(self) -> list[Path]:
        """Start a new segment (call with `lock` held); returns the ones sealed so far."""
        if self._segment.offset:
            self._finish_segment()
            self._segment = self._open_next()
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
        own = {self._segment.path, *self._pending, *(s.path for s in self._sealed),
               *(s.path for s in self._free)}
        return sorted(p for p in self.directory.iterdir()
                      if _SEGMENT.fullmatch(p.name) and p not in own)


def read_segments(paths: list[Path]) -> Iterator[JournaledRequest]:
    """The requests journaled in `paths`, each up to its first empty or torn
    entry (where the writing process stopped), or an entry that is
    unreadable or stamped with another segment number (left by an earlier
    use of a recycled file): nothing after such an entry can be trusted."""
    for path in paths:
        match = _SEGMENT.fullmatch(path.name)
        number = int(match.group(1)) if match else None
        data = path.read_bytes()
        offset = 0
        while offset + 4 <= len(data):
            size = _LENGTH.unpack_from(data, offset)[0]
            if size == 0 or offset + 4 + size > len(data):
                break
            facts = _entry(data[offset + 4:offset + 4 + size], number)
            if facts is None:
                log.warning("journal %s: an unreadable or stale entry at byte %d; the rest of "
                            "the file is not replayed", path.name, offset)
                break
            yield JournaledRequest(facts)
            offset += 4 + size


def _entry(raw: bytes, number: int | None) -> tuple[Any, ...] | None:
    """The facts of one entry, or None when it is unreadable or not of this
    use of the segment. (A version before entries were stamped wrote the bare
    list of facts: its leftover files are read as it read them, without the
    check.)"""
    try:
        entry = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list):
        stamp, facts = entry
        if stamp != number:
            return None
    else:
        facts = entry
    if not isinstance(facts, list) or len(facts) != len(FIELDS):
        return None
    return tuple(facts)


def request_facts(req: Any) -> tuple[Any, ...]:
    """What a finished `service.http.invoke.InvokeRequest`'s records are made
    of, as plain data in `FIELDS` order, the presented secret redacted:
    journaled as the answer goes out (on the event loop: keep it cheap)."""
    target = req.target
    assert target is not None
    plan = target.plan
    ip = req.ip or req.peer
    outcome = req.outcome
    # Sandbox scheduling, for the statistics: waited for a worker (a 503
    # after waiting has no outcome), and while the guild was deprioritised.
    queued = outcome.waited if outcome is not None else req.waited
    deprioritised = outcome.deprioritised if outcome is not None else False
    if not req.accepted:
        return (target.endpoint_id, plan.history, plan.error_logs, False, req.request_id,
                req.started, req.finished, req.status, ip, req.method or "POST", {}, {},
                b"", "", [], b"", "", None, None, "", None, None, queued, deprioritised,
                target.script_version)
    event = req.event
    headers = req.headers
    error = None
    if outcome is not None and outcome.error_kind:
        error = f"{outcome.error_kind}: {outcome.error_message or ''}".strip()
    elif req.error_code:
        error = req.error_code
    facts = (
        target.endpoint_id, plan.history, plan.error_logs, True, req.request_id,
        req.started, req.finished, req.status, ip, req.method or "POST",
        event["query"] if event else parse_query(req.query),
        event["headers"] if event else visible_headers(headers),
        req.raw_body, headers.get("user-agent", ""),
        req.response_headers, req.response_body,
        outcome.output if outcome else "", error,
        (outcome.error_kind or None) if outcome else None,
        (outcome.error_message or "") if outcome else "",
        outcome.error_line if outcome else None, outcome.traceback if outcome else None,
        queued, deprioritised, target.script_version)
    # Only authenticated requests get here: the secret they presented is
    # the endpoint's own, and is never kept (service.http.redaction).
    return without_secret(facts, presented_secret(headers))


def without_secret(facts: tuple[Any, ...], secret: str | None) -> tuple[Any, ...]:
    """`facts` with every value that holds `secret` redacted (as history keeps it).

    Cheap when the secret appears nowhere (the usual case): a substring test
    per value. Credential-named parameters are redacted later, by name, when
    records are made (`JournaledRequest.records`).
    """
    if not secret or not facts[3]:
        return facts
    query, headers, body, response_headers, response_body = (
        facts[10], facts[11], facts[12], facts[14], facts[15])
    if not _holds(secret, facts, query, headers, body, response_headers, response_body):
        return facts
    redact = Redactor(secret)
    out = list(facts)
    out[10] = redact.mapping(query)
    out[11] = redact.mapping(headers)
    out[12] = redact.data(body)
    out[13] = redact.text(facts[13])
    out[14] = [[n, redact.value(n, v)] for n, v in response_headers]
    out[15] = redact.raw(response_body)
    for index in (16, 17, 19, 21):
        if out[index]:
            out[index] = redact.text(out[index])
    return tuple(out)


def _holds(secret: str, facts: tuple[Any, ...], query: dict[str, Any], headers: dict[str, str],
           body: bytes | str, response_headers: list[Any], response_body: bytes) -> bool:
    """Whether `secret` appears anywhere in what is journaled (plain loops: hot path)."""
    for value in headers.values():
        if secret in value:
            return True
    for value in query.values():
        if secret in str(value):
            return True
    for pair in response_headers:
        if secret in pair[1]:
            return True
    for index in (13, 16, 17, 19, 21):
        text = facts[index]
        if text and secret in text:
            return True
    raw = secret.encode("utf-8", "surrogatepass")
    return raw in (body if isinstance(body, bytes) else body.encode("utf-8", "replace")) \
        or raw in response_body


class JournaledRequest:
    """A finished request as plain facts: what `RecordWriter` converts to records."""

    __slots__ = ("facts",)

    def __init__(self, facts: tuple[Any, ...]) -> None:
        self.facts = facts

    def history_slot(self) -> tuple[int, int] | None:
        f = self.facts
        return (f[0], f[1]) if f[3] else None

    def records(self, history: bool) -> list[Any]:
        (endpoint_id, keep, error_logs, accepted, request_id, started, finished, status, ip,
         method, query, headers, body, user_agent, response_headers, response_body, output,
         error, error_kind, error_message, error_line, traceback, queued, deprioritised,
         script_version) = self.facts
        when = datetime.fromtimestamp(started, tz=timezone.utc)
        duration_ms = (finished - started) * 1000.0
        items: list[Any] = [StatHit(endpoint_id, when, status, duration_ms, ip, queued=queued,
                                    deprioritised=deprioritised)]
        if not accepted:
            return items
        if history:
            by_name = Redactor(None)  # credential-named values (the secret went at journaling)
            items.append(RequestRecordIn(
                endpoint_id=endpoint_id, request_id=request_id, time=when, method=method,
                query=by_name.mapping(query), headers=by_name.mapping(headers), body=body,
                ip=ip, user_agent=user_agent, status=status,
                response_headers=by_name.mapping(dict(response_headers)),
                response_body=response_body, duration_ms=duration_ms, output=output,
                error=error, keep=keep, script_version=script_version,
            ))
        if error_kind and error_logs:
            items.append(ErrorRecordIn(
                endpoint_id=endpoint_id, request_id=request_id, time=when, kind=error_kind,
                message=error_message, line=error_line, traceback=traceback,
                script_version=script_version,
            ))
        return items
