"""In-process execution of a compiled script's ``on endpoint`` block.

Used inside a sandbox worker process. ``run_endpoint`` builds fresh globals
from immutable bases, a fresh ``event`` and a fresh print collector, runs the
module code and then the block, seals the event, and returns plain,
msgpack-able data only (no object the script made ever leaves this module).
Process limits (time, memory) are the worker's job; this module bounds
recursion and keeps ``int``/``str`` conversion at CPython's digit limit.
"""
from __future__ import annotations

import decimal
import gc
import sys
import types
import warnings
from dataclasses import dataclass
from typing import Any

from sandbox.compiler import ENDPOINT_EVENT, CompiledScript
from sandbox.event import MAX_BODY_BYTES, ReplyState, new_event
from sandbox.guards import PrintCollector, fresh_builtins, fresh_globals
from sandbox import dict_tables, resets, set_insertion
from sandbox.modules import STATIC_NAMESPACES, make_importer, namespace_members
from sandbox.policy import handler_name

DEFAULT_OUTPUT_CAP = 16384
RECURSION_BUDGET = 200           # script frames (plus guard frames) per invocation
MAX_TRACEBACK_FRAMES = 20
MAX_MESSAGE_CHARS = 1000
INT_MAX_STR_DIGITS = 4300        # CPython's default
NEVER_REPLIED_BODY = b'{"success": true}'

_ENDPOINT_KEY = handler_name(ENDPOINT_EVENT)
_PRIMITIVES = (str, int, float, bool, type(None), bytes)
_ERROR_STATUS = {"script_error": 500, "script_memory_exceeded": 500,
                 "invalid_reply": 500, "no_endpoint_handler": 501}


@dataclass(slots=True)
class RunReport:
    """What the caller of :func:`run_endpoint` must know beyond the result.

    ``leaked`` is True when some script code (a function, a bound method, a
    suspended generator) is still referenced after the invocation was torn
    down: it was stored in process-wide state the script cannot name but can
    reach through a library, e.g. a ``str`` subclass instance carrying a
    generator used as an ``re`` pattern (``re``'s compile cache keeps it), a
    ``time.strptime`` format (``_strptime``'s cache) or an ``re`` replacement
    template (an ``lru_cache``).  When that entry is evicted, during another
    guild's invocation, the generator's ``finally`` block runs there.  A
    worker must not serve anyone else after such a run (redteam finding R1).
    """

    leaked: bool = False


# References to an invocation's globals that the runtime itself holds while
# it checks for leftovers: the ``scope`` local and getrefcount's argument.
_OWN_SCOPE_REFERENCES = 2
#: Whether ``dict.clear``/``update`` and ``Fraction`` are the checked ones in
#: this process (``sandbox.dict_tables``; needs the ``_typepatch`` extension).
DICT_TABLES_CHECKED = dict_tables.install()
#: Whether ``set``'s mutating methods refuse a set under insertion here
#: (``sandbox.set_insertion``; needs the ``_typepatch`` extension).
SET_INSERTION_CHECKED = set_insertion.install()


def prepare_worker_process() -> None:
    """Process-wide settings for a worker; call once after fork (and in the fork server).

    Takes the current state of the library caches in ``sandbox.resets`` as
    the one every invocation returns to.

    Warnings raised while a script runs (``bool(NotImplemented)``, a nested
    set in a regex) would be printed to the worker's stderr once per
    invocation; they are not the operator's concern, so they are ignored.
    Doing this per call (``warnings.catch_warnings``) would cost ~2 µs.
    """
    warnings.simplefilter("ignore")
    if not 0 < sys.get_int_max_str_digits() <= INT_MAX_STR_DIGITS:
        sys.set_int_max_str_digits(INT_MAX_STR_DIGITS)
    if resets.installed():
        return  # done in the fork server before the fork (~0.6 ms a worker saved)
    members = [v for ns in STATIC_NAMESPACES.values() for v in namespace_members(ns)]
    resets.install(resets.reachable_flag_classes(members))


def _new_globals(collector: PrintCollector) -> dict[str, Any]:
    builtins = fresh_builtins()
    builtins["__import__"] = make_importer()
    scope = fresh_globals()
    scope["__builtins__"] = builtins
    scope["_print_"] = collector
    return scope


def _stack_depth() -> int:
    depth = 0
    frame: types.FrameType | None = sys._getframe()
    while frame is not None:
        depth += 1
        frame = frame.f_back
    return depth


