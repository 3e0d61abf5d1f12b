"""The admin API's request and response shapes: one pydantic model each.

These models are the one source of truth: handlers validate request bodies
and query strings with them (`service.api.base.APIHandler.body` / `.query`),
and `service.api.spec` builds the OpenAPI document from the same classes.
Request models refuse unknown fields and values of another JSON type (no
"on" for true, no 1 for a string); response models describe the service
layer's JSON (the CLI's `--json` shapes) and allow fields added later.
"""
from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _In(BaseModel):
    # Strict: `"enabled": "off"` or `"operator": "on"` is 422, not a guess.
    model_config = ConfigDict(extra="forbid", strict=True)


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


# ------------------------------------------------------------------ query strings
class _Query(BaseModel):
    # An unknown parameter is refused: `?dryrun=true` (lower case) changed the
    # plan for real (review, session 27).
    model_config = ConfigDict(extra="forbid")


class ListQuery(_Query):
    """`?limit=&cursor=` of every list."""

    limit: int = Field(50, ge=1, le=200, description="Items per page (1-200).")
    cursor: str = Field("", max_length=200, description="`nextCursor` of the page before.")


_STATUS_FILTER = r"^([1-5]xx|[1-5][0-9][0-9])?$"


class HistoryQuery(ListQuery):
    status: str = Field("", json_schema_extra={"pattern": _STATUS_FILTER},
                        description="`2xx`, `4xx`, `5xx` (any class) or one status code.")
    since: str = Field("", max_length=64,
                       description="Only records at or after this ISO 8601 time.")

    @field_validator("status")
    @classmethod
    def _status_filter(cls, value: str) -> str:
        # Checked here rather than by the pattern: the refusal says what is
        # meant, not the regular expression (an audit, session 31).
        if not re.fullmatch(_STATUS_FILTER, value):
            raise ValueError("expected 2xx, 4xx or 5xx (a class) or one status code, such as 404")
        return value


class DryRunQuery(_Query):
    dryRun: bool = Field(False, description="Report what would change, change nothing.")


# ------------------------------------------------------------------ request bodies
class GuildCreate(_In):
    guildId: str = Field(..., description="Platform guild ID: 1-25 digits.")
    ownerId: str = Field(..., description="Platform user ID of the owner.")
    plan: str | None = Field(None, description="Plan name (default: the default plan).")


class GuildPatch(_In):
    plan: str


class ScriptCreate(_In):
    name: str
    source: str = Field(..., description="Script source (at most 256 KB of UTF-8).")


class ScriptUpdate(_In):
    source: str | None = None
    name: str | None = None


class EndpointPatch(_In):
    enabled: bool | None = None
    whitelist: list[str] | None = Field(None, description="CIDRs; [] removes the restriction.")


class TestCall(_In):
    method: str = Field("POST", description="Only POST runs (as on the invoke path).")
    headers: dict[str, str] = Field(default_factory=dict)
    query: dict[str, str | list[str]] = Field(default_factory=dict)
    body: Any = Field(None, description="A string is sent as is; any other JSON value as JSON.")


class TokenCreate(_In):
    userId: str | None = None
    operator: bool = False
    expiresAt: datetime | None = Field(None, strict=False,  # an ISO 8601 string in JSON
                                       description="When the token stops working (UTC).")


class LoginLinkCreate(_In):
    userId: str


# ------------------------------------------------------------------ responses
class Me(_Out):
    userId: str | None
    operator: bool
    tokenId: int
    expiresAt: str | None


class PlanLimits(_Out):
    """The settings of the guild's plan (as `[plans.NAME]` names them, in camelCase;
    0 or false: not included)."""

    endpoints: int = Field(description="Enabled endpoints per guild.")
    memoryKb: int = Field(description="Script memory per invocation, KB.")
    requestsPerMinute: int = Field(description="Requests per endpoint, sliding 60 s.")
    bodyBytes: int = Field(description="Request body limit, bytes.")
    history: int = Field(description="Request records kept per endpoint.")
    errorLogs: bool = Field(description="Error log kept.")
    ipWhitelist: bool = Field(description="IP whitelist allowed (and enforced).")
    advancedStats: bool = Field(description="Latency percentiles, per-minute and per-hour "
                                            "series, top caller IPs.")
    timeLimitMs: int = Field(description="Script time limit per invocation, ms.")
    scripts: int = Field(description="Live scripts per guild (created, not deleted).")


