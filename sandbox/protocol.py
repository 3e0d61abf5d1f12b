"""Length-prefixed msgpack frames between the pool and its workers.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack.
msgpack is data only (never pickle: unpickling a compromised worker's bytes
would run its code in the service).  The length is checked against a cap
*before* any body is buffered, so a hostile peer cannot make the other side
hold more than one capped frame, and every decoded message is checked for its
exact shape before anyone acts on it.

Messages (``t`` is the type):

parent -> worker
    ``{"t": "job", "id", "key", "ver", "dig": source SHA-256, "src": str | None,
    "code": marshalled code | None, "meta": {"events", "endpoint", "gen", "err"} | None,
    "event", "ms", "mem", "until"}`` (``meta`` set: load ``code``, do not compile;
    ``until``: the service's ``time.monotonic()`` at which ``ms`` ends, so the
    worker's report of where the script was comes before the kill even when the
    job reached it late)
    ``{"t": "compile", "id", "src"}``  (to the compile worker only)
    ``{"t": "exec", "id", "code"}``  (test hook; refused unless the pool enabled it)
worker -> parent
    ``{"t": "ready", "pid", "hard": {layer: bool}, "notes": [str], "ms": {step: float}}``
    (``ms``: what the worker's start-up steps cost; optional)
    ``{"t": "need", "id"}``  (worker lacks the source for that script version)
    ``{"t": "compiled", "id"}``  (worker compiled the source it was sent; the run starts;
    a worker that has never run a script adds ``"code"``, ``"meta"``: the marshalled
    code, offered to the code cache of the job's guild)
    ``{"t": "where", "id", "line", "tb"}``  (the script's time ran out: where it was; the
    supervisor's kill still ends it)
    ``{"t": "res", "id", "r": run_endpoint result, "peak", "over", "dur", "exit",
    "rss"}`` (``rss``: the worker's resident bytes after the job)
    ``{"t": "xres", "id", "ok", "value"}``
    ``{"t": "code", "id", "code": marshalled code | None, "meta", "exit"}`` (a compile's
    result)
"""
from __future__ import annotations

import math
import socket
from typing import Any, Callable, Iterator

import msgpack  # type: ignore[import-untyped]

from sandbox.errors import ProtocolError
from sandbox.event import MAX_BODY_BYTES, MAX_HEADERS, header_problem

# A job carries the event twice over in the worst case (parsed body and raw
# body, each up to the largest plan's 1 MiB) plus a source of up to 256 KiB.
MAX_JOB_BYTES = 5 * 1024 * 1024
MAX_REPLY_BYTES = 4 * 1024 * 1024
#: Marshalled code a worker offers with its reply or the compile worker sends
#: (`sandbox.compiler.MAX_CODE_BYTES`: no version that compiles is larger).
MAX_SHIPPED_CODE = 2 * 1024 * 1024
HEADER_BYTES = 4

ERROR_KINDS = frozenset(
    {"script_error", "script_timeout", "script_memory_exceeded", "invalid_reply",
     "no_endpoint_handler", "crash"}
)

# print() output: 16 KB of UTF-8 (so at most as many characters) plus the
# truncation marker; error messages and tracebacks are bounded by the runtime.
MAX_OUTPUT_CHARS = 16384 + 64
MAX_ERROR_MESSAGE_CHARS = 1000 + 3
MAX_TRACEBACK_CHARS = 20000 + 3

#: What a worker's frame may decode to: every object counts (map keys and values,
#: array elements); a reply with 64 headers is ~240 objects, 4 containers deep.
#: Checked before decoding (``sandbox._frameshape``), so a worker taken over by
#: its script cannot make the service build ~70 bytes of Python per byte sent.
#: A frame of at most MAX_REPLY_ITEMS bytes is not walked: every object takes a
#: byte at least, so it cannot hold more (the common reply: no cost at all).
MAX_REPLY_ITEMS = 4096
MAX_REPLY_DEPTH = 8

_packer = msgpack.Packer(use_bin_type=True)

try:
    from sandbox._frameshape import items as _items
except ImportError:  # the extension did not build: the same walk in Python, slower
    from sandbox.frameshape import items as _items


