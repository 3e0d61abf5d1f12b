"""`OwnedLRU`: a bounded cache shared by guilds in which no guild evicts another's entries.

A plain LRU shared by guilds lets one guild push the others' entries out
(review, session 29): a guild saving or compiling many versions emptied the
service's code cache, so another guild's next new worker compiled again (~0.8
s of its own time for a large script), and whether a guild's own old entry was
still there told it whether other guilds had compiled or saved meanwhile.

Here every entry has an owner (its guild) and a size. An owner's entries are
bounded by ``per_owner``: past it the owner's own least recently used entries
go. The whole is bounded by ``total`` (``per_owner`` a fraction of it): only
when that is reached — many guilds each holding much — is an entry of
another owner evicted, and then always the least recently used one of the
owner holding the most. So one guild never evicts another's entries while
fewer than ``total / per_owner`` guilds hold their full share.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class OwnedLRU(Generic[K, V]):
    """Entries by key, each with an owner and a size; see the module docstring."""

    def __init__(self, total: int, per_owner: int) -> None:
        self.total = total
        self.per_owner = min(per_owner, total)
        self._entries: dict[K, tuple[str, V, int]] = {}
        self._orders: dict[str, OrderedDict[K, None]] = {}
        self._held: dict[str, int] = {}
        self._size = 0
        #: (-held, change number, owner): the largest owner on top; an item whose
        #: ``held`` is no longer the owner's is stale and skipped.
        self._heap: list[tuple[int, int, str]] = []
        self._changes = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def size(self) -> int:
        """The sizes of the entries held now, summed."""
        return self._size

    def held(self, owner: str) -> int:
        """What ``owner``'s entries add up to."""
        return self._held.get(owner, 0)

    def get(self, key: K) -> V | None:
        """The value for ``key`` (now its owner's most recently used), or None."""
        found = self._entries.get(key)
        if found is None:
            return None
        self._orders[found[0]].move_to_end(key)
        return found[1]

    def peek(self, key: K) -> V | None:
        """The value for ``key`` without touching its recency."""
        found = self._entries.get(key)
        return None if found is None else found[1]

    def items(self) -> list[tuple[K, V]]:
        return [(key, found[1]) for key, found in self._entries.items()]

    def values(self) -> list[V]:
        return [found[1] for found in self._entries.values()]

    def put(self, owner: str, key: K, value: V, size: int = 1) -> bool:
        """Keep ``value`` under ``key`` for ``owner``; False when it is larger than
        an owner may hold (then not kept, and nothing is evicted for it)."""
        self.pop(key)
        if size > self.per_owner:
            return False
        order = self._orders.get(owner)
        while order and self._held[owner] + size > self.per_owner:
            self.pop(next(iter(order)))
            order = self._orders.get(owner)
        self._entries[key] = (owner, value, size)
        self._orders.setdefault(owner, OrderedDict())[key] = None
        self._change(owner, size)
        while self._size > self.total:
            self.pop(next(iter(self._orders[self._largest()])))
        return True

    def pop(self, key: K) -> V | None:
        """Forget ``key``; its value, or None."""
        found = self._entries.pop(key, None)
        if found is None:
            return None
        owner, value, size = found
        order = self._orders[owner]
        del order[key]
        if not order:
            del self._orders[owner]
        self._change(owner, -size)
        return value

    def _change(self, owner: str, delta: int) -> None:
        held = self._held.get(owner, 0) + delta
        self._size += delta
        if owner not in self._orders:
            self._held.pop(owner, None)
            return
        self._held[owner] = held
        heapq.heappush(self._heap, (-held, next(self._changes), owner))
        if len(self._heap) > 2 * len(self._held) + 64:
            # Stale items outnumber the live ones: keep one per owner.
            self._heap = [(-h, next(self._changes), o) for o, h in self._held.items()]
            heapq.heapify(self._heap)

    def _largest(self) -> str:
        heap = self._heap
        while True:
            held, _, owner = heap[0]
            if self._held.get(owner) == -held:
                return owner
            heapq.heappop(heap)
