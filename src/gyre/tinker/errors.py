"""Errors of the Tinker-compatible server, each with the HTTP status the SDK expects."""

from __future__ import annotations


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