def encode(message: dict[str, Any], cap: int) -> bytes:
    """One frame for ``message``; raises :class:`ProtocolError` past ``cap`` bytes."""
    try:
        body: bytes = _packer.pack(message)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode frame: {type(exc).__name__}") from None
    if len(body) > cap:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds the {cap}-byte cap")
    return len(body).to_bytes(HEADER_BYTES, "big") + body


def decode(body: bytes | memoryview, bounded: bool = False) -> Any:
    """Decode one frame body; raises :class:`ProtocolError` for anything but msgpack.
    ``bounded``: a worker's frame, refused past ``MAX_REPLY_ITEMS`` objects or
    ``MAX_REPLY_DEPTH`` levels before anything is decoded."""
    if bounded and len(body) > MAX_REPLY_ITEMS and _items(body, MAX_REPLY_ITEMS,
                                                          MAX_REPLY_DEPTH) < 0:
        raise ProtocolError("frame holds too many objects, nests too deep or is not msgpack")
    try:
        # strict_map_key: only str/bytes keys; raw=False: str stays str.
        return msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}") from None


class FrameReader:
    """Incremental frame splitter for a non-blocking stream; one per channel."""

    __slots__ = ("_buf", "_cap", "_bounded")

    def __init__(self, cap: int, bounded: bool = False) -> None:
        self._buf = bytearray()
        self._cap = cap
        self._bounded = bounded   # see ``decode``

    def feed(self, data: bytes) -> Iterator[Any]:
        """Yield every complete message in the buffer after adding ``data``."""
        buf = self._buf
        if not buf and len(data) >= HEADER_BYTES:
            # Hot path: the chunk holds exactly one whole frame, no copying.
            n = int.from_bytes(data[:HEADER_BYTES], "big")
            if n > self._cap:
                raise ProtocolError(f"frame of {n} bytes exceeds the {self._cap}-byte cap")
            if len(data) == HEADER_BYTES + n:
                yield decode(memoryview(data)[HEADER_BYTES:], self._bounded)
                return
        buf += data
        while len(buf) >= HEADER_BYTES:
            n = int.from_bytes(buf[:HEADER_BYTES], "big")
            if n > self._cap:
                raise ProtocolError(f"frame of {n} bytes exceeds the {self._cap}-byte cap")
            end = HEADER_BYTES + n
            if len(buf) < end:
                return
            body = bytes(buf[HEADER_BYTES:end])
            del buf[:end]
            yield decode(body, self._bounded)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        part = sock.recv(min(n - len(chunks), 1 << 20))
        if not part:
            raise EOFError("channel closed")
        chunks += part
    return bytes(chunks)


def recv_message(sock: socket.socket, cap: int,
                 before_body: Callable[[int], object] | None = None) -> Any:
    """Blocking read of one message (worker side and start-up); EOFError when
    closed. ``before_body`` is told the frame's size before it is read."""
    header = _recv_exactly(sock, HEADER_BYTES)
    n = int.from_bytes(header, "big")
    if n > cap:
        raise ProtocolError(f"frame of {n} bytes exceeds the {cap}-byte cap")
    if before_body is not None:
        before_body(n)
    return decode(_recv_exactly(sock, n))


def send_message(sock: socket.socket, message: dict[str, Any], cap: int) -> None:
    """Blocking write of one message."""
    sock.sendall(encode(message, cap))


# --- validation -------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return type(value) is int


def _opt(value: Any, kind: type) -> bool:
    return value is None or type(value) is kind


def check_job(msg: Any) -> dict[str, Any]:
    """Validate a parent -> worker message; raises :class:`ProtocolError`."""
    if type(msg) is not dict:
        raise ProtocolError("message is not a map")
    t = msg.get("t")
    if t == "job":
        ok = (_is_int(msg.get("id")) and type(msg.get("key")) is str and _is_int(msg.get("ver"))
              and type(msg.get("dig")) is bytes and _opt(msg.get("src"), str)
              and _opt(msg.get("code"), bytes)
              and (msg.get("meta") is None or (check_meta(msg["meta"]) and msg["src"] is not None))
              and type(msg.get("event")) is dict
              and _is_int(msg.get("ms")) and _is_int(msg.get("mem"))
              and type(msg.get("until")) is float)
    elif t == "compile":
        ok = _is_int(msg.get("id")) and type(msg.get("src")) is str
    elif t == "exec":
        ok = _is_int(msg.get("id")) and type(msg.get("code")) is str
    else:
        ok = False
    if not ok:
        raise ProtocolError(f"malformed job message {t!r}")
    return msg


