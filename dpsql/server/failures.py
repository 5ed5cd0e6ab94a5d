"""The base of errors the server reports to a client as an ErrorResponse."""

from __future__ import annotations


class ClientError(Exception):
    """A statement the server refuses; ``sqlstate`` goes into the ErrorResponse 'C' field."""

    def __init__(self, message: str, sqlstate: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.sqlstate = sqlstate
        self.hint = hint