def run_endpoint(script: CompiledScript, event: dict[str, Any], *,
                 output_cap: int = DEFAULT_OUTPUT_CAP,
                 report: RunReport | None = None, decoded: bool = False) -> dict[str, Any]:
    """Run the script's ``on endpoint`` block for one request.

    ``decoded``: ``event`` was decoded for this invocation alone (a worker's
    job), so the script gets its containers as they are instead of a deep
    copy: made before the memory guard was armed, they are not charged to
    the script (a body of many small containers would otherwise break a
    script's cap before its first line runs).

    Returns ``{"replied", "status", "headers", "body", "contentType",
    "output", "error"}`` made of plain data. Never raises for anything the
    script does. ``report``, if given, is filled in (see :class:`RunReport`).
    """
    collector = PrintCollector(output_cap)
    state = ReplyState(script.code.co_filename)
    if not script.has_endpoint:
        return _result(state, collector, _error("no_endpoint_handler",
                                                'the script has no "on endpoint" block'))
    if not 0 < sys.get_int_max_str_digits() <= INT_MAX_STR_DIGITS:
        sys.set_int_max_str_digits(INT_MAX_STR_DIGITS)
    scope = _new_globals(collector)
    # decimal keeps a per-thread current context; give every invocation a
    # fresh one so precision/traps/flags set by one script are gone next time.
    decimal.setcontext(decimal.Context())
    old_limit = sys.getrecursionlimit()
    limit = _stack_depth() + RECURSION_BUDGET
    error: dict[str, Any] | None = None
    try:
        ev = new_event(event, state, copy=not decoded)
        sys.setrecursionlimit(limit)
        error = _run_script(script, scope, ev, old_limit, state)
    except MemoryError as exc:
        error = _error("script_memory_exceeded", "the script used more memory than its plan allows")
        try:  # where: the allocation that failed (the cap may refuse this too)
            where = _describe(exc, script)
            error["line"], error["traceback"] = where["line"], where["traceback"]
        except BaseException:  # noqa: BLE001 - the kind and message stand without it
            pass
    except BaseException as exc:  # noqa: BLE001 - everything the script raises is an outcome
        if state.invalid is None:
            error = _script_error(exc, script)
    finally:
        # Drop the script's objects now, while the event is sealed, so
        # finalisers (generators' finally blocks) run here and not during the
        # next invocation; what they raise is dropped, not printed.
        hook = sys.unraisablehook
        sys.unraisablehook = _ignore_unraisable
        # Finalisers are script code: the run's recursion budget holds for them
        # too (red-team pass, session 34). Only a generator's (or coroutine's)
        # frame can run script code now: nothing else of a script finalises.
        finalising = script.has_generators
        if finalising:
            sys.setrecursionlimit(limit)
        try:
            dict_tables.original_clear(scope)
            # Every piece of script code that could still run (functions,
            # methods, generators' frames through their function) references
            # this globals dict; once cleared, only we should.
            if script.has_generators or sys.getrefcount(scope) > _OWN_SCOPE_REFERENCES:
                # A suspended generator in a reference cycle would otherwise
                # run its finally block whenever the collector next runs:
                # during another guild's invocation. Collect now (cheap in a
                # worker whose heap is gc.freeze()-d); a second pass catches
                # what the first pass's finalisers left behind. Classes and
                # functions always sit in cycles, so the count above is only
                # final after a collection.
                if gc.collect():
                    gc.collect()
            if report is not None:
                # Still referenced: script code survives in process-wide state.
                report.leaked = sys.getrefcount(scope) > _OWN_SCOPE_REFERENCES
        finally:
            if finalising:
                sys.setrecursionlimit(old_limit)
            sys.unraisablehook = hook
            resets.after_invocation()
    if state.invalid is not None and (error is None or error["kind"] == "script_error"):
        error = _error("invalid_reply", state.invalid, state.invalid_line)
    return _result(state, collector, error)


def _run_script(script: CompiledScript, scope: dict[str, Any], ev: Any, old_limit: int,
                state: ReplyState) -> dict[str, Any] | None:
    """The script's module code, then its endpoint block; None, or the error
    of a script without one.

    A function of its own, kept short: when an exception leaves a ``finally``
    block, CPython 3.11 makes an int of the frame's instruction offset, and
    if that allocation fails (a script that filled the address space through
    OpenSSL's allocator) it tries again for ever, spinning the worker until
    the time limit. Offsets below 256 are preallocated ints."""
    try:
        exec(script.code, scope)
        handler = scope.get(_ENDPOINT_KEY)
        if type(handler) is not types.FunctionType:
            return _error("no_endpoint_handler", 'the script has no "on endpoint" block')
        handler(ev)
        return None
    finally:
        sys.setrecursionlimit(old_limit)
        state.sealed = True


def _ignore_unraisable(unraisable: Any) -> None:
    """Swallow errors of script finalisers run while releasing its globals."""


def _error(kind: str, message: str, line: int | None = None,
           traceback: str | None = None) -> dict[str, Any]:
    # Bounded here for every kind: the service refuses longer messages from a
    # worker (protocol.check_result), e.g. "status must be ..., not <4300 digits>".
    return {"kind": kind, "message": _clean(message), "line": line, "traceback": traceback}


