"""The `event` a script sees, built from an HTTP request (DESIGN section 5).

Also the caller's IP: `X-Forwarded-For` is believed only when the TCP peer is
one of the configured trusted proxies, and then only up to the first address
that is not itself a trusted proxy (right to left), so a client cannot forge
its address by sending the header itself.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any
from urllib.parse import parse_qsl

from tornado.httputil import HTTPHeaders

from models.clock import iso
from service.core.records import SECRET_HEADERS
from service.http.errors import InvalidBodyError

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Headers never shown to scripts: the same set the record store never keeps.
HIDDEN_HEADERS = SECRET_HEADERS


def client_ip(peer: str, forwarded_for: str | None, trusted: Sequence[IPNetwork]) -> str:
    """The client address: the peer, or the nearest untrusted hop of `X-Forwarded-For`."""
    if not trusted or not forwarded_for or not _in_any(peer, trusted):
        return peer
    hops = [h.strip() for h in forwarded_for.split(",") if h.strip()]
    for hop in reversed(hops):
        try:
            ipaddress.ip_address(hop)
        except ValueError:
            return peer  # a malformed chain is not believed at all
        if not _in_any(hop, trusted):
            return hop
    return hops[0] if hops else peer


def _in_any(ip: str, networks: Sequence[IPNetwork]) -> bool:
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return False
    return any(address in net for net in networks)


def ip_allowed(ip: str, whitelist: Sequence[IPNetwork]) -> bool:
    """True when there is no whitelist or `ip` is inside one of its networks."""
    return not whitelist or _in_any(ip, whitelist)


def visible_headers(headers: HTTPHeaders | dict[str, str]) -> dict[str, str]:
    """Lower-case request headers without the ones that carry credentials.

    `headers`: Tornado's `HTTPHeaders`, or a dict that already has lower-case
    names and repeated names joined (`service.http.connection`'s plain headers).
    """
    if not isinstance(headers, HTTPHeaders):
        return {name: value for name, value in headers.items() if name not in HIDDEN_HEADERS}
    out: dict[str, str] = {}
    for name, value in headers.get_all():
        lname = name.lower()
        if lname in HIDDEN_HEADERS:
            continue
        out[lname] = f"{out[lname]}, {value}" if lname in out else value
    return out


#: At most this many fields in a form body or parameters in a query string:
#: each costs ~1-2 us to split and decode on the event loop, so 209,600
#: fields in a 1 MiB form took 458 ms (review, session 28).
MAX_FORM_FIELDS = 1000
#: At most this many values (object keys included) in a JSON body: `json`
#: builds a Python object for each (up to ~0.3 us a value: a 1 MiB body of
#: 349,000 empty lists took 90 ms of the event loop and ~28 MB while queued).
MAX_BODY_VALUES = 50_000

_json_values: Callable[[str], int]
try:  # the optional C extension (setup.py); the twin below otherwise
    from service.http._bodycount import json_values as _json_values
except ImportError:  # pragma: no cover - exercised only where it cannot be built
    _json_values = None  # type: ignore[assignment]

#: A JSON string, escapes included, or one left open at the end of the text.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.S)


#: A '[' or '{' whose next character past white space is not a closer.
_NONEMPTY_OPENER = re.compile(r"[\[{](?=[ \t\n\r]*[^\]} \t\n\r])")


def json_values_py(text: str) -> int:
    """`_bodycount.json_values` in Python: where a value starts, outside
    strings (the first value, one after each ',' and ':', one after each
    non-empty '[' or '{'): the values a valid JSON text holds, keys included."""
    bare = _JSON_STRING.sub('""', text)
    return (1 + bare.count(",") + bare.count(":")
            + sum(1 for _ in _NONEMPTY_OPENER.finditer(bare)))


def json_values(text: str) -> int:
    """How many values (keys included) the JSON `text` holds, before parsing it."""
    return _json_values(text) if _json_values is not None else json_values_py(text)


def too_many_values(text: str, allowance: int = 0) -> bool:
    """Whether the JSON `text` holds more than `MAX_BODY_VALUES` (plus
    `allowance`) values: counted only for a text long enough to hold more."""
    bound = MAX_BODY_VALUES + allowance
    return len(text) >= 2 * bound and json_values(text) > bound


def parse_query(query: str) -> dict[str, str | list[str]]:
    """Query arguments: a string, or a list when the name repeats. Raises
    `InvalidBodyError` past `MAX_FORM_FIELDS` fields (counted before any is
    decoded)."""
    # A field takes at least one character and a separator: a text this
    # short cannot hold more (no count on the hot path).
    if len(query) > 2 * MAX_FORM_FIELDS and query.count("&") >= MAX_FORM_FIELDS:
        raise InvalidBodyError(f"The request has more than {MAX_FORM_FIELDS:,} form fields or "
                               "query parameters.")
    out: dict[str, str | list[str]] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        prev = out.get(name)
        if prev is None:
            out[name] = value
        elif isinstance(prev, list):
            prev.append(value)   # in place: a copy per repeat made one request quadratic
        else:
            out[name] = [prev, value]
    return out


def media_type(content_type: str) -> tuple[str, str | None]:
    """The lower-case media type and the charset parameter, if any."""
    main, _, params = content_type.partition(";")
    charset = None
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset":
            charset = value.strip().strip('"').lower() or None
    return main.strip().lower(), charset


def parse_body(content_type: str, raw: bytes) -> tuple[Any, str | bytes]:
    """`(body, rawBody)` for the event; raises `InvalidBodyError` when it does not parse.

    JSON (`application/json`, `*+json`) gives dict/list/any JSON value; a form
    (`application/x-www-form-urlencoded`) gives a dict like `query`; `text/*`
    gives str; anything else gives bytes. Textual bodies must be UTF-8 (or the
    declared charset) and their `rawBody` is the decoded text. An empty body is
    `None` whatever its type.
    """
    mtype, charset = media_type(content_type)
    textual = mtype == "application/json" or mtype.endswith("+json") or mtype.startswith("text/") \
        or mtype == "application/x-www-form-urlencoded"
    if not textual:
        return (raw if raw else None), raw
    codec = CHARSETS.get(charset or "utf-8")
    if codec is None:
        # Refused before any codec lookup: every name looked up would stay
        # in the codec registry's cache for the life of the process.
        raise InvalidBodyError("The request body's charset is not supported (use utf-8).")
    try:
        text = raw.decode(codec)
    except UnicodeError as exc:
        said = f"its declared charset ({charset})" if charset else "UTF-8 (no charset declared)"
        raise InvalidBodyError(f"The request body is not valid text in {said}.") from exc
    if not raw:
        return None, text
    if mtype == "application/x-www-form-urlencoded":
        return parse_query(text), text
    if mtype.startswith("text/"):
        return text, text
    # A value takes at least one character and a separator: a shorter text
    # cannot hold more values than the bound (no count on the hot path).
    if too_many_values(text):
        raise InvalidBodyError(f"The request body holds more than {MAX_BODY_VALUES:,} JSON "
                               "values; send fewer, or the data as one string.")
    try:
        body = _JSON.decode(text)
    except _NumberOutOfRange as exc:
        raise InvalidBodyError(str(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise InvalidBodyError("The request body is not valid JSON.") from exc
    if _SURROGATE_ESCAPE.search(text) is not None:
        # "\ud800" alone is valid JSON but no text: a script gets Unicode strings.
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidBodyError("The request body has a lone surrogate (\\ud800-\\udfff) "
                                   "in a string.") from None
    return body, text


HINT_HEADER = "X-Logic-Hint"
_JSON_START = re.compile(rb"[ \t\r\n]*[\[{]")


def body_hint(content_type: str, raw: bytes) -> str | None:
    """The `X-Logic-Hint` value when a JSON body came without a JSON content type.

    The event keeps what the content type says (a form dict, or bytes); the
    caller learns why the script saw no JSON.  Only bodies that look like a
    JSON object or array are tried, so other requests pay one byte compare.
    """
    if not raw or _JSON_START.match(raw) is None:     # no copy of the body
        return None
    mtype, _ = media_type(content_type)
    if mtype == "application/json" or mtype.endswith("+json"):
        return None
    try:
        text = raw.decode("utf-8")
        # Not parsed past the body cap (review, session 28: a 1 MiB body of
        # empty lists sent as text/plain cost 92 ms here, after its script ran).
        if too_many_values(text):
            return None
        _JSON.decode(text)
    except (ValueError, RecursionError):
        return None
    shown = f'"{mtype}"' if mtype else "missing"
    as_what = {"application/x-www-form-urlencoded": "form data",
               "": "bytes"}.get(mtype, "text" if mtype.startswith("text/") else "bytes")
    return (f"body was parsed as {as_what} because Content-Type was {shown}; it is valid JSON: "
            "send Content-Type: application/json")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class _NumberOutOfRange(ValueError):
    pass


#: Integers a script can be handed (the sandbox frame carries 64 bits).
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1


def _bounded_int(text: str) -> int:
    value = int(text)
    if not _INT_MIN <= value <= _INT_MAX:
        raise _NumberOutOfRange("The request body has an integer outside -2^63 .. 2^64-1; "
                                "send it as a string.")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (_INF, -_INF):
        raise _NumberOutOfRange("The request body has a number too large for a float.")
    return value


_INF = float("inf")
#: One decoder for every body (json.loads with an argument builds one per call).
_JSON = json.JSONDecoder(parse_constant=_reject_constant, parse_int=_bounded_int,
                         parse_float=_finite_float)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")

#: Charsets a textual body may declare (lower case) -> the codec used. Any
#: other name is refused before a codec is looked up.
CHARSETS = {
    "utf-8": "utf-8", "utf8": "utf-8", "us-ascii": "ascii", "ascii": "ascii",
    "iso-8859-1": "latin-1", "latin1": "latin-1", "latin-1": "latin-1",
    "iso-8859-15": "iso8859-15", "windows-1252": "cp1252", "cp1252": "cp1252",
    "utf-16": "utf-16", "utf-16le": "utf-16-le", "utf-16be": "utf-16-be",
}
_stamp_second: dict[int, str] = {}


def iso_timestamp(started: float) -> str:
    """`started` (epoch seconds) as ISO 8601 UTC with milliseconds and a Z."""
    second = int(started)
    micro = round((started - second) * 1e6)  # as datetime.fromtimestamp rounds
    if micro >= 1_000_000:
        second, micro = second + 1, micro - 1_000_000
    prefix = _stamp_second.get(second)
    if prefix is None:
        _stamp_second.clear()
        # models.clock.iso's format, "…T12:00:00.000Z", without "000Z"
        whole = iso(datetime.fromtimestamp(second, tz=timezone.utc))
        assert whole is not None
        prefix = _stamp_second[second] = whole[:-4]
    return f"{prefix}{micro // 1000:03d}Z"


def query_for_history(query: str) -> dict[str, str | list[str]]:
    """A refused request's query as history keeps it: parsed, or none past
    `MAX_FORM_FIELDS` (that request was answered 400 for it)."""
    try:
        return parse_query(query) if query else {}
    except InvalidBodyError:
        return {}


def build_event(method: str, query: str, headers: HTTPHeaders | dict[str, str], raw: bytes,
                ip: str, started: float) -> dict[str, Any]:
    """The plain-data event shipped to the sandbox (see docs/script-language.md).

    `headers` as for `visible_headers`. A body under a content coding
    (`Content-Encoding: gzip`, ...) is refused: none is decoded here, and
    reading coded bytes as their media type would hand the script garbage or,
    worse, a body that is not the one the client meant.
    """
    coding = headers.get("content-encoding")
    if coding is not None and raw and any(
            token.strip(" \t").lower() not in ("", "identity") for token in coding.split(",")):
        raise InvalidBodyError("The request body has a content coding (Content-Encoding) "
                               "that is not decoded here; send it uncompressed.")
    body, raw_body = parse_body(headers.get("content-type", ""), raw)
    return {
        "body": body,
        "rawBody": raw_body,
        "headers": visible_headers(headers),
        "query": parse_query(query) if query else {},
        "method": method,
        "ip": ip,
        "userAgent": headers.get("user-agent", ""),
        "timestamp": iso_timestamp(started),
    }
