"""The errors a wire session sends: :class:`SqlError` (SQLSTATE, message, hint, position),
:func:`as_sql_error` for anything raised while answering, and :class:`Closed` (the client went
away). Shared by the session (dpsql.server.session) and its parts (the extended protocol, the
session's own statements, the handshake)."""

from __future__ import annotations

import logging

from dpsql import errors as dperr
from dpsql.server import protocol as p
from dpsql.server import types as t
from dpsql.server.failures import ClientError

log = logging.getLogger("dpsql.server")


class SqlError(Exception):
    """An error reported to the client; ``position`` is a 0-based offset in the statement."""

    def __init__(
        self,
        sqlstate: str,
        message: str,
        *,
        hint: str | None = None,
        position: int | None = None,
        fatal: bool = False,
    ) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.message = message
        self.hint = hint
        self.position = position
        self.fatal = fatal


class Closed(Exception):
    """The client went away."""


def as_sql_error(exc: BaseException) -> SqlError:
    if isinstance(exc, SqlError):
        return exc
    if isinstance(exc, dperr.Error):
        pos = exc.position.offset if exc.position is not None else None
        return SqlError(exc.sqlstate, exc.message, hint=exc.hint, position=pos)
    if isinstance(exc, ClientError):
        return SqlError(exc.sqlstate, exc.message, hint=exc.hint)
    if isinstance(exc, t.ParameterError):
        return SqlError("22P02", str(exc))
    if isinstance(exc, t.UnsupportedBinary):
        return SqlError("0A000", str(exc), hint="request text format for this column")
    if isinstance(exc, p.ProtocolViolation):
        return SqlError(exc.sqlstate, exc.message, fatal=True)
    log.exception("internal error", exc_info=exc)
    return SqlError("XX000", "internal error in dpsql server", hint="see the server log")


def cancelled_waiting(timed_out: bool) -> SqlError:
    """A statement cancelled (by its timeout or a cancel request) before its turn to run came:
    nothing ran or was spent (the loop's path and the connection thread's send the same)."""
    return SqlError(
        "57014",
        "canceling statement due to statement timeout"
        if timed_out
        else "canceling statement due to user request",
        hint="it was still waiting for its turn to run (the analyst's other "
        "statements, or the server's, were running); nothing ran or was spent",
    )


def timed_out_running() -> SqlError:
    """A statement stopped by its statement timeout while it ran."""
    return SqlError(
        "57014",
        "canceling statement due to statement timeout",
        hint="raise statement_timeout (SET statement_timeout = '60s') or simplify",
    )