def _result(state: ReplyState, collector: PrintCollector,
            error: dict[str, Any] | None) -> dict[str, Any]:
    output = collector.text()
    if error is not None:
        return {"replied": False, "status": _ERROR_STATUS.get(error["kind"], 500), "headers": [],
                "body": b"", "contentType": "", "output": output, "error": error}
    if not state.replied:
        return {"replied": False, "status": 200, "headers": [], "body": NEVER_REPLIED_BODY,
                "contentType": "application/json", "output": output, "error": None}
    body, content_type = state.body()
    if len(body) > MAX_BODY_BYTES:
        # The cap applies to the bytes sent: text sent as JSON (no
        # Content-Type) grows when encoded, a control character to 6 bytes.
        return _result(state, collector, _error(
            "invalid_reply", f"reply is {len(body)} bytes once encoded as JSON, over the "
            f"{MAX_BODY_BYTES}-byte limit (control characters become 6-byte escapes; set a "
            "Content-Type header to send text as is)", state.reply_line))
    return {"replied": True, "status": state.status, "headers": [list(h) for h in state.headers],
            "body": body, "contentType": content_type, "output": output, "error": None}


def _clean(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """Text safe for msgpack (valid UTF-8) and bounded in size."""
    if len(text) > limit:
        text = text[:limit] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# Read through the C descriptors: a script's exception class may shadow
# ``args`` with a property, and no script code may run while we report.
_EXC_ARGS = BaseException.__dict__["args"]
_EXC_TRACEBACK = BaseException.__dict__["__traceback__"]
_TYPE_MODULE = type.__dict__["__module__"]
_TYPE_NAME = type.__dict__["__name__"]


def _exception_text(exc: BaseException) -> str:
    """``str(exc)`` without running any method the script could have supplied."""
    args = _EXC_ARGS.__get__(exc)
    if type(args) is not tuple:
        args = ()
    if all(type(a) in _PRIMITIVES for a in args):
        # Builtin exceptions format from args (and, for OSError, filenames
        # that may be any object, so those use our rendering below).
        if not args or (_TYPE_MODULE.__get__(type(exc)) == "builtins"
                        and not isinstance(exc, OSError)):
            try:
                return str(exc)
            except Exception:  # noqa: BLE001 - a broken __str__ must not break us
                return ""
        if len(args) == 1:
            arg = args[0]
            return arg if type(arg) is str else repr(arg)
        return repr(args)
    return ", ".join(repr(a) if type(a) in _PRIMITIVES else f"<{type(a).__name__} object>"
                     for a in args)


def _type_name(exc: BaseException) -> str:
    name = _TYPE_NAME.__get__(type(exc))
    return name if type(name) is str else "Exception"


def _script_error(exc: BaseException, script: CompiledScript) -> dict[str, Any]:
    try:
        return _describe(exc, script)
    except BaseException:  # noqa: BLE001 - reporting must never fail the invocation
        return _error("script_error", _clean(_type_name(exc)))


def script_frames(frame: types.FrameType | None, script: CompiledScript) -> list[tuple[int, str]]:
    """(line, function) of the script's own frames on the stack ending at
    `frame`, outermost first (trusted code's frames left out)."""
    frames: list[tuple[int, str]] = []
    filename = script.code.co_filename
    while frame is not None:
        if frame.f_code.co_filename == filename:
            frames.append((frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    frames.reverse()
    return frames


def _describe(exc: BaseException, script: CompiledScript) -> dict[str, Any]:
    name = _type_name(exc)
    text = _exception_text(exc)
    message = _clean(f"{name}: {text}" if text else name)
    frames: list[tuple[int, str]] = []
    filename = script.code.co_filename
    tb = _EXC_TRACEBACK.__get__(exc)
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename == filename:
            frames.append((tb.tb_lineno, code.co_name))
        tb = tb.tb_next
    line = frames[-1][0] if frames else None
    return _error("script_error", message, line, script_traceback(frames, script, message))


def script_traceback(frames: list[tuple[int, str]], script: CompiledScript, message: str) -> str:
    """A traceback of the script's frames (outermost first), with their source lines."""
    filename = script.code.co_filename
    lines = ["Traceback (most recent call last):"]
    if len(frames) > MAX_TRACEBACK_FRAMES:
        lines.append(f"  ... {len(frames) - MAX_TRACEBACK_FRAMES} earlier frames omitted")
        frames = frames[-MAX_TRACEBACK_FRAMES:]
    for lineno, func in frames:
        lines.append(f'  File "{filename}", line {lineno}, in {func}')
        if 0 < lineno <= len(script.source_lines):
            source = script.source_lines[lineno - 1].strip()
            if source:
                lines.append(f"    {source[:200]}")
    lines.append(message)
    return _clean("\n".join(lines), 20000)
