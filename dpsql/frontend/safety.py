"""Which WHERE conditions can never raise an engine error, so they may run without TRY(...).

The engine evaluates a WHERE under ``TRY`` because an error that depends on the data (a failing
cast, an integer overflow) would be a free membership oracle: the analyst learns that a row
with such a value exists, and nothing is charged. ``TRY`` costs ~20-40% of a scan, though, since
DuckDB cannot push a filter through it into the scan. A condition built only from declared
columns, well-formed literals of the same type family, comparisons, IN, BETWEEN, LIKE without
ESCAPE, IS [NOT] NULL and AND/OR/NOT cannot raise for any row, so it needs no ``TRY``.

The whitelist is deliberately small; anything else (arithmetic, functions, casts other than a
well-formed ``DATE '...'`` literal, CASE, strings compared with numbers) stays under ``TRY``.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence

from sqlglot import exp

from dpsql.frontend.facts import condition_fact
from dpsql.frontend.logic import conjuncts
from dpsql.policy import TablePolicy

COMPARISON_NODES: tuple[type[exp.Expression], ...] = (
    exp.EQ,
    exp.NEQ,
    exp.GT,
    exp.GTE,
    exp.LT,
    exp.LTE,
    exp.NullSafeEQ,
    exp.NullSafeNEQ,
)

_FAMILY = {"int": "number", "float": "number", "text": "text", "bool": "bool", "date": "date"}
_ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_NUMBER = re.compile(r"\d+(\.\d*)?([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?")


def iso_day(text: str) -> dt.date | None:
    """The day ``text`` spells exactly as YYYY-MM-DD (a valid date), else None: the one
    spelling DuckDB and dpsql read alike."""
    if not _ISO_DATE.fullmatch(text):
        return None
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        return None


def _family(node: exp.Expression, table: TablePolicy, context: str | None = None) -> str | None:
    """The type family of an operand that cannot fail, or None if it might (or is unknown).

    ``context`` is the family of the other side: a plain string literal is text, or a date
    when compared with a date column and written exactly as ``YYYY-MM-DD``.
    """
    if isinstance(node, exp.Paren):
        return _family(node.this, table, context)
    if isinstance(node, exp.Column):
        spec = table.columns.get(node.name.lower())
        return _FAMILY.get(spec.type) if spec is not None else None
    if isinstance(node, exp.Null):
        return "null"
    if isinstance(node, exp.Boolean):
        return "bool"
    if isinstance(node, exp.Neg):
        inner = node.this
        return "number" if isinstance(inner, exp.Literal) and _family(inner, table) else None
    if isinstance(node, exp.Literal):
        if not node.is_string:
            return "number" if _NUMBER.fullmatch(str(node.this)) else None
        if context == "date":
            return "date" if iso_day(node.this) is not None else None
        return "text"
    if isinstance(node, exp.Cast) and not isinstance(node, exp.TryCast):
        to = node.args.get("to")
        literal = node.this
        if (
            isinstance(to, exp.DataType)
            and to.this == exp.DataType.Type.DATE
            and isinstance(literal, exp.Literal)
            and literal.is_string
            and iso_day(literal.this) is not None
        ):
            return "date"
    return None


def _same_family(left: exp.Expression, right: exp.Expression, table: TablePolicy) -> bool:
    a = _family(left, table)
    b = _family(right, table, context=a)
    if a is None or b is None:
        return False
    if a != "date" and b == "date":  # a date column on the right of a string literal
        a = _family(left, table, context=b)
    return a is not None and (a == b or "null" in (a, b))


def cannot_fail(node: exp.Expression, table: TablePolicy) -> bool:
    """True if evaluating ``node`` as a filter can never raise an error, for any row: the
    node's totality, a fact computed once per node and table (dpsql.frontend.facts: through
    AND, OR, NOT and parentheses it is the operands', :func:`_leaf_total` for the rest)."""
    return condition_fact(node, table, "total", _leaf_total)


def _leaf_total(node: exp.Expression, table: TablePolicy) -> bool:
    """The whitelist for a node that is not a connective: its operands are values."""
    if isinstance(node, exp.Boolean):
        return True
    if isinstance(node, exp.Column):
        return _family(node, table) == "bool"
    if isinstance(node, exp.Is):
        # IS NULL never casts; IS TRUE / IS FALSE casts a non-BOOLEAN operand (which can fail).
        family = _family(node.this, table)
        if isinstance(node.expression, exp.Null):
            return family is not None
        return isinstance(node.expression, exp.Boolean) and family in ("bool", "null")
    if isinstance(node, COMPARISON_NODES):
        return _same_family(node.this, node.expression, table)
    if isinstance(node, exp.In):
        if node.args.get("query") is not None or node.args.get("unnest") is not None:
            return False
        values = node.expressions
        return bool(values) and all(_same_family(node.this, v, table) for v in values)
    if isinstance(node, exp.Between):
        low, high = node.args.get("low"), node.args.get("high")
        return (
            low is not None
            and high is not None
            and _same_family(node.this, low, table)
            and _same_family(node.this, high, table)
        )
    if isinstance(node, exp.Like | exp.ILike):
        return (
            node.args.get("escape") is None
            and _family(node.this, table) == "text"
            and isinstance(node.expression, exp.Literal)
            and node.expression.is_string
        )
    return False


def guarded_conditions(where: exp.Expression, table: TablePolicy) -> list[exp.Expression]:
    """A WHERE as condition trees: conjuncts that cannot fail as they are, the rest under TRY
    (:func:`guarded`, each conjunct's totality by :func:`cannot_fail` over ``table``)."""
    return guarded([(part, cannot_fail(part, table)) for part in conjuncts(where)])


def guarded(parts: Sequence[tuple[exp.Expression, bool]]) -> list[exp.Expression]:
    """Conjuncts with their totality as condition trees: the total ones as they are, the rest
    under TRY.

    Conjuncts keep their order, each in parentheses; the ones that might fail are ANDed inside
    one ``TRY(...)`` placed last, so a row whose evaluation errors is filtered out instead of
    failing the query. The trees are copies: the caller may place them in its own query.

    >>> a, b = exp.column("a").eq(1), exp.column("b").eq(2)
    >>> [e.sql() for e in guarded([(a, True), (b, False)])]
    ['(a = 1)', 'TRY((b = 2))']
    """
    safe: list[exp.Expression] = []
    risky: list[exp.Expression] = []
    for part, total in parts:
        (safe if total else risky).append(exp.Paren(this=part.copy()))
    if risky:
        under_try = risky[0]
        for r in risky[1:]:
            under_try = exp.And(this=under_try, expression=r)
        safe.append(exp.Try(this=under_try))
    return safe


def where_conditions(where: exp.Expression, table: TablePolicy, dialect: str) -> list[str]:
    """The SQL text of :func:`guarded_conditions` (for callers that splice text)."""
    return [c.sql(dialect=dialect) for c in guarded_conditions(where, table)]
