"""Tree helpers shared by the binder, the WHERE safety check and the frontend rewrites
(one definition each, no import cycle)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlglot import exp

from dpsql.errors import ProgrammingError
from dpsql.frontend.positions import position_of, snippet


def conjuncts(node: exp.Expression) -> list[exp.Expression]:
    """The top-level AND operands of ``node`` (parentheses looked through)."""
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.And):
        return conjuncts(node.this) + conjuncts(node.expression)
    return [node]


CLAUSES = ("expressions", "where", "group", "having", "order")


def transform_clauses(select: exp.Select, fn: Callable[[Any], exp.Expr]) -> None:
    """Apply ``fn`` (a sqlglot transform) in place to every clause that names columns: the
    select list, WHERE, GROUP BY, HAVING and ORDER BY (not FROM: that is the caller's)."""
    for arg in CLAUSES:
        value = select.args.get(arg)
        if value is None:
            continue
        if isinstance(value, list):
            select.set(arg, [v.transform(fn, copy=False) for v in value])
        else:
            select.set(arg, value.transform(fn, copy=False))


def column_equality(node: exp.Expression | None) -> exp.EQ | None:
    """``node`` (parentheses aside) when it is ``a = b`` of two columns, else None: the one
    join condition the join lowerings accept."""
    while isinstance(node, exp.Paren):
        node = node.this
    if (
        isinstance(node, exp.EQ)
        and isinstance(node.this, exp.Column)
        and isinstance(node.expression, exp.Column)
    ):
        return node
    return None


def mismatched_join(
    on: exp.Expression, left: str, left_type: str, right: str, right_type: str
) -> ProgrammingError:
    """42804 for a join ON columns of different comparison families, refused before reading:
    run as written, the engine would cast one side, and the cast would fail on exactly the rows
    that reach the join (which the query's WHERE chooses): a yes/no answer about them."""
    return ProgrammingError(
        f"the join compares {left} ({left_type}) with {right} ({right_type}): values of "
        "different types cannot be joined",
        sqlstate="42804",
        construct=snippet(on),
        position=position_of(on),
        hint="join columns declared with the same type (int and float compare as numbers); "
        "if one source stores the key as text, declare it with the other's type in the policy",
    )
