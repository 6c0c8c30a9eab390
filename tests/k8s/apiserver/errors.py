"""API errors as the real apiserver reports them: an HTTP code and a ``Status`` object.

The official client raises ``ApiException`` carrying this body, and the product maps
``reason``/``code`` to its own errors, so the reasons and messages follow the real ones.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An answer other than success; ``status()`` is the JSON body."""

    def __init__(
        self, code: int, reason: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def not_found(plural: str, name: str, group: str = "") -> ApiError:
    details = {"name": name, "kind": plural, **({"group": group} if group else {})}
    prefix = f"{plural}.{group}" if group else plural
    return ApiError(404, "NotFound", f'{prefix} "{name}" not found', details)


def already_exists(plural: str, name: str) -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{plural} "{name}" already exists', {"name": name, "kind": plural}
    )


def conflict(plural: str, name: str, why: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {plural} "{name}": {why}',
        {"name": name, "kind": plural},
    )


def invalid(kind: str, name: str, causes: list[tuple[str, str]]) -> ApiError:
    """422 Invalid; ``causes`` are (field, message) pairs."""
    text = ", ".join(f"{field_}: {message}" for field_, message in causes)
    return ApiError(
        422,
        "Invalid",
        f'{kind} "{name}" is invalid: {text}',
        {
            "name": name,
            "kind": kind,
            "causes": [
                {"reason": "FieldValueInvalid", "message": m, "field": f} for f, m in causes
            ],
        },
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def forbidden(plural: str, name: str, why: str) -> ApiError:
    return ApiError(
        403, "Forbidden", f'{plural} "{name}" is forbidden: {why}', {"name": name, "kind": plural}
    )
