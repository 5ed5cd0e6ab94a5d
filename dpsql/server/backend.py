"""Adapters from a session to its two answerers: the DP service and the catalog shadow.

Both return :class:`Outcome` (columns with PostgreSQL OIDs, rows, command tag), so the protocol
layer never cares which one answered. Calls here are blocking; the session runs them in the
server's thread pool.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dpsql.boundary import uniform_charged_failure
from dpsql.errors import door
from dpsql.frontend.sqltext import keywords, skip_quoted
from dpsql.server import types as t
from dpsql.service.answer import Answer

log = logging.getLogger("dpsql.server")

_PLACEHOLDER = re.compile(r"\$(\d+)")
# LIMIT $1 / OFFSET $2, with psycopg 3's cast (LIMIT $1::INTEGER) or a CAST(... AS type).
_LIMIT_PARAMETER = re.compile(
    r"\b(LIMIT|OFFSET)(\s+)(?:\$(\d+)(?:\s*::\s*\w+)?|CAST\s*\(\s*\$(\d+)\s+AS\s+\w+\s*\))",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Outcome:
    """One statement's result: ``columns`` is None for statements that return no rows."""

    columns: tuple[tuple[str, int], ...] | None
    rows: list[tuple] = field(default_factory=list)
    tag: str = "SELECT"
    notices: tuple[tuple[str, str, str], ...] = ()  # (severity, SQLSTATE, text)
    charged: bool = False  # its cost was charged (a failure from here on is the charged one)


def placeholder_count(sql: str) -> int:
    """Highest ``$n`` outside quotes and comments (0 if none)."""
    highest, i, n = 0, 0, len(sql)
    while i < n:
        j = skip_quoted(sql, i)
        if j != i:
            i = j
            continue
        m = _PLACEHOLDER.match(sql, i)
        if m and (i == 0 or not (sql[i - 1].isalnum() or sql[i - 1] == "_")):
            highest = max(highest, int(m.group(1)))
            i = m.end()
            continue
        i += 1
    return highest


def literal(value: object) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, dt.date):
        return f"DATE '{value.isoformat()}'"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    return "'" + str(value).replace("'", "''") + "'"


def inline_parameters(sql: str, params: Sequence[object]) -> str:
    """Replace ``$n`` with SQL literals (used only to *describe* a query, which runs nothing)."""
    out, i, n = [], 0, len(sql)
    while i < n:
        j = skip_quoted(sql, i)
        if j != i:
            out.append(sql[i:j])
            i = j
            continue
        m = _PLACEHOLDER.match(sql, i)
        if m and (i == 0 or not (sql[i - 1].isalnum() or sql[i - 1] == "_")):
            k = int(m.group(1))
            out.append(literal(params[k - 1]) if 0 < k <= len(params) else m.group(0))
            i = m.end()
            continue
        out.append(sql[i])
        i += 1
    return "".join(out)


def inline_limits(sql: str, params: Sequence[object] | None) -> str:
    """``LIMIT $n`` / ``OFFSET $n`` (cast or not) with the bound count written in.

    SQLAlchemy sends ``.limit(n)`` as a bound parameter, which psycopg 3 casts
    (``LIMIT $1::INTEGER``); the pipeline takes a LIMIT that is a number. A non-negative whole
    count is written in as a literal; NULL (PostgreSQL: no limit) and a describe without
    values drop the clause (it never changes the columns); anything else is left for the
    pipeline to refuse.
    """
    out, i, n = [], 0, len(sql)
    while i < n:
        j = skip_quoted(sql, i)
        if j != i:
            out.append(sql[i:j])
            i = j
            continue
        m = _LIMIT_PARAMETER.match(sql, i)
        if m and (i == 0 or not (sql[i - 1].isalnum() or sql[i - 1] == "_")):
            k = int(m.group(3) or m.group(4))
            value = params[k - 1] if params is not None and 0 < k <= len(params) else None
            count = _whole(value)
            if count is not None:
                out.append(f"{m.group(1)}{m.group(2)}{count}")
                i = m.end()
                continue
            if value is None:  # LIMIT NULL is no limit in PostgreSQL; describing: no value
                out.append(" ")
                i = m.end()
                continue
        out.append(sql[i])
        i += 1
    return "".join(out)


