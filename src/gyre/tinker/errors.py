"""Errors of the Tinker-compatible server, each with the HTTP status the SDK expects."""

from __future__ import annotations

from typing import Any


class TinkerError(Exception):
    """An error answered to the client. ``status`` is the HTTP status when the request itself
    fails; inside a future it becomes a ``RequestFailedResponse`` of ``category``."""

    status = 500
    category = "server"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UserError(TinkerError):
    """Bad input: the message names the field (``data[3].loss_fn_inputs.advantages: ...``)."""

    status = 400
    category = "user"


class NotFound(TinkerError):
    status = 404
    category = "user"


class Unsupported(UserError):
    """A valid request this server does not implement; the message says why."""


def required(body: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``body[key]``, which must be present and of type ``kind`` (a :class:`UserError` naming
    the field otherwise)."""
    if key not in body or body[key] is None:
        raise UserError(f"{key}: required")
    if not isinstance(body[key], kind):
        raise UserError(f"{key}: expected {getattr(kind, '__name__', kind)}, got {body[key]!r}")
    return body[key]
