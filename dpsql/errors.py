"""Exception hierarchy: PEP 249 classes plus dpsql's privacy refusals.

Every error carries a PostgreSQL SQLSTATE (so the wire-protocol server can forward it
unchanged), the construct it is about, its position in the SQL text where there is one,
and what the analyst can do instead. Messages never contain private values.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Position:
    """1-based line and column of a construct in the analyst's SQL text."""

    line: int
    column: int
    offset: int | None = None  # 0-based character offset in the SQL text, when known

    def __str__(self) -> str:
        return f"line {self.line}, column {self.column}"


class Warning(Exception):
    """PEP 249 Warning."""


class BudgetWarning(UserWarning):
    """Less than 10% of an analyst's privacy budget remains (a Python warning, not raised)."""


class Error(Exception):
    """PEP 249 base class of every dpsql error.

    ``sqlstate`` is a five-character PostgreSQL code, ``construct`` the SQL fragment or policy
    key at fault, ``position`` where it stands, ``hint`` what to do instead.
    """

    sqlstate = "XX000"

    def __init__(
        self,
        message: str,
        *,
        sqlstate: str | None = None,
        construct: str | None = None,
        position: Position | None = None,
        hint: str | None = None,
    ) -> None:
        self.message = message
        if sqlstate is not None:
            self.sqlstate = sqlstate
        self.construct = construct
        self.position = position
        self.hint = hint
        super().__init__(self._render())

    def _render(self) -> str:
        text = self.message
        if self.position is not None:
            text += f" (at {self.position})"
        if self.hint:
            text += f". Hint: {self.hint}"
        return f"[{self.sqlstate}] {text}"


class InterfaceError(Error):
    sqlstate = "08000"


class DatabaseError(Error):
    sqlstate = "XX000"


class DataError(DatabaseError):
    sqlstate = "22000"


class OperationalError(DatabaseError):
    sqlstate = "58000"


class LedgerUnavailableError(OperationalError):
    """The budget ledger could not be read or written and NOTHING was charged (SQLSTATE 53000,
    PostgreSQL's insufficient_resources: busy past its timeout, disk full, I/O error, a file
    that is not a ledger). Retrying is safe. Distinct from 58000, the error of a query whose
    cost was charged (dpsql.boundary.ChargedFailure), so a client can tell the two apart."""

    sqlstate = "53000"


class IntegrityError(DatabaseError):
    sqlstate = "23000"


class InternalError(DatabaseError):
    sqlstate = "XX000"


def internal_error() -> InternalError:
    """The one error a door shows for a failure that is not dpsql's own: it names no value
    and no internal class (the operator's log has the cause). Before the reserve such a
    failure is decided by the text and the policy; after it, the charged boundary
    (dpsql.boundary) has already turned it into the uniform charged error."""
    return InternalError(
        "internal error: dpsql could not process this statement",
        hint="report the statement to the operator (SHOW budget shows any charge)",
    )


def door(method: Callable[P, R]) -> Callable[P, R]:
    """Guard a door's public method: a non-dpsql exception raised anywhere below it (the
    door's own bookkeeping included, not only the service) leaves as :func:`internal_error`,
    logged for the operator. tests/test_fault_walk.py fails every function in turn to hold
    every door to it."""

    @functools.wraps(method)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except Error:
            raise
        except Exception:
            logging.getLogger("dpsql").exception("internal error in a door")
            raise internal_error() from None

    return guarded


class ProgrammingError(DatabaseError):
    sqlstate = "42000"


class NotSupportedError(DatabaseError):
    sqlstate = "0A000"


class PolicyError(ProgrammingError):
    """The privacy policy file is invalid; raised at connect, naming the file and key."""

    sqlstate = "F0000"


class SQLSyntaxError(ProgrammingError):
    sqlstate = "42601"


class UndefinedTableError(ProgrammingError):
    sqlstate = "42P01"


class UndefinedColumnError(ProgrammingError):
    sqlstate = "42703"


class PrivacyError(ProgrammingError):
    """The query cannot be answered with differential privacy as written.

    Raised before any data is read and before any budget is spent.
    """

    sqlstate = "42501"


class BudgetExhaustedError(PrivacyError):
    """The analyst's remaining privacy budget does not cover the query."""

    sqlstate = "53400"


def check_analyst(allowed: frozenset[str] | None, analyst: str, where: str) -> None:
    """Refuse an analyst name the policy's ``[privacy] analysts`` list does not hold.

    In-process front doors trust their caller to name the analyst; the list keeps them from
    handing any made-up name a fresh budget. (``dpsql serve`` authenticates its users.)
    """
    if allowed is None or analyst in allowed:
        return
    raise PrivacyError(
        f"analyst {analyst!r} is not in the policy's analysts list",
        sqlstate="28000",
        construct="analyst",
        hint=f"name one of the analysts the policy lists ({where}), or ask an administrator "
        "to add the name to [privacy] analysts",
    )


# Names the DB-API module must export.
__all__ = [
    "BudgetExhaustedError",
    "BudgetWarning",
    "DataError",
    "DatabaseError",
    "Error",
    "IntegrityError",
    "InterfaceError",
    "InternalError",
    "LedgerUnavailableError",
    "NotSupportedError",
    "OperationalError",
    "PolicyError",
    "Position",
    "PrivacyError",
    "ProgrammingError",
    "SQLSyntaxError",
    "UndefinedColumnError",
    "UndefinedTableError",
    "Warning",
]