def _whole(value: object) -> int | None:
    """A LIMIT/OFFSET count from a bound value (int, or its text form), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _columns(description: Sequence[Sequence[Any]] | None) -> tuple[tuple[str, int], ...] | None:
    """(name, OID) of each (name, type code, ...) column; None for no columns."""
    if not description:
        return None
    return tuple((str(d[0]), t.DPSQL_TYPE_OIDS.get(str(d[1]).upper(), t.TEXT)) for d in description)


def command_tag(sql: str, rows: int, status: str | None, has_rows: bool) -> str:
    if has_rows:
        head = (status or "SELECT").split()[0].upper()
        if head in ("SHOW", "EXPLAIN"):
            return head
        return f"SELECT {rows}"
    if status and status.upper() not in ("SELECT",):
        return status.upper()
    words = keywords(sql, 2)
    return words[0].upper() if words else "SELECT 0"


class DpBackend:
    """One analyst's session over the service (:class:`dpsql.service.session.Session`), as used
    by one wire-protocol session: its :class:`~dpsql.service.answer.Answer` becomes the
    protocol's columns, rows, NOTICEs and command tag."""

    def __init__(self, session: Any) -> None:
        self.session = session

    @property
    def setting_names(self) -> set[str]:
        try:
            return {str(k).lower() for k in self.session.settings.shown()}
        except Exception:
            return set()

    @door
    def execute(self, sql: str, params: Sequence[object] | None) -> Outcome:
        sql = inline_limits(sql, params) if params else sql
        answer = self.session.execute(sql, list(params) if params else None)
        charged = answer.result.cost is not None  # a field: reading it cannot fail
        try:
            return _outcome(answer, sql, charged)
        except Exception as exc:
            if charged:  # the answer was paid for: the one charged error, as in the service
                raise uniform_charged_failure(exc) from None
            raise

    @door
    def describe(self, sql: str, params: Sequence[object] | None) -> tuple[tuple[str, int], ...]:
        """Result columns; plans the query, runs nothing, spends nothing."""
        count = placeholder_count(sql)
        sql = inline_limits(sql, params)
        values = list(params) if params is not None else [None] * count
        return _columns(self.session.describe(sql, values or None)) or ()

    def interrupt(self) -> None:
        self.session.interrupt()

    def close(self) -> None:
        self.session.close()


def _outcome(answer: Answer, sql: str, charged: bool) -> Outcome:
    """The statement's columns, rows, notices and tag, read off its answer."""
    columns = _columns(answer.description)
    rows = [tuple(r) for r in answer.rows] if columns else []
    notices = (
        tuple(("WARNING", "01000", str(text)) for text in answer.warnings)
        + tuple(  # what the bounds cut from each value (docs/bias.md)
            ("NOTICE", "00000", f"dpsql: {note}") for note in answer.bias_notes
        )
        + _cost_notice(answer.cost, answer.cached, answer.remaining)
    )
    tag = command_tag(sql, len(rows), answer.status, columns is not None)
    return Outcome(columns, rows, tag, notices, charged)


def _cost_notice(
    cost: Any, cached: bool, remaining: Any = None
) -> tuple[tuple[str, str, str], ...]:
    """A NOTICE telling the client what the statement was charged and what remains (clients
    can total it); the low-budget WARNING comes with the answer's warnings."""
    if cached:
        return (("NOTICE", "00000", "dpsql: cached answer, charged epsilon=0 delta=0 rho=0"),)
    if cost is None:
        return ()
    eps = float(getattr(cost, "epsilon", 0.0))
    delta = float(getattr(cost, "delta", 0.0))
    rho = float(getattr(cost, "rho", 0.0))
    text = f"dpsql: charged epsilon={eps!r} delta={delta!r} rho={rho!r}"
    if remaining is not None:
        text += f"; {remaining}"
    return (("NOTICE", "00000", text),)
