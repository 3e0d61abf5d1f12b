"""Sandbox error classes that cross process boundaries.

Errors raised by the pool, and errors a worker reports about itself, travel as
plain dicts (``to_dict``/``from_dict``) inside msgpack frames: never as pickled
exception objects, because unpickling data from a possibly compromised worker
would run code in the service process.
"""
from __future__ import annotations

from typing import Any, ClassVar


class SandboxError(Exception):
    """Base class for every error the sandbox package raises on purpose."""

    code: ClassVar[str] = "sandbox_error"
    _registry: ClassVar[dict[str, type["SandboxError"]]] = {}

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        SandboxError._registry[cls.code] = cls

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a frame; the inverse of :meth:`from_dict`."""
        return {"code": self.code, "message": self.message}

    @classmethod
    def from_dict(cls, data: Any) -> "SandboxError":
        """Rebuild an error from :meth:`to_dict` data; unknown shapes give the base class."""
        if not isinstance(data, dict):
            return SandboxError("malformed error")
        code = data.get("code")
        message = data.get("message")
        if not isinstance(message, str):
            message = ""
        klass = SandboxError._registry.get(code, SandboxError) if isinstance(code, str) else SandboxError
        return klass(message[:1000])


SandboxError._registry[SandboxError.code] = SandboxError


class PoolBusyError(SandboxError):
    """No worker became free within the queue timeout, or the wait queue is full."""

    code = "busy"


class PoolClosedError(SandboxError):
    """The pool is not started, is stopping, or has stopped."""

    code = "pool_closed"


class ProtocolError(SandboxError):
    """A frame was oversized, not msgpack, or did not have the expected shape."""

    code = "protocol_error"


class SpawnError(SandboxError):
    """The fork server could not start a worker."""

    code = "spawn_error"
