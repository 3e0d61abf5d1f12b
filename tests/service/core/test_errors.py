"""The error hierarchy the fronts map to HTTP statuses and exit codes."""
from __future__ import annotations

import pytest

from service.core import error_log
from service.core import errors as errors_module
from service.core.errors import (ConflictError, CoreError, NotFoundError, PermissionDeniedError,
                                 QuotaError, ValidationError)


@pytest.mark.parametrize("cls,status,code", [
    (ValidationError, 400, "invalid_input"), (ConflictError, 409, "conflict"),
    (NotFoundError, 404, "not_found"), (PermissionDeniedError, 403, "forbidden"),
    (QuotaError, 409, "plan_refused"),
])
def test_status_and_default_code(cls, status, code):
    err = cls("message")
    assert isinstance(err, CoreError) and err.status == status and err.code == code
    assert err.to_dict() == {"code": code, "message": "message"}
    assert cls("m", code="specific").code == "specific" and cls.code == code


def test_the_error_log_read_does_not_shadow_the_error_classes():
    assert callable(error_log)
    assert errors_module.NotFoundError is NotFoundError
