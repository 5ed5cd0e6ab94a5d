"""Public domains of GROUP BY keys, computed from the policy alone.

A key whose every possible value follows from public facts (declared ``values``, a bool, an
int column's declared bounds, a date column's declared days, or a CASE whose branches are
constants) has a public domain: every bin is released, empty ones too, so a key's presence
reveals nothing. Any other key is released only through τ-thresholding. The enumeration never
looks at private rows, so a domain is public whatever function of the column the key applies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from sqlglot import exp

from dpsql.frontend.nullability import may_be_null
from dpsql.frontend.statements import GroupKey
from dpsql.policy import ColumnPolicy, TablePolicy

FLOAT_GRID_POINTS = 100_000
MAX_ENUMERATION = 1_000_000


# evaluate(key, table, limit) -> at most ``limit`` distinct values of the key's lowering over
# the public relations of its columns (dpsql.lower.domain_query builds the query, the service
# runs it on its scratch engine: generated relations only, never a private row)
Evaluator = Callable[[GroupKey, TablePolicy, int], list[tuple[Any, ...]]]


def column_size(col: ColumnPolicy) -> int | None:
    """How many values the policy allows ``col`` (NULL counted when nullable), or None when
    it has no public domain: no declared values, not a bool, not a bounded int, date or
    float, or more than MAX_ENUMERATION days or integers. The relation of these values is
    dpsql.lower.domain_query.column_relation."""
    if col.values is not None:
        size = len(col.values)
    elif col.type == "bool":
        size = 2
    elif col.type == "int" and col.bounded:
        size = int(col.upper) - int(col.lower) + 1  # type: ignore[arg-type]
        if size > MAX_ENUMERATION:
            return None
    elif col.type == "date" and col.date_range is not None:
        # Every day of the declared range: a function of the policy alone, like an int range.
        first, last = col.date_range
        size = (last - first).days + 1
        if size > MAX_ENUMERATION:
            return None
    elif col.type == "float" and col.bounded:
        size = float_grid_steps(col) + 1
    else:
        return None
    return size + 1 if col.nullable else size


def float_grid_steps(col: ColumnPolicy) -> int:
    """The steps of a bounded float column's public grid (its points are one more): one per
    granularity across its bounds, FLOAT_GRID_POINTS at most."""
    low, high = float(col.lower), float(col.upper)  # type: ignore[arg-type]
    return min(FLOAT_GRID_POINTS, max(1, round((high - low) / col.granularity)))


def constant_case(expr: exp.Expression) -> list[Any] | None:
    """The non-NULL values of a searched CASE whose branches are all constants (literals,
    TRUE/FALSE, NULL), or None for any other expression. Whether NULL is one of its values
    too (no ELSE, a NULL branch) is the node's nullable fact (:func:`_declared_domain`)."""
    if not isinstance(expr, exp.Case) or expr.args.get("this") is not None:
        return None
    branches = [i.args["true"] for i in expr.args.get("ifs", [])]
    default = expr.args.get("default")
    if default is not None:
        branches.append(default)
    out: list[Any] = []
    for b in branches:
        if isinstance(b, exp.Null):
            continue
        if isinstance(b, exp.Literal):
            value = b.this if b.is_string else float(b.this)
            # Whole numbers that fit BIGINT are ints; larger ones (1e308) stay DOUBLE, as the
            # engine releases them.
            if not b.is_string and value.is_integer() and abs(value) < 2**63:
                value = int(value)
        elif isinstance(b, exp.Boolean):
            value = b.this
        else:
            return None
        if value not in out:
            out.append(value)
    return out


def key_domain(
    key: GroupKey, table: TablePolicy, max_bins: int, evaluate: Evaluator
) -> tuple | None:
    """The key's public domain (sorted, NULL last), or None if it must be thresholded.

    A key pinned by ``WHERE key IN (...)`` releases exactly the listed values that its
    declared domain allows (all of them when it has none): the list is query text, public.
    """
    if key.allowed is not None:
        declared = _declared_domain(key, table, max_bins, evaluate)
        allowed = (
            key.allowed if declared is None else [v for v in key.allowed if v in set(declared)]
        )
        return ordered_values(allowed) if len(allowed) <= max_bins else None
    return _declared_domain(key, table, max_bins, evaluate)


def _declared_domain(
    key: GroupKey, table: TablePolicy, max_bins: int, evaluate: Evaluator
) -> tuple | None:
    constant = constant_case(key.expr)
    if constant is not None:
        if may_be_null(key.expr, table):  # no ELSE, or a NULL branch: a NULL bin
            constant.append(None)
        return ordered_values(constant) if len(constant) <= max_bins else None
    total = 1
    for c in key.columns:
        size = column_size(table.columns[c])
        if size is None:
            return None
        total *= size
    if total > MAX_ENUMERATION or (
        isinstance(key.expr, exp.Column) and total > max_bins and not key.conditions
    ):
        return None
    from dpsql.frontend.typecheck import canonical_key_value

    # The key lowered as the engine lowers it, over every combination of its columns' public
    # values (dpsql.lower.domain_query.enumeration): the bins are the values the engine yields.
    rows = evaluate(key, table, max_bins + 1)
    if len(rows) > max_bins:
        return None
    return ordered_values([canonical_key_value(r[0]) for r in rows])


def ordered_values(values: Sequence[Any]) -> tuple:
    """Distinct values in the release's total order: NaN after every number, NULL last."""
    from dpsql.frontend.typecheck import canonical_key_value, key_sort_value

    present = list(dict.fromkeys(canonical_key_value(v) for v in values if v is not None))
    with contextlib.suppress(TypeError):
        present = sorted(present, key=key_sort_value)
    return tuple(present) + ((None,) if any(v is None for v in values) else ())
