"""The ``event`` object a script's ``on endpoint`` block receives, and reply checks.

Everything a script hands to ``event.status/header/reply`` is checked here
with exact types (``type(x) is int``; no subclasses, so no script-defined
``__eq__``/``__hash__``/``__str__`` ever runs in trusted code) and turned into
plain bytes and strings at the call. A bad value raises at the call *and*
marks the invocation ``invalid_reply`` for good: catching the exception does
not make the reply valid (docs/script-language.md).
"""
from __future__ import annotations

import json
import math
import re
import sys
import types
from typing import Any, NoReturn

MAX_BODY_BYTES = 1048576        # 1 MiB reply body
MAX_DEPTH = 32                  # nesting of reply containers
MAX_HEADERS = 64
MAX_HEADER_NAME = 128
MAX_HEADER_VALUE = 8192

# Hop-by-hop and framing headers belong to the server; X-Request-Id and the
# RateLimit-* family are set by the service (DESIGN section 4). The last group
# changes state for the whole origin the dashboard shares (cookies, HSTS,
# stored data), which one guild's script must not decide.
FORBIDDEN_HEADERS = frozenset({
    "connection", "keep-alive", "transfer-encoding", "content-length", "upgrade",
    "te", "trailer", "host",
    "x-request-id", "ratelimit-limit", "ratelimit-remaining", "ratelimit-reset",
    "set-cookie", "set-cookie2", "strict-transport-security", "alt-svc",
    "clear-site-data", "nel", "report-to", "reporting-endpoints", "accept-ch",
    "critical-ch", "set-login", "origin-agent-cluster", "expect-ct", "public-key-pins",
    "public-key-pins-report-only", "service-worker-allowed", "x-sendfile",
    # Browser state keyed by the origin or its URLs: a compression dictionary
    # for later responses, a device-bound session, storage access, cache keys.
    "use-as-dictionary", "sec-session-registration", "activate-storage-access",
    "no-vary-search",
    # More of it (red-team pass, session 34): the origin's shared storage, its
    # identity-provider sign-in status, speculative loads of its other URLs.
    "shared-storage-write", "idp-signinstatus", "speculation-rules",
    "observe-browsing-topics",
})
# Proxy-control headers: a reverse proxy in front (nginx's X-Accel-*, Apache's
# and lighttpd's X-Sendfile*, LiteSpeed's X-LiteSpeed-*) obeys them, so a
# script could make it serve another location or change its buffering.
FORBIDDEN_PREFIXES = ("proxy-", "x-accel-", "x-sendfile", "x-litespeed-", "x-lighttpd-",
                      # Device-bound session credentials, under their draft and their
                      # shipped names: a session bound to the origin of the dashboard.
                      "sec-session-", "secure-session-",
                      # The service's own headers: every RateLimit name (the drafts'
                      # `RateLimit` and `RateLimit-Policy` too), the service's hint
                      # (`X-Logic-Hint`; review, session 28: a script could send one
                      # a caller would take for the service's).
                      "ratelimit", "x-logic-",
                      # Origin-keyed browser state: attribution reporting's sources
                      # and triggers, ad auctions' interest groups and signals.
                      "attribution-reporting-", "ad-auction-", "shared-storage-")
#: `WWW-Authenticate` schemes a browser answers with its own password prompt,
#: which would ask for credentials on the dashboard's origin.
_PROMPTING_SCHEME = re.compile(r"(?:^|,)[ \t]*(?:basic|digest|ntlm|negotiate)(?![!#$%&'*+\-.^_`|~\w])",
                               re.IGNORECASE)
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789"
                         "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _no_default(value: Any) -> Any:
    raise TypeError("not JSON-serialisable")


# The C encoder called directly skips JSONEncoder.encode's per-call setup
# (~1 µs of a ~3 µs reply). No circular-reference markers: _plain already
# bounded the depth of the fresh copy it is given.
_make_encoder = getattr(json.encoder, "c_make_encoder", None)
_C_ENCODER = None if _make_encoder is None else _make_encoder(
    None, _no_default, json.encoder.encode_basestring, None, ":", ",", False, False, False)


def encode_json(plain: Any) -> str:
    """JSON text for data made of exact builtin types (see _plain)."""
    if _C_ENCODER is not None:
        return "".join(_C_ENCODER(plain, 0))
    return _ENCODER.encode(plain)
_EVENT_TOKEN = object()


class ReplyError(ValueError):
    """A value given to event.status/header/reply was refused."""


