"""What the records journal holds of a finished request: its facts.

`request_facts` turns a finished `service.http.invoke.InvokeRequest` into
plain data in `FIELDS` order, the presented secret and every other secret or
token of a known shape redacted (`without_secret`; of a request that could
hide one from the search, only as much as history keeps), on the event loop
as the answer goes out; `JournaledRequest` turns such facts, read back from
the journal or kept in memory, into the records the writer stores
(`service.http.records`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from service.core.record_items import (BODY_CAP, OUTPUT_CAP, TEXT_CAP, joined_headers,
                                       json_text, redact_headers)
from service.core.records import ErrorRecordIn, RequestRecordIn, StatHit
from service.core.secrets import SECRET_PREFIX
from service.http.auth import presented_secret
from service.http.event import query_for_history, visible_headers
from service.http.redaction import (REDACTED, SCAN_CHARS, Redactor, hides, shape_redactors,
                                    shape_secrets, shaped)

_fast_scan: Callable[[str, str, tuple[Any, ...]], tuple[bool, bool, bool] | None] | None
try:  # the optional C extension (setup.py); `_scan` below otherwise
    from service.http._scan import scan as _fast_scan
except ImportError:  # pragma: no cover - exercised only where it cannot be built
    _fast_scan = None

#: The fields of a journaled request, in order (see `JournaledRequest`).
FIELDS = ("endpoint_id", "keep", "error_logs", "accepted", "request_id", "started", "finished",
          "status", "ip", "method", "query", "headers", "body", "user_agent",
          "response_headers", "response_body", "output", "error", "error_kind",
          "error_message", "error_line", "traceback", "queued", "deprioritised", "script_version")


#: How much of a body or a text is searched for `redaction.SHAPES`: more than
#: any value `_keep_as_history` keeps can come from. A kept value (BODY_CAP + 1
#: characters at most, counted once the secrets are cut out) comes from at most
#: 47/10 as many (a 47-character secret cut to "[redacted]" shrinks most), and
#: 5 times leaves room for a secret across the end.
SHAPE_SCAN = 5 * (BODY_CAP + 1)


def request_facts(req: Any) -> tuple[Any, ...]:
    """What a finished `service.http.invoke.InvokeRequest`'s records are made
    of, as plain data in `FIELDS` order, secrets redacted (`without_secret`):
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
        event["query"] if event else query_for_history(req.query),
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
    """`facts` with every value, and every query parameter's or header's name,
    that holds `secret` redacted (as history keeps it), and so every one that
    holds another secret or token of a known shape (`redaction.SHAPES`: another
    endpoint's secret, an API token, a login link).

    The plain secret is searched for in every name and value whole; an encoded
    one (`redaction.hides`) and the shapes in their first part only, so when a
    value carries a mark of an encoding or a shape's prefix, no more is kept
    of any than history keeps (`_keep_as_history`), all of it searched.
    Cheap when neither the secret, nor a mark, nor a shape's prefix appears
    anywhere (the usual case): substring tests over the names and values.
    Credential-named parameters are redacted later, by name, when records
    are made (`JournaledRequest.records`).
    """
    if not facts[3]:
        return facts
    needle = None
    if secret:
        # The random part is what is secret: searched for with or without the prefix.
        needle = (secret[len(SECRET_PREFIX):] if secret.startswith(SECRET_PREFIX)
                  and len(secret) > len(SECRET_PREFIX) + 16 else secret)
        answer = _fast_scan(needle, needle.lower(), facts) if _fast_scan is not None else None
        found, marked, shapes = answer if answer is not None else _scan(needle, facts)
    else:
        found, marked, shapes = _scan(None, facts)
    hidden = _hidden(needle, facts) if marked and needle else []
    if not found and not hidden and not shapes and not marked:
        return facts
    out = list(facts)
    if found or hidden:
        assert secret is not None and needle is not None
        _without(out, secret, needle, hidden)
    if shapes:
        _without_shapes(out)
    if marked or shapes:
        _keep_as_history(out)
    return tuple(out)


