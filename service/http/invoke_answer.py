"""`RequestAnswers`: how an invoke request is answered, logged and recorded.

The error envelope (`_fail`), the one place an answer is sent (`_answer`),
the records queued (and journaled) before the answer's first byte goes out,
the access log line and the metrics, and what the record writer asks of a
finished request (`history_slot`, `records`, `journal_facts`). A mixin of
`service.http.invoke.InvokeRequest`, which holds the state.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from service.http.base import error_body
from service.http.errors import ServiceError
from service.http.journal_facts import JournaledRequest, request_facts
from service.http.redaction import loggable_path

if TYPE_CHECKING:
    from sandbox.pool import Outcome
    from service.core.invoke_target import InvokeTarget
    from service.http.context import AppContext
    from service.http.exchange import Exchange

log = logging.getLogger("logic.http")
access_log = logging.getLogger("logic.access")


class RequestAnswers:
    """The answering half of `InvokeRequest` (which initialises these)."""

    context: AppContext
    conn: Exchange | None
    target: InvokeTarget | None
    request_id: str
    method: str
    path: str
    started: float
    finished: float
    accepted: bool
    answered: bool
    status: int
    error_code: str | None
    rate_headers: list[tuple[str, str]]
    response_headers: list[tuple[str, str]]
    response_body: bytes
    event: dict[str, Any] | None
    outcome: Outcome | None
    _counted: bool

    # --- answers --------------------------------------------------------------------
    def _fail(self, err: ServiceError) -> None:
        """Answer `err` in the contract's JSON error envelope."""
        if self.answered:
            return
        if err.log_message:
            # Only the operator message: never the client's input or a secret.
            log.info("%s %s: %s", self.request_id, err.code, err.log_message)
        self.error_code = err.code
        headers = [("Content-Type", "application/json"), ("X-Request-Id", self.request_id),
                   *self.rate_headers, *err.headers.items()]
        self._answer(err.status, headers, error_body(err.code, err.message, self.request_id))

    def _internal_error(self) -> None:
        log.error("%s uncaught exception on the invoke path", self.request_id, exc_info=True)
        self._fail(ServiceError())

    def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        if self.answered:
            return
        self.answered = True
        self.status = status
        self.response_headers = headers
        self.response_body = body
        conn, self.conn = self.conn, None  # no cycle with the connection once answered
        if conn is not None:
            # History keeps what was sent, the connection's own headers
            # included; the records are queued (and journaled) before the
            # answer's first byte goes out, so no answered request is lost.
            conn.respond(status, headers, body, before_send=self._record)
        self._done()

    def _record(self, sent_headers: list[tuple[str, str]]) -> None:
        self.response_headers = sent_headers
        self.finished = time.time()
        if self.target is not None:
            # Converted to records in the writer's thread (service.http.records).
            self.context.records.put(self)

    def on_connection_close(self) -> None:
        # The client went away before its request was complete: nothing ran.
        if not self.answered:
            self.answered = True
            self._ended()

    def _ended(self) -> None:
        if self._counted:
            self._counted = False
            self.context.request_ended()

    def _done(self) -> None:
        if not self.finished:  # answered without a connection (it had gone)
            self._record(self.response_headers)
        self._ended()
        self.context.metrics.invoke_answered(self)
        status = self.status
        # The service's own failure, not a script's reply (`event.status(503)`)
        # nor a refusal with its code: a WARNING line each.
        internal = status >= 500 and (self.error_code == "internal_error"
                                      or self.error_code is None and self.outcome is None)
        level = logging.WARNING if internal else logging.DEBUG
        if access_log.isEnabledFor(level):
            access_log.log(level, "%s %s %s %d %.1fms", self.request_id, self.method or "-",
                           loggable_path(self.path), status,
                           1000.0 * (self.finished - self.started))
        event = self.event
        if event is not None:  # history needs only these of it: free the body
            self.event = {"query": event["query"], "headers": event["headers"]}

    # --- records (called in the record writer's thread, once answered) ----------------
    def history_slot(self) -> tuple[int, int] | None:
        """(endpoint id, plan's history size) when this request goes to history."""
        target = self.target
        if target is None or not self.accepted:
            return None
        return target.endpoint_id, target.plan.history

    def records(self, history: bool) -> list[Any]:
        """Statistics hit, history record (if `history`) and error record of this request."""
        return JournaledRequest(self.journal_facts()).records(history)

    def journal_facts(self) -> tuple[Any, ...]:
        """What its records are made of (`service.http.journal_facts.request_facts`)."""
        return request_facts(self)