class ReplyState:
    """What the script asked for so far; owned by one invocation."""

    __slots__ = ("status", "headers", "content_type", "kind", "payload", "replied",
                 "invalid", "invalid_line", "reply_line", "sealed", "filename")

    def __init__(self, filename: str = "<script>") -> None:
        self.status = 200
        self.headers: list[list[str]] = []
        self.content_type: str | None = None
        self.kind = ""                  # "json", "text" or "bytes"
        self.payload: bytes | str = b""
        self.replied = False
        self.invalid: str | None = None  # first refusal message, sticky
        self.invalid_line: int | None = None
        #: Line of the last reply with text that may grow past the cap once
        #: encoded as JSON (checked when the answer is made: a Content-Type set
        #: after the reply sends the text as is).
        self.reply_line: int | None = None
        self.sealed = False
        self.filename = filename

    def refuse(self, message: str) -> NoReturn:
        if self.invalid is None:
            self.invalid = message
            self.invalid_line = self._script_line()
        raise ReplyError(message)

    def _script_line(self) -> int | None:
        """Line of the innermost script frame (the call that was refused)."""
        frame: types.FrameType | None = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename == self.filename:
                return frame.f_lineno
            frame = frame.f_back
        return None

    def check_open(self) -> None:
        if self.sealed:
            raise RuntimeError("the event is sealed: the on endpoint block has returned")

    def body(self) -> tuple[bytes, str]:
        """Final body bytes and content type (DESIGN section 5 reply rules)."""
        if self.kind == "text":
            assert isinstance(self.payload, str)
            if self.content_type is not None:
                return self.payload.encode("utf-8"), self.content_type
            return encode_json(self.payload).encode("utf-8"), "application/json"
        assert isinstance(self.payload, bytes)
        default = "application/octet-stream" if self.kind == "bytes" else "application/json"
        return self.payload, self.content_type or default


def _plain(value: Any, depth: int, budget: list[int], state: ReplyState) -> Any:
    """A fresh JSON-able copy of ``value`` made only of exact builtin types."""
    if budget[0] < 0:
        # checked per value, so a huge list stops at the cap, not at its end
        state.refuse(f"reply is larger than {MAX_BODY_BYTES} bytes")
    tp = type(value)
    if value is None or tp is bool:
        budget[0] -= 5
        return value
    if tp is int:
        budget[0] -= value.bit_length() // 3 + 1
        return value
    if tp is float:
        if not math.isfinite(value):
            state.refuse("reply contains NaN or Infinity, which JSON cannot carry")
        budget[0] -= 24
        return value
    if tp is str:
        budget[0] -= len(value) + 2
        return value
    if depth >= MAX_DEPTH:
        state.refuse(f"reply is nested deeper than {MAX_DEPTH} levels")
    if tp is dict:
        out: dict[str, Any] = {}
        for key, item in value.items():
            # Check the key's type before anything hashes or compares it.
            if type(key) is not str:
                state.refuse(f"reply dict keys must be str, not {type(key).__name__}")
            budget[0] -= len(key) + 4
            out[key] = _plain(item, depth + 1, budget, state)
        return out
    if tp is list or tp is tuple:
        return [_plain(item, depth + 1, budget, state) for item in value]
    state.refuse(f"reply value of type {tp.__name__} cannot be sent as JSON")


