"""Compiled scripts kept by the service: marshalled code, bound to what it was compiled from.

A worker loads a script version from marshalled code in microseconds instead
of compiling it (``compile_restricted``, ~0.3-1 ms, more for big sources).
The code is compiled once per (guild, script key, version, SHA-256 of the
source) by the pool's *compile worker*: a hardened worker that never runs a
script and compiles the sources of one guild only (``sandbox.compiling``).
The bytes it returns are kept here, in the service process, in an LRU bounded
by bytes, and shipped to the workers of that guild that lack them, never to
another guild's. A guild holds at most a sixteenth of the cache (at least 2
MiB): past it its own least recently used versions go, never another guild's
(``sandbox.owned_lru``), so no guild can empty the cache of the others' code.

A code object bypasses RestrictedPython's checks, so what is kept here must
only ever be what the compile worker produced for exactly this source:

* the key of an entry is (guild, script key, version, source digest): the
  guild whose compile worker produced it and whose workers alone load it;
  the digest is always computed here from the source about to run
  (:func:`source_digest`), never taken from a caller;
* every entry carries an HMAC-SHA256 over that key and its bytes, under a key
  drawn at random when the process starts and never stored or sent; an entry
  whose MAC does not verify (changed in memory) is dropped, counted and
  compiled again, never shipped.

Nothing here is stored in the database or on disk: a restart compiles each
version once more (on its first request, in the compile worker).
"""
from __future__ import annotations

import hashlib
import hmac
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sandbox.owned_lru import OwnedLRU

#: Default bound of the cache (bytes of marshalled code and metadata).
DEFAULT_MAX_BYTES = 64 << 20
#: A guild may hold this fraction of the cache (1/N), and at least GUILD_MIN_BYTES
#: (or the whole of a smaller cache): a few versions of the largest shippable code.
GUILD_SHARE = 16
GUILD_MIN_BYTES = 2 << 20
#: Bounds of the digest memo: entries, and characters of the sources it keeps
#: alive (mostly the very strings the service's endpoint cache holds anyway).
_DIGESTS = 65536
_DIGEST_CHARS = 64 << 20


@dataclass(frozen=True, slots=True)
class CompiledCode:
    """What a worker needs to load a script version without compiling it.

    ``code``: ``marshal.dumps`` of the module code object, or None when the
    source does not compile (``error``: (line, message), shipped instead, so a
    broken version is not compiled again either).
    """

    code: bytes | None
    events: tuple[str, ...]
    has_endpoint: bool
    has_generators: bool
    error: tuple[int | None, str] | None
    mac: bytes

    @property
    def size(self) -> int:
        """Bytes this entry costs the cache (approximately)."""
        return len(self.code or b"") + 256

    def meta(self) -> dict[str, Any]:
        """The job message's ``meta`` field."""
        return {"events": list(self.events), "endpoint": self.has_endpoint,
                "gen": self.has_generators,
                "err": list(self.error) if self.error is not None else None}


_known_digests: "OrderedDict[tuple[str, int], tuple[str, bytes]]" = OrderedDict()
_memo_chars = [0]


def source_digest(key: str, version: int, source: str) -> bytes:
    """SHA-256 of ``source``; remembered per (key, version) for the very same string
    object (or an equal one), so the hot path hashes a source once, not per request.
    The memo is bounded by entries and by the characters of the sources it holds."""
    memo = _known_digests
    hit = memo.get((key, version))
    if hit is not None and (hit[0] is source or hit[0] == source):
        return hit[1]
    digest = hashlib.sha256(source.encode("utf-8", "surrogatepass")).digest()
    old = memo.pop((key, version), None)
    if old is not None:
        _memo_chars[0] -= len(old[0])
    memo[(key, version)] = (source, digest)
    _memo_chars[0] += len(source)
    while memo and (len(memo) > _DIGESTS or _memo_chars[0] > _DIGEST_CHARS):
        _memo_chars[0] -= len(memo.popitem(last=False)[1][0])
    return digest


#: (guild, script key, version, source digest)
CodeKey = tuple[str, str, int, bytes]


class CodeCache:
    """An LRU of :class:`CompiledCode` by (guild, key, version, source digest), bounded
    by bytes, a sixteenth of them per guild."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._key = os.urandom(32)
        self._entries: OwnedLRU[CodeKey, CompiledCode] = OwnedLRU(
            max_bytes, max(max_bytes // GUILD_SHARE, min(max_bytes, GUILD_MIN_BYTES)))
        #: entries dropped because their MAC did not verify
        self.rejected = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: CodeKey) -> bool:
        """Whether an entry is there (not checked: ``get`` checks before shipping)."""
        return key in self._entries

    @property
    def size_bytes(self) -> int:
        """Bytes held now."""
        return self._entries.size

    def held(self, guild: str) -> int:
        """Bytes held now for ``guild``."""
        return self._entries.held(guild)

    def _mac(self, key: CodeKey, code: bytes | None, events: tuple[str, ...],
             has_endpoint: bool, has_generators: bool,
             error: tuple[int | None, str] | None) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in (key[0].encode("utf-8", "surrogatepass"),
                     key[1].encode("utf-8", "surrogatepass"), str(key[2]).encode(), key[3],
                     code or b"", "\x00".join(events).encode("utf-8", "surrogatepass"),
                     bytes((has_endpoint, has_generators, code is None)),
                     repr(error).encode("utf-8", "surrogatepass")):
            mac.update(len(part).to_bytes(8, "big"))
            mac.update(part)
        return mac.digest()

    def put(self, key: CodeKey, code: bytes | None, events: tuple[str, ...],
            has_endpoint: bool, has_generators: bool,
            error: tuple[int | None, str] | None) -> CompiledCode:
        """Keep what the compile worker produced for ``key``; returns the entry."""
        entry = CompiledCode(code, events, has_endpoint, has_generators, error,
                             self._mac(key, code, events, has_endpoint, has_generators, error))
        self._entries.put(key[0], key, entry, entry.size)
        return entry

    def get(self, key: CodeKey) -> CompiledCode | None:
        """The entry for ``key`` if it is there and its MAC verifies, else None."""
        entry = self._entries.peek(key)
        if entry is None:
            return None
        expected = self._mac(key, entry.code, entry.events, entry.has_endpoint,
                             entry.has_generators, entry.error)
        if not hmac.compare_digest(expected, entry.mac):
            self.rejected += 1
            self._entries.pop(key)
            return None
        self._entries.get(key)   # the guild's most recently used now
        return entry

    def entries(self) -> dict[CodeKey, CompiledCode]:
        """A copy of the entries (tests and operators)."""
        return dict(self._entries.items())

    def replace_entry(self, key: CodeKey, entry: CompiledCode) -> None:
        """Put ``entry`` in place as it is, MAC and all (tests: a tampered entry)."""
        self._entries.put(key[0], key, entry, entry.size)
