"""HTTP-facing service errors: each has a status and a stable code (DESIGN section 4).

Handlers raise these; only `service.http.base.BaseHandler.write_error` turns them into
the JSON error envelope. The `message` is what the client sees; `log_message`, if
any, is for the operator's log only and must never contain a secret.
"""

from __future__ import annotations

from tornado.web import HTTPError


class ServiceError(HTTPError):
    """An error answered to the client with `status` and `code`.

    A subclass of Tornado's `HTTPError` so that an error raised anywhere in a
    handler reaches `write_error` with its own status.
    """

    status = 500
    code = "internal_error"
    message = "Internal server error."

    def __init__(
        self,
        message: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        log_message: str | None = None,
    ) -> None:
        super().__init__(self.status, log_message)
        if message is not None:
            self.message = message
        self.headers = dict(headers or {})

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"


class InvalidBodyError(ServiceError):
    status = 400
    code = "invalid_body"
    message = "The request body could not be parsed for its content type."


class UnauthorizedError(ServiceError):
    status = 401
    code = "unauthorized"
    message = "A valid endpoint secret is required."


class EndpointDisabledError(ServiceError):
    status = 403
    code = "endpoint_disabled"
    message = "This endpoint is disabled."


class IpNotAllowedError(ServiceError):
    status = 403
    code = "ip_not_allowed"
    message = "Your IP address is not allowed to call this endpoint."


class NotFoundError(ServiceError):
    status = 404
    code = "not_found"
    message = "Not found."


class EndpointNotFoundError(ServiceError):
    status = 404
    code = "endpoint_not_found"
    message = "No endpoint exists at this address."


class MethodNotAllowedError(ServiceError):
    status = 405
    code = "method_not_allowed"
    message = "Only POST is allowed on this endpoint."


class PayloadTooLargeError(ServiceError):
    status = 413
    code = "payload_too_large"
    message = "The request body is larger than this endpoint accepts."


class RateLimitedError(ServiceError):
    status = 429
    code = "rate_limited"
    message = "Too many requests for this endpoint; retry later."


class AuthThrottledError(ServiceError):
    status = 429
    code = "auth_throttled"
    message = "Too many failed secrets from your address; retry later."


class ScriptError(ServiceError):
    status = 500
    code = "script_error"
    message = "The script raised an error."


class ScriptMemoryExceededError(ServiceError):
    status = 500
    code = "script_memory_exceeded"
    message = "The script went past its memory limit."


class InvalidReplyError(ServiceError):
    status = 500
    code = "invalid_reply"
    message = "The script set an invalid status, header or reply."


class NoEndpointHandlerError(ServiceError):
    status = 501
    code = "no_endpoint_handler"
    message = "The script has no 'on endpoint' block."


class BusyError(ServiceError):
    status = 503
    code = "busy"
    message = "All sandbox workers are busy; retry shortly."


class NotReadyError(ServiceError):
    status = 503
    code = "not_ready"
    message = "The service is not ready."


class ScriptTimeoutError(ServiceError):
    status = 504
    code = "script_timeout"
    message = "The script went past its time limit."


#: Sandbox outcome kinds mapped to the error the caller sees (DESIGN section 4).
OUTCOME_ERRORS: dict[str, type[ServiceError]] = {
    "script_error": ScriptError,
    "crash": ScriptError,
    "script_timeout": ScriptTimeoutError,
    "script_memory_exceeded": ScriptMemoryExceededError,
    "invalid_reply": InvalidReplyError,
    "no_endpoint_handler": NoEndpointHandlerError,
}

#: Codes for Tornado's own HTTP errors raised outside our handlers.
STATUS_CODES: dict[int, str] = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    431: "headers_too_large",
    429: "rate_limited",
    500: "internal_error",
    408: "request_timeout",
    501: "not_implemented",
    503: "busy",
    505: "http_version_not_supported",
}
