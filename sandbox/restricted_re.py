"""What scripts get of ``re`` and ``string.Template``: flags filtered, patterns exact.

``re.DEBUG`` prints to the worker's real stdout and ``re.LOCALE`` depends on the
process: both are refused, even as bare integers (redteam finding R3). ``re``
keeps patterns as keys of process-wide caches, so a script's ``str`` subclass
instance is copied to a plain ``str`` before it reaches them (R1).
``string.Template`` compiles its subclasses' patterns through the real
``re.compile`` at class creation: our ``Template`` does that itself, from
values it read once and checked (a second review, session 25).
"""
from __future__ import annotations

import re
import string
from typing import Any

from sandbox.guards import ScriptType

# --- re: flags are filtered so re.DEBUG (which prints to the real stdout)
# can never be passed, not even as a bare integer.
_RE_ALLOWED_FLAGS = int(re.ASCII | re.IGNORECASE | re.MULTILINE | re.DOTALL | re.VERBOSE | re.UNICODE)


def _re_flags(flags: Any) -> int:
    if type(flags) is not int and not isinstance(flags, re.RegexFlag):
        raise TypeError("flags must be an integer combination of re flags")
    value = int(flags)
    if value & ~_RE_ALLOWED_FLAGS:
        raise ValueError("unsupported re flag (re.DEBUG and re.LOCALE are not available)")
    return value


def exact(value: Any) -> Any:
    """An exact ``str``/``bytes`` copy of a subclass instance; anything else as is.

    ``re`` keeps patterns (and ``_strptime`` formats) as keys of process-wide
    caches; a script's ``str`` subclass instance can carry attributes (a
    suspended generator), which would then outlive the invocation and run
    its ``finally`` block when evicted, in another guild's invocation
    (redteam finding R1). The runtime detects any such leftover; this keeps
    the common routes from producing one.
    """
    tp = type(value)
    if tp is not str and isinstance(value, str):
        return str.__str__(value)
    if tp is not bytes and isinstance(value, bytes):
        return bytes(memoryview(value))
    return value


def _re_compile(pattern: Any, flags: Any = 0) -> re.Pattern[Any]:
    return re.compile(exact(pattern), _re_flags(flags))


def _re_search(pattern: Any, string: Any, flags: Any = 0) -> Any:
    return re.search(exact(pattern), string, _re_flags(flags))


def _re_match(pattern: Any, string: Any, flags: Any = 0) -> Any:
    return re.match(exact(pattern), string, _re_flags(flags))


def _re_fullmatch(pattern: Any, string: Any, flags: Any = 0) -> Any:
    return re.fullmatch(exact(pattern), string, _re_flags(flags))


def _re_split(pattern: Any, string: Any, maxsplit: int = 0, flags: Any = 0) -> list[Any]:
    return re.split(exact(pattern), string, maxsplit, _re_flags(flags))


def _re_findall(pattern: Any, string: Any, flags: Any = 0) -> list[Any]:
    return re.findall(exact(pattern), string, _re_flags(flags))


def _re_finditer(pattern: Any, string: Any, flags: Any = 0) -> Any:
    return re.finditer(exact(pattern), string, _re_flags(flags))


def _re_sub(pattern: Any, repl: Any, string: Any, count: int = 0, flags: Any = 0) -> Any:
    return re.sub(exact(pattern), exact(repl), string, count, _re_flags(flags))


def _re_subn(pattern: Any, repl: Any, string: Any, count: int = 0, flags: Any = 0) -> Any:
    return re.subn(exact(pattern), exact(repl), string, count, _re_flags(flags))


RE_MEMBERS = {
    "compile": _re_compile, "search": _re_search, "match": _re_match,
    "fullmatch": _re_fullmatch, "split": _re_split, "findall": _re_findall,
    "finditer": _re_finditer, "sub": _re_sub, "subn": _re_subn,
    "escape": re.escape, "error": re.error,
    "A": re.A, "ASCII": re.ASCII, "I": re.I, "IGNORECASE": re.IGNORECASE,
    "M": re.M, "MULTILINE": re.MULTILINE, "S": re.S, "DOTALL": re.DOTALL,
    "X": re.X, "VERBOSE": re.VERBOSE, "U": re.U, "UNICODE": re.UNICODE,
    "NOFLAG": re.NOFLAG,
}


# string.Formatter is the str.format engine (CVE-2023-41039): left out.
class Template(string.Template):
    """``string.Template`` whose subclasses cannot pick unsafe ``re`` flags.

    ``Template.__init_subclass__`` compiles the subclass's pattern with
    ``cls.flags`` through the real ``re.compile``: ``flags = 128`` was
    ``re.DEBUG`` (printing to the worker's stdout) past our ``re`` wrappers,
    and a ``str`` subclass ``pattern`` landed in ``re``'s cache (redteam
    findings R1, R3). Instances and ``isinstance`` work as with the original.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # string.Template.__init_subclass__ is not run: it reads each attribute
        # again, through descriptors a script's class can make answer every
        # read differently (``flags = classmethod(property(f))`` passed a check
        # here as 0 and reached ``re.compile`` as re.DEBUG: review, session 25).
        # Each value is read once, from the class dictionaries, checked, and
        # the pattern compiled from what was checked.
        if type(cls) not in (ScriptType, type):   # one could answer reads of the class
            raise TypeError("a Template subclass cannot have its own metaclass")
        super(string.Template, cls).__init_subclass__(**kwargs)
        flags = _re_flags(_class_value(cls, "flags"))
        if "pattern" in cls.__dict__:
            pattern = _template_text(cls.__dict__["pattern"], "pattern")
        else:
            delim = re.escape(_template_text(_class_value(cls, "delimiter"), "delimiter"))
            ident = _template_text(_class_value(cls, "idpattern"), "idpattern")
            brace = _class_value(cls, "braceidpattern")
            # As string.Template: an empty (or no) braced pattern is the plain one.
            brace = ident if brace is None else _template_text(brace, "braceidpattern") or ident
            pattern = fr"""
            {delim}(?:
              (?P<escaped>{delim})  |
              (?P<named>{ident})    |
              {{(?P<braced>{brace})}} |
              (?P<invalid>)
            )
            """
        cls.pattern = re.compile(pattern, flags | re.VERBOSE)


def _class_value(cls: type, name: str) -> Any:
    """``name`` as the first class of ``cls.__mro__`` holds it, no descriptor run."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    raise AttributeError(name)


def _template_text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"Template {name} must be a string")
    return str(exact(value))