def _without(out: list[Any], secret: str, needle: str, hidden: list[tuple[int, Any, bool]]
             ) -> None:
    """`out` (the facts as a list) without `secret`: `hidden` places as [redacted] whole,
    the plain secret and its random part (`needle`) cut out of the rest."""
    # Held encoded: the value (and the name, if it is the name that holds
    # it) kept as [redacted] whole; then the plain secret is cut out of the rest.
    for index, key, in_name in hidden:
        if index in (10, 11):                  # a query parameter, a request header
            out[index] = {(REDACTED if in_name and k == key else k): (REDACTED if k == key else v)
                          for k, v in out[index].items()}
        elif index == 14:                      # a response header, by position
            out[14] = [[REDACTED if in_name and i == key else n, REDACTED if i == key else v]
                       for i, (n, v) in enumerate(out[14])]
        else:
            out[index] = REDACTED.encode() if isinstance(out[index], bytes) else REDACTED
    _cut(out, Redactor(secret))
    if needle != secret:
        _cut(out, Redactor(needle))


def _without_shapes(out: list[Any]) -> None:
    """`out` (the facts as a list) without anything secret in `redaction.SHAPES`:
    searched in every name and value, of a body or a text its first `SHAPE_SCAN`
    characters, and cut out wherever it stands (as `_cut` cuts the secret)."""
    found: dict[str, None] = {}
    for name, value in out[10].items():
        shape_secrets(name, found)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str):
                shape_secrets(item, found)
    for name, value in [*out[11].items(), *out[14]]:
        shape_secrets(name, found)
        shape_secrets(value, found)
    for index in (12, 13, 15, 16, 17, 19, 21):
        if out[index]:
            shape_secrets(out[index][:SHAPE_SCAN], found)
    for redact in shape_redactors(found):
        _cut(out, redact)


def _too_long(values: dict[str, Any]) -> bool:
    """Whether a name or value of `values` is longer than `redaction.hides` reads."""
    for name, value in values.items():
        if len(name) > SCAN_CHARS:
            return True
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and len(item) > SCAN_CHARS:
                return True
    return False


def _as_stored(values: dict[str, Any], headers: bool) -> dict[str, Any]:
    """Query parameters (or `headers`) as history stores them: credential-named
    values redacted, and nothing but a note of their size when their JSON is
    over `BODY_CAP` (`record_items.json_text`), which a value longer than the
    search reads makes it (unless its name is a credential's)."""
    kept = Redactor(None).mapping(values)
    if headers:
        kept = redact_headers(kept)
    return json.loads(json_text(kept))  # type: ignore[no-any-return]


#: What history keeps of a body, a text (`service.core.records`): journaled
#: one unit more, so that the record still says it was cut.
_KEPT = ((12, BODY_CAP + 1), (13, TEXT_CAP), (15, BODY_CAP + 1), (16, OUTPUT_CAP + 1),
         (17, TEXT_CAP + 1), (19, TEXT_CAP + 1), (21, OUTPUT_CAP + 1))


def _keep_as_history(out: list[Any]) -> None:
    """`out` (the facts as a list, secrets cut) with no more than history keeps:
    each body (bytes) and text cut to what it keeps (`record_items.cap_body`,
    `cap_text`, `short_text`) and one byte or character more, so the record
    still says it was cut; headers or query parameters with a name or value
    longer than `redaction.hides` reads, as history stores them (`_as_stored`).
    All that is left was searched (`redaction.SCAN_CHARS`, `SHAPE_SCAN`)."""
    for index, cap in _KEPT:
        if out[index] and len(out[index]) > cap:
            out[index] = out[index][:cap]
    for index in (10, 11):
        if _too_long(out[index]):
            out[index] = _as_stored(out[index], headers=index == 11)


def _cut(out: list[Any], redact: Redactor) -> None:
    """`out` (the facts as a list) with `redact`'s secret cut out of every name and value."""
    out[10] = redact.mapping(out[10])
    out[11] = redact.mapping(out[11], headers=True)
    out[12] = redact.data(out[12])
    out[13] = redact.text(out[13])
    out[14] = [list(redact.item(redact.header_name(n), v)) for n, v in out[14]]
    out[15] = redact.raw(out[15])
    for index in (16, 17, 19, 21):
        if out[index]:
            out[index] = redact.text(out[index])


