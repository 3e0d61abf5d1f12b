"""Service-layer errors: each has a stable `code` (for clients and scripts)
and an HTTP `status` (for the admin API); the CLI maps the classes to exit
codes.  Messages are safe to show to the caller: they never hold a secret."""
from __future__ import annotations

from typing import Any


class CoreError(Exception):
    """Base class; `code` and `status` may be overridden per instance."""

    code = "error"
    status = 400

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole, whatever a subclass's __init__ takes: the admin API
        # runs some reads in other processes (service.api.readers).
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[CoreError], args: tuple[Any, ...], state: dict[str, Any]) -> CoreError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class ValidationError(CoreError):
    """The input is malformed (bad ID, bad CIDR, source that does not compile)."""

    code = "invalid_input"
    status = 400


class CompileError(ValidationError):
    """A script source that does not compile; `errors` lists every error as
    `{"line", "column", "message"}` (the admin API puts them inside `error`)."""

    code = "compile_error"
    status = 422

    def __init__(self, message: str, errors: list[dict[str, object]]) -> None:
        super().__init__(message)
        self.errors = errors

    def to_dict(self) -> dict[str, object]:  # type: ignore[override]
        return {"code": self.code, "message": self.message, "errors": self.errors}


class ConflictError(ValidationError):
    """The input is fine but clashes with what exists (guild already exists)."""

    code = "conflict"
    status = 409


class NotFoundError(CoreError):
    """The guild or script does not exist (or was deleted)."""

    code = "not_found"
    status = 404


class PermissionDeniedError(CoreError):
    """The actor's role does not allow this action."""

    code = "forbidden"
    status = 403


class QuotaError(CoreError):
    """The guild's plan refuses this: quota reached or feature not included."""

    code = "plan_refused"
    status = 409


class VersionMismatchError(CoreError):
    """The script changed since the version the editor read (`If-Match`)."""

    code = "version_mismatch"
    status = 412
