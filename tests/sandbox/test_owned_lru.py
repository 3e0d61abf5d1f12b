"""`OwnedLRU`: a cache shared by guilds in which no guild evicts another's entries
while the cache is not full of full shares (the code cache and the save-time
verdicts are built on it)."""
from __future__ import annotations

import random

from sandbox.owned_lru import OwnedLRU


def test_an_owner_filling_its_share_evicts_only_its_own_entries() -> None:
    cache: OwnedLRU[str, int] = OwnedLRU(total=100, per_owner=10)
    for i in range(5):
        cache.put("B", f"b{i}", i, 1)
    for i in range(1000):
        cache.put("A", f"a{i}", i, 3)
    assert [cache.get(f"b{i}") for i in range(5)] == [0, 1, 2, 3, 4]
    assert cache.held("A") <= 10 and cache.held("B") == 5
    assert cache.get("a999") == 999 and cache.get("a0") is None


def test_recently_used_entries_of_an_owner_stay_longest() -> None:
    cache: OwnedLRU[str, int] = OwnedLRU(total=100, per_owner=3)
    for key in ("x", "y", "z"):
        cache.put("A", key, 0)
    assert cache.get("x") == 0          # now the most recently used
    cache.put("A", "w", 0)
    assert "y" not in cache and {"x", "z", "w"} <= {k for k, _ in cache.items()}


def test_a_full_cache_evicts_from_the_owner_holding_most() -> None:
    cache: OwnedLRU[str, int] = OwnedLRU(total=10, per_owner=6)
    for i in range(6):
        cache.put("A", f"a{i}", i)
    for i in range(4):
        cache.put("B", f"b{i}", i)
    cache.put("C", "c0", 0)             # 11 > 10: A holds most, its oldest goes
    assert "a0" not in cache and all(f"b{i}" in cache for i in range(4)) and "c0" in cache
    assert cache.size == 10


def test_an_entry_larger_than_a_share_is_not_kept_and_evicts_nothing() -> None:
    cache: OwnedLRU[str, int] = OwnedLRU(total=10, per_owner=4)
    cache.put("A", "a", 1, 2)
    assert cache.put("B", "big", 1, 5) is False
    assert "big" not in cache and "a" in cache and cache.size == 2


def test_random_operations_keep_the_bounds_and_the_eviction_rule() -> None:
    rng = random.Random(29)
    cache: OwnedLRU[tuple[str, int], int] = OwnedLRU(total=60, per_owner=12)
    recency: dict[str, list[tuple[str, int]]] = {}   # per owner, least recent first
    for step in range(20_000):
        owner = rng.choice("ABCDEFGH")
        key = (owner, rng.randrange(40))
        if rng.random() < 0.3:
            if cache.get(key) is not None:
                recency[owner].remove(key)
                recency[owner].append(key)
            continue
        held_before = {o: cache.held(o) for o in "ABCDEFGH"}
        before = {k for k, _ in cache.items()}
        size = rng.randrange(1, 6)
        cache.put(owner, key, step, size)
        after = {k for k, _ in cache.items()}
        if key in recency.get(owner, []):
            recency[owner].remove(key)
        gone = before - after - {key}
        for loser in {lost[0] for lost in gone}:
            lost_keys = {lost for lost in gone if lost[0] == loser}
            if loser != owner:
                # Another owner's entries went only because the cache was full,
                # and each time from an owner holding most: at least as much as
                # every owner that lost nothing, and as the putting owner now.
                assert sum(held_before.values()) + size > 60, (step, loser)
                losers = {lost[0] for lost in gone} | {owner}
                assert all(held_before[loser] >= held_before[o] for o in held_before
                           if o not in losers), (step, loser)
                assert held_before[loser] >= cache.held(owner), (step, loser)
            # Always that owner's least recently used ones.
            assert set(recency[loser][:len(lost_keys)]) == lost_keys, (step, loser)
            del recency[loser][:len(lost_keys)]
        if key in after:
            recency.setdefault(owner, []).append(key)
        assert cache.size <= 60 and all(cache.held(o) <= 12 for o in "ABCDEFGH")
        assert cache.size == sum(cache.held(o) for o in "ABCDEFGH")
        for o in "ABCDEFGH":
            assert set(recency.get(o, [])) == {k for k, _ in cache.items() if k[0] == o}
