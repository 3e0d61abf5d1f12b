"""Process-wide library state that one invocation could leave for the next, put back.

Scripts cannot write to anything the sandbox exposes, but some library calls
change process-wide state as a side effect. Everything here that is cheap to
undo is undone after every invocation (``after_invocation``, well under a
microsecond when nothing changed):

* codec look-ups: ``str.encode``/``bytes.decode`` with an unknown encoding
  name are cached by ``encodings`` (``encodings._cache``, without bound:
  memory that outlived the invocation and a timing channel, redteam findings
  2 and 3), and every spelling of a known one is cached by the interpreter.
  Names longer than :data:`MAX_CODEC_NAME` are refused before any cache sees
  them; ``encodings._cache`` goes back to its warm contents and the
  interpreter's cache is emptied whenever an invocation added to it.
* ``enum.Flag`` pseudo-members: ``type(re.I)(n)`` creates and keeps one per
  new value (finding 3); each reachable flag class's value map goes back to
  its warm contents.
* ``re``'s compiled-pattern cache (``re._cache``): its oldest entries are
  evicted first whatever their use, so whether a pattern compiled earlier
  is still the same object told a later invocation, by value, which
  patterns an earlier one had compiled (a stored counter, by a later red-team
  pass); it goes back to its warm contents whenever an invocation added to
  it, so each invocation compiles its own patterns afresh.
* the module-global ``random`` generator, which library code uses
  (``statistics.NormalDist.samples``, finding 8): re-seeded from the OS when
  an invocation imports ``statistics`` (see ``sandbox.modules``).

ABC registries (``collections.ChainMap.register(str)``, finding 1) are not
reset: ``register`` is refused by the attribute guard (``sandbox.guards``).
What remains process-wide within one worker, and so within one guild, is
listed in docs/script-language.md.
"""
from __future__ import annotations

import codecs
import encodings
import enum
import os
import random
import re
from collections.abc import Iterable
from typing import Any

#: Longest codec name accepted; the longest name CPython knows is 20 characters.
MAX_CODEC_NAME = 64

_state: dict[str, Any] = {"installed": False, "dirty": False}
_encodings_cache: dict[str, Any] = getattr(encodings, "_cache", {})
_encodings_warm: dict[str, Any] = {}
_flag_maps: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
_re_cache: dict[Any, Any] = getattr(re, "_cache", {})
_re_warm: dict[Any, Any] = {}


def _bounded_search(name: str) -> Any:
    """The ``encodings`` search function, refusing long names, noting every hit."""
    if len(name) > MAX_CODEC_NAME:
        return None
    entry = encodings.search_function(name)
    if entry is not None:
        # The interpreter caches this hit under ``name``: empty its cache
        # after the invocation.
        _state["dirty"] = True
    return entry


def installed() -> bool:
    """True once :func:`install` ran in this process (or in the fork server it came from)."""
    return bool(_state["installed"])


def install(flag_classes: Iterable[type[enum.Flag]] = ()) -> None:
    """Take the warm state as the one to return to; call once, after warming.

    Idempotent. Replaces the ``encodings`` search function in the codec
    registry by :func:`_bounded_search` (which empties the interpreter's
    codec cache once).
    """
    if _state["installed"]:
        return
    _state["installed"] = True
    codecs.unregister(encodings.search_function)
    codecs.register(_bounded_search)
    _encodings_warm.clear()
    _encodings_warm.update(_encodings_cache)
    # Put back when its length changed: exact only while an addition cannot
    # evict, i.e. below `re`'s bound, where it drops its oldest entry first.
    while len(_re_cache) >= getattr(re, "_MAXCACHE", 512):
        del _re_cache[next(iter(_re_cache))]
    _re_warm.clear()
    _re_warm.update(_re_cache)
    for cls in flag_classes:
        members: dict[Any, Any] = cls._value2member_map_
        _flag_maps.append((members, dict(members)))


def after_invocation() -> None:
    """Put back what the invocation changed (cheap when it changed nothing)."""
    if not _state["installed"]:
        return
    if len(_encodings_cache) != len(_encodings_warm):
        _encodings_cache.clear()
        _encodings_cache.update(_encodings_warm)
    if len(_re_cache) != len(_re_warm):
        # Only an addition changes it: at its warm size it never evicts.
        _re_cache.clear()
        _re_cache.update(_re_warm)
    if _state["dirty"]:
        _state["dirty"] = False
        codecs.unregister(_bounded_search)  # also empties the interpreter's cache
        codecs.register(_bounded_search)
    for members, warm in _flag_maps:
        if len(members) != len(warm):
            members.clear()
            members.update(warm)


def reseed_library_random() -> None:
    """Give the module-global ``random`` generator a fresh seed from the OS."""
    random.seed(int.from_bytes(os.urandom(16), "big"))


def reachable_flag_classes(values: Iterable[Any]) -> list[type[enum.Flag]]:
    """``enum.Flag`` classes among ``values`` and their types."""
    found: dict[type[enum.Flag], None] = {}
    for value in values:
        for candidate in (value, type(value)):
            if isinstance(candidate, type) and issubclass(candidate, enum.Flag):
                found[candidate] = None
    return list(found)