class Guild(_Out):
    guildId: str
    ownerId: str
    plan: str
    managers: list[str]
    endpointsEnabled: int
    endpointsAllowed: int
    limits: PlanLimits
    createdAt: str
    disabled: list[str] | None = Field(None, description="After a plan change: endpoints disabled.")


class GuildPage(_Out):
    items: list[Guild]
    nextCursor: str | None


class Script(_Out):
    logicScriptId: str
    guildId: str
    name: str
    version: int
    createdAt: str
    updatedAt: str
    endpointEnabled: bool
    sourceBytes: int
    source: str | None = None


class ScriptPage(_Out):
    items: list[Script]
    nextCursor: str | None


class Deleted(_Out):
    logicScriptId: str
    guildId: str
    deleted: bool


class SecretInfo(_Out):
    hint: str | None
    createdAt: str | None
    createdBy: str | None


class Endpoint(_Out):
    guildId: str
    logicScriptId: str
    url: str
    enabled: bool
    active: bool
    secret: SecretInfo | None
    whitelist: list[str]
    plan: str


class NewSecret(_Out):
    logicScriptId: str
    secret: str
    hint: str
    createdAt: str


class AuditRecord(_Out):
    id: int
    time: str
    actor: str
    action: str
    logicScriptId: str | None
    detail: dict[str, Any]


class AuditPage(_Out):
    items: list[AuditRecord]
    nextCursor: str | None


class RequestRecord(_Out):
    id: int
    requestId: str
    time: str
    method: str
    status: int
    ip: str
    userAgent: str
    query: dict[str, Any]
    headers: dict[str, Any]
    body: str
    bodyEncoding: Literal["text", "base64"]
    bodyTruncated: bool
    responseHeaders: dict[str, Any]
    responseBody: str
    responseBodyEncoding: Literal["text", "base64"]
    responseBodyTruncated: bool
    durationMs: float
    output: str
    error: str | None
    test: bool = Field(..., description="A test call or replay from the admin API.")


class RequestRecordPage(_Out):
    items: list[RequestRecord]
    nextCursor: str | None


class ErrorRecord(_Out):
    id: int
    time: str
    requestId: str
    kind: str
    message: str
    line: int | None
    traceback: str | None


class ErrorRecordPage(_Out):
    items: list[ErrorRecord]
    nextCursor: str | None


class Stats(_Out):
    total: int
    byStatus: dict[str, int]
    testCalls: int
    last24h: int
    avgMs: float | None
    window: str
    advanced: bool
    latency: dict[str, Any] | None = None
    perMinute: list[dict[str, Any]] | None = None
    perHour: list[dict[str, Any]] | None = None
    topIps: list[dict[str, Any]] | None = None


class TestCallResult(_Out):
    requestId: str
    test: bool
    replayOf: str | None
    status: int = Field(..., description="What the invoke path would have answered.")
    headers: dict[str, str]
    body: str
    bodyEncoding: Literal["text", "base64"]
    durationMs: float
    output: str
    error: str | None = Field(..., description="Error code of a failed script, else null.")


class NewToken(_Out):
    id: int
    token: str = Field(..., description="Shown only now.")
    kind: Literal["user", "operator"]
    userId: str | None
    createdAt: str
    expiresAt: str | None


class Revoked(_Out):
    id: int
    revoked: bool


class LoginLink(_Out):
    url: str
    userId: str
    expiresAt: str


class CompileErrorItem(_Out):
    line: int
    column: int
    message: str


class ErrorDetail(_Out):
    code: str
    message: str
    requestId: str
    errors: list[CompileErrorItem] | None = Field(None, description="For `compile_error` only.")


class ErrorBody(_Out):
    success: Literal[False]
    error: ErrorDetail