class Event:
    """The request as a script sees it, with the three reply methods.

    Read-only to scripts through the write guard (Event is not a writable
    type), not through ``__setattr__``: overriding it costs ~1 µs per
    invocation in ``__init__`` and guards nothing a script can reach.
    """

    __slots__ = ("body", "rawBody", "headers", "query", "method", "ip", "userAgent",
                 "timestamp", "_state")

    body: Any
    rawBody: Any
    headers: Any
    query: Any
    method: Any
    ip: Any
    userAgent: Any
    timestamp: Any
    _state: ReplyState

    def __init__(self, token: object, fields: dict[str, Any], state: ReplyState,
                 copy: bool = True) -> None:
        if token is not _EVENT_TOKEN:
            raise TypeError("event objects cannot be created by scripts")
        get = fields.get
        if not copy:   # decoded for this invocation alone: nothing else holds it
            self.body, self.rawBody, self.headers, self.query = (
                get("body"), get("rawBody"), get("headers"), get("query"))
            self.method, self.ip, self.userAgent, self.timestamp = (
                get("method"), get("ip"), get("userAgent"), get("timestamp"))
            self._state = state
            return
        self.body = fresh_copy(get("body"))
        self.rawBody = fresh_copy(get("rawBody"))
        self.headers = fresh_copy(get("headers"))
        self.query = fresh_copy(get("query"))
        self.method = fresh_copy(get("method"))
        self.ip = fresh_copy(get("ip"))
        self.userAgent = fresh_copy(get("userAgent"))
        self.timestamp = fresh_copy(get("timestamp"))
        self._state = state

    def __init_subclass__(cls, **kwargs: Any) -> NoReturn:
        raise TypeError("event objects cannot be subclassed")

    def __repr__(self) -> str:
        return "<event>"

    def status(self, code: Any) -> None:
        """Set the HTTP status (an int from 200 to 599)."""
        state: ReplyState = self._state
        state.check_open()
        if type(code) is not int:
            state.refuse(f"status must be an int, not {type(code).__name__}")
        if not 200 <= code <= 599:
            state.refuse(f"status must be between 200 and 599, not {code}")
        state.status = code

    def header(self, name: Any, value: Any) -> None:
        """Add a response header; Content-Type sets the reply's content type."""
        state: ReplyState = self._state
        state.check_open()
        problem = header_problem(name, value)
        if problem is not None:
            state.refuse(problem)
        lowered = name.lower()
        if lowered == "content-type":
            state.content_type = value
            return
        if len(state.headers) >= MAX_HEADERS:
            state.refuse(f"more than {MAX_HEADERS} headers")
        state.headers.append([name, value])

    def reply(self, value: Any) -> None:
        """Set the response body; the last call wins."""
        state: ReplyState = self._state
        state.check_open()
        tp = type(value)
        if tp is bytes or tp is bytearray:
            if len(value) > MAX_BODY_BYTES:
                state.refuse(f"reply is larger than {MAX_BODY_BYTES} bytes")
            state.kind, state.payload = "bytes", bytes(value)
        elif tp is str:
            try:
                size = len(value.encode("utf-8"))
            except UnicodeEncodeError:
                state.refuse("reply text is not valid Unicode (lone surrogate)")
            if size > MAX_BODY_BYTES:
                state.refuse(f"reply is larger than {MAX_BODY_BYTES} bytes")
            # A control character is 6 bytes in JSON: only a text of more than a
            # sixth of the cap can grow past it (its line kept for that error).
            state.reply_line = state._script_line() if size > MAX_BODY_BYTES // 6 else None
            state.kind, state.payload = "text", value
        else:
            plain = _plain(value, 0, [MAX_BODY_BYTES], state)
            try:
                data = encode_json(plain).encode("utf-8")
            except UnicodeEncodeError:
                state.refuse("reply text is not valid Unicode (lone surrogate)")
            except ValueError as exc:  # e.g. an int past the 4300-digit limit
                state.refuse(f"reply cannot be encoded as JSON: {_short(exc)}")
            if len(data) > MAX_BODY_BYTES:
                state.refuse(f"reply is larger than {MAX_BODY_BYTES} bytes")
            state.kind, state.payload = "json", data
        state.replied = True


def header_problem(name: Any, value: Any) -> str | None:
    """Why a script may not send this header, or None if it may.

    Also used by the service process on every header a worker returns
    (``protocol.check_result``): a compromised worker must not be able to
    set what a script cannot (redteam finding R4).
    """
    if type(name) is not str or type(value) is not str:
        return "header name and value must be str"
    if not name or len(name) > MAX_HEADER_NAME or not _TOKEN_CHARS.issuperset(name):
        return f"invalid header name {name[:MAX_HEADER_NAME]!r}"
    lowered = name.lower()
    if lowered in FORBIDDEN_HEADERS or lowered.startswith(FORBIDDEN_PREFIXES):
        return f"header {name!r} is set by the server and cannot be set by a script"
    if len(value) > MAX_HEADER_VALUE:
        return f"header {name!r} value is longer than {MAX_HEADER_VALUE} characters"
    if _NOT_PRINTABLE_LATIN1.search(value) is not None:
        return f"header {name!r} value contains control or non-Latin-1 characters"
    if lowered == "www-authenticate" and _PROMPTING_SCHEME.search(value) is not None:
        return (f"header {name!r} cannot ask a browser for a password "
                "(Basic, Digest, NTLM or Negotiate)")
    return None


#: Anything but tab, printable ASCII and printable Latin-1 (so also CR, LF, NUL).
_NOT_PRINTABLE_LATIN1 = re.compile(r"[^\t\x20-\x7e\xa0-\xff]")


def _short(exc: BaseException) -> str:
    text = str(exc.args[0]) if exc.args and type(exc.args[0]) is str else type(exc).__name__
    return text[:200]


def fresh_copy(value: Any) -> Any:
    """Deep copy of trusted, msgpack-decoded request data (fresh containers).

    Shallow-copies each container and recurses only into nested containers:
    request data is mostly flat dicts of strings.
    """
    tp = type(value)
    if tp is dict:
        out = value.copy()
        for key, item in out.items():
            kind = type(item)
            if kind is dict or kind is list or kind is tuple or kind is bytearray:
                out[key] = fresh_copy(item)  # same key: no resize while iterating
        return out
    if tp is list or tp is tuple:
        items = list(value)
        for index, item in enumerate(items):
            kind = type(item)
            if kind is dict or kind is list or kind is tuple or kind is bytearray:
                items[index] = fresh_copy(item)
        return items
    if tp is bytearray:
        return bytes(value)
    return value


def new_event(fields: dict[str, Any], state: ReplyState, copy: bool = True) -> Event:
    """Build the event object for one invocation; ``copy=False`` takes ``fields``'
    values as they are (a worker's freshly decoded job: only lists, dicts and
    immutable values, referenced by nothing that outlives the invocation)."""
    return Event(_EVENT_TOKEN, fields, state, copy)