_META_KEYS = frozenset({"events", "endpoint", "gen", "err"})


def check_meta(meta: Any) -> bool:
    """The ``meta`` of compiled code: events, endpoint, generators, first compile error."""
    if type(meta) is not dict or meta.keys() != _META_KEYS:
        return False
    events, err = meta.get("events"), meta.get("err")
    return (type(events) is list and len(events) <= 64
            and all(type(e) is str and len(e) <= 256 for e in events)
            and type(meta.get("endpoint")) is bool and type(meta.get("gen")) is bool
            and (err is None or (type(err) is list and len(err) == 2
                                 and (err[0] is None or _is_int(err[0]))
                                 and type(err[1]) is str
                                 and len(err[1]) <= MAX_ERROR_MESSAGE_CHARS)))


def _check_headers(headers: Any) -> bool:
    # The same rule the worker applied at event.header(): a worker that was
    # taken over must not get a framing or hop-by-hop header onto the wire.
    if type(headers) is not list or len(headers) > MAX_HEADERS:
        return False
    for pair in headers:
        if type(pair) is not list or len(pair) != 2:
            return False
        if type(pair[0]) is not str or type(pair[1]) is not str:
            return False
        if header_problem(pair[0], pair[1]) is not None:
            return False
    return True


#: A script line number: a source of at most 256 KB has fewer lines than this.
#: Stored as an integer column (PostgreSQL's is 32-bit): a compromised
#: worker's 2**64-1 made the records writer's batch fail (security review,
#: session 16).
MAX_LINE = 1 << 20


def _line(value: Any) -> bool:
    return value is None or (_is_int(value) and 0 <= value <= MAX_LINE)


#: The keys each worker message must have, and those it may add: no more (a
#: frame padded with a key nothing reads was accepted, on every request) and no
#: fewer (a message without one raised KeyError in the service instead of a
#: protocol error). "res", its result and error are checked by counting
#: (``check_reply``, ``check_result``, ``_check_error``).
_MESSAGE_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "code": (frozenset({"t", "id", "code", "meta", "exit"}), frozenset()),
    "need": (frozenset({"t", "id"}), frozenset()),
    "compiled": (frozenset({"t", "id"}), frozenset({"code", "meta"})),
    "where": (frozenset({"t", "id", "line", "tb"}), frozenset()),
    "ready": (frozenset({"t", "pid", "hard", "notes"}), frozenset({"ms"})),
    "xres": (frozenset({"t", "id", "ok"}), frozenset({"value"})),
}


def _keys_fit(msg: dict[str, Any], t: str) -> bool:
    required, optional = _MESSAGE_KEYS[t]
    keys = msg.keys()
    return keys >= required and keys <= required | optional


def _check_error(error: Any) -> bool:
    if error is None:
        return True
    # Four keys, two of them named ("kind" and "message" must hold strings):
    # exactly kind, message, line, traceback (counted, not compared: the hot path).
    return (type(error) is dict and len(error) == 4 and "line" in error and "traceback" in error
            and type(error.get("kind")) is str and error["kind"] in ERROR_KINDS
            and type(error.get("message")) is str and _line(error.get("line"))
            and _opt(error.get("traceback"), str)
            and len(error["message"]) <= MAX_ERROR_MESSAGE_CHARS
            and (error["traceback"] is None or len(error["traceback"]) <= MAX_TRACEBACK_CHARS))


def check_result(r: Any) -> bool:
    """True when ``r`` has exactly the shape ``run_endpoint`` promises.

    The worker is assumed compromised here, so everything the service will
    act on is checked with the script-facing rules again (redteam finding
    R4): a reply's status is 200-599, every header and the content type pass
    ``event.header_problem`` (no ``Set-Cookie``, framing, CR/LF, ...), and
    sizes stay within what the runtime can produce.
    """
    # Seven keys, "error" among them (the other six must hold values): exactly
    # replied, status, headers, body, contentType, output, error.
    if not (type(r) is dict and len(r) == 7 and "error" in r and type(r.get("replied")) is bool
            and _is_int(r.get("status")) and 100 <= r["status"] <= 599
            and _check_headers(r.get("headers")) and type(r.get("body")) is bytes
            and type(r.get("contentType")) is str and type(r.get("output")) is str
            and _check_error(r.get("error"))):
        return False
    if len(r["body"]) > MAX_BODY_BYTES or len(r["output"]) > MAX_OUTPUT_CHARS:
        return False
    if r["replied"]:
        if not 200 <= r["status"] <= 599 or len(r["headers"]) > MAX_HEADERS:
            return False
        if any(header_problem(n, v) is not None or n.lower() == "content-type"
               for n, v in r["headers"]):
            return False
        if header_problem("Content-Type", r["contentType"]) is not None:
            return False
    return True


