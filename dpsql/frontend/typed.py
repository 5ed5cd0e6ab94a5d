"""Every fact of an expression node at once: its type, value range and totality (issue 26).

The facts themselves are kept on the node (dpsql.frontend.facts) and computed once per node
and table, by the rule that owns each: the type known without DuckDB's binder
(dpsql.frontend.simple_where.declared_type), the value range by interval arithmetic
(dpsql.frontend.intervals.value_range), the totality by the whitelist
(dpsql.frontend.safety.cannot_fail), whether the column programs evaluate it as a
condition (dpsql.frontend.simple_where.readable), and whether it can be NULL
(dpsql.frontend.nullability.may_be_null). The type is the binder's once the shadow typing
asked it (dpsql.frontend.typecheck.type_query records it on the node). :func:`typed` reads
them all as one frozen record (EXPLAIN-style views, tests); the planner's paths ask only the
fact they need, so no fact a query does not use is computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlglot import exp

from dpsql.frontend.intervals import NotNumeric, value_range
from dpsql.frontend.nullability import may_be_null
from dpsql.frontend.safety import cannot_fail
from dpsql.frontend.simple_where import declared_type, readable
from dpsql.policy import TablePolicy


@dataclass(frozen=True)
class Typed:
    """The facts of one node over one table.

    ``type``: its DuckDB type known without the binder (None: only the binder knows).
    ``lower``/``upper``/``integral``: its per-row value range (None when it is not a number;
    ``why`` then says what is not). ``total``: as a condition it never raises on any row.
    ``readable``: as a condition, the column programs evaluate it exactly as DuckDB does.
    ``nullable``: it can be NULL on some row (dpsql.frontend.nullability)."""

    type: str | None
    lower: float | None
    upper: float | None
    integral: bool | None
    total: bool
    readable: bool
    why: str | None = None
    nullable: bool = True

    @property
    def bounded(self) -> bool:
        return (
            self.lower is not None
            and self.upper is not None
            and math.isfinite(self.lower)
            and math.isfinite(self.upper)
        )


def typed(node: exp.Expression, table: TablePolicy) -> Typed:
    """Every fact of ``node`` over ``table`` (each computed at most once, kept on the node)."""
    try:
        found = value_range(node, table)
    except NotNumeric as exc:
        lower = upper = integral = None
        why: str | None = exc.why
    else:
        lower, upper, integral, why = found.lower, found.upper, found.integral, None
    return Typed(
        type=declared_type(node, table),
        lower=lower,
        upper=upper,
        integral=integral,
        total=cannot_fail(node, table),
        readable=readable(node, table),
        why=why,
        nullable=may_be_null(node, table),
    )