def _hidden(secret: str, facts: tuple[Any, ...]) -> list[tuple[int, Any, bool]]:
    """(fact index; query parameter or header name, response header position, or "";
    whether the name holds it) of every name or value holding `secret` only in an
    encoded form (`redaction.hides`): such a value is kept as ``[redacted]``
    whole, and such a name too. Called only for a marked request."""
    found: list[tuple[int, Any, bool]] = []
    # Header names arrive lower-cased: searched in any letter case, after
    # decoding too ("%4A" is "J", whatever became of the name's case).
    lowered = secret.lower()
    for name, item in facts[10].items():
        in_name = hides(secret, name)
        if in_name or any(isinstance(value, str) and hides(secret, value)
                          for value in (item if isinstance(item, list) else [item])):
            found.append((10, name, in_name))
    for name, value in facts[11].items():
        in_name = hides(lowered, name, fold=True)
        if in_name or hides(secret, value):
            found.append((11, name, in_name))
    for position, (name, value) in enumerate(facts[14]):
        in_name = hides(lowered, name, fold=True)
        if in_name or hides(secret, value):
            found.append((14, position, in_name))
    for index in (12, 13, 15, 16, 17, 19, 21):
        value = facts[index]
        if value and hides(secret, value):
            found.append((index, "", False))
    return found


def _scan(secret: str | None, facts: tuple[Any, ...]) -> tuple[bool, bool, bool]:
    """(whether `secret` appears anywhere in what is journaled — in a header's
    name in any letter case —, whether any name or value carries a mark of an
    encoding that could hide it: `%`, `\\u`, a NUL byte in a body, whether any
    holds the prefix of a secret's or token's shape: `redaction.shaped`).

    `service.http._scan.scan` answers the same in one call when it is built
    (and the shape is one it knows); this is the reference it is tested
    against. A few substring tests over joined names and values, no call per value."""
    query, headers, body, response_headers, response_body = (
        facts[10], facts[11], facts[12], facts[14], facts[15])
    names = "\n".join(headers).lower()
    texts = "\n".join(headers.values())
    if response_headers:
        names += "\n" + "\n".join([pair[0] for pair in response_headers]).lower()
        texts += "\n" + "\n".join([pair[1] for pair in response_headers])
    if query:
        texts += "\n" + "\n".join([*query, *[str(item) for value in query.values()
                                            for item in (value if isinstance(value, list)
                                                         else [value])]])
    if facts[13] or facts[16] or facts[17] or facts[19] or facts[21]:
        texts += "\n" + "\n".join([t for t in (facts[13], facts[16], facts[17], facts[19], facts[21])
                            if t])
    found = secret is not None and (secret in texts or secret.lower() in names)
    # A NUL in text: UTF-16 (a percent-decoded query value, a script's output).
    marked = ("%" in texts or "\\" in texts or "\x00" in texts
              or "%" in names or "\\" in names or "\x00" in names)
    data = body if isinstance(body, bytes) else body.encode("utf-8", "replace")
    if secret is not None:
        raw = secret.encode("utf-8", "surrogatepass")
        found = found or raw in data or raw in response_body
    # Marks as byte values (37 "%", 92 "\\", 0): an int membership test is several
    # times faster than a one-byte bytes one.
    marked = (marked or 37 in data or 92 in data or 0 in data
              or 37 in response_body or 92 in response_body or 0 in response_body)
    # A body kept as text (an older entry) is lowered as text, as the C scan does.
    return found, marked, (shaped(names) or shaped(texts) or shaped(body)
                           or shaped(response_body))


class JournaledRequest:
    """A finished request as plain facts: what `RecordWriter` converts to records."""

    __slots__ = ("facts", "mark")

    def __init__(self, facts: tuple[Any, ...]) -> None:
        self.facts = facts
        #: Where it is journaled: (run, segment, byte past it); None if it is not.
        self.mark: tuple[str, int, int] | None = None

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
        # Caller addresses (the top callers) only of authenticated requests
        # within the quota: refused ones from rotating addresses grew one
        # statistics row per address (security review, session 16).
        items: list[Any] = [StatHit(endpoint_id, when, status, duration_ms,
                                    ip if accepted else "", queued=queued,
                                    deprioritised=deprioritised)]
        if not accepted:
            return items
        if history:
            by_name = Redactor(None)  # credential-named values (the secret went at journaling)
            items.append(RequestRecordIn(
                endpoint_id=endpoint_id, request_id=request_id, time=when, method=method,
                query=by_name.mapping(query), headers=by_name.mapping(headers), body=body,
                ip=ip, user_agent=user_agent, status=status,
                response_headers=by_name.mapping(joined_headers(response_headers)),
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