def _check_measures(msg: dict[str, Any]) -> bool:
    """``dur`` (ms) and ``peak`` are stored, summed and logged: finite,
    non-negative, bounded (a duration past a day would sum to infinity in the
    statistics and be written as JSON's non-standard ``Infinity``)."""
    dur, peak = msg.get("dur"), msg.get("peak")
    if type(dur) is not float or not _is_int(peak):
        return False
    assert isinstance(peak, int)
    return math.isfinite(dur) and 0.0 <= dur <= MAX_DURATION_MS and 0 <= peak < 1 << 63


#: A job's run time in ms can be no more than the longest time limit plus the
#: compile budget; a day bounds it with room to spare.
MAX_DURATION_MS = 86_400_000.0


#: The start-up steps a ready message may time (``WorkerHandle`` sums them).
SPAWN_STEPS = ("fork", "harden", "init")


def _check_steps(steps: Any) -> bool:
    """``ms`` of a ready message: absent, or finite non-negative floats per known step."""
    if steps is None:
        return True
    return (type(steps) is dict and len(steps) <= len(SPAWN_STEPS)
            and all(k in SPAWN_STEPS and type(v) is float and math.isfinite(v)
                    and 0.0 <= v < 1e7 for k, v in steps.items()))


def check_reply(msg: Any) -> dict[str, Any]:
    """Validate a worker -> parent message; raises :class:`ProtocolError`."""
    if type(msg) is not dict:
        raise ProtocolError("message is not a map")
    t = msg.get("t")
    if t == "res":
        # The seven keys below must hold values; "rss" may be left out: no other key.
        ok = ((len(msg) == 7 or (len(msg) == 8 and "rss" in msg))
              and _is_int(msg.get("id")) and check_result(msg.get("r")) and _check_measures(msg)
              and type(msg.get("over")) is bool and type(msg.get("exit")) is bool
              and (msg.get("rss") is None
                   or (_is_int(msg.get("rss")) and 0 <= msg["rss"] < 1 << 63)))
    elif type(t) is not str or t not in _MESSAGE_KEYS or not _keys_fit(msg, t):
        ok = False
    elif t == "code":
        ok = (_is_int(msg.get("id")) and _opt(msg.get("code"), bytes)
              and check_meta(msg.get("meta")) and type(msg.get("exit")) is bool
              and (msg["code"] is None) == (msg["meta"]["err"] is not None))
    elif t == "need":
        ok = _is_int(msg.get("id"))
    elif t == "compiled":
        ok = (_is_int(msg.get("id"))
              and (("code" not in msg and "meta" not in msg)
                   or (type(msg.get("code")) is bytes
                       and 0 < len(msg["code"]) <= MAX_SHIPPED_CODE
                       and check_meta(msg.get("meta")) and msg["meta"]["err"] is None)))
    elif t == "where":
        tb = msg.get("tb")
        ok = (_is_int(msg.get("id")) and _line(msg.get("line"))
              and type(tb) is str and len(tb) <= MAX_TRACEBACK_CHARS)
    elif t == "ready":
        hard = msg.get("hard")
        ok = (_is_int(msg.get("pid")) and type(hard) is dict
              and all(type(k) is str and type(v) is bool for k, v in hard.items())
              and type(msg.get("notes")) is list
              and all(type(n) is str for n in msg["notes"])
              and _check_steps(msg.get("ms")))
    elif t == "xres":
        ok = _is_int(msg.get("id")) and type(msg.get("ok")) is bool
    else:
        ok = False
    if not ok:
        raise ProtocolError(f"malformed worker message {t!r}")
    return msg
