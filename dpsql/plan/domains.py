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

from dpsql.frontend.statements import GroupKey
from dpsql.policy import SQL_TYPES, ColumnPolicy, TablePolicy

FLOAT_GRID_POINTS = 100_000
MAX_ENUMERATION = 1_000_000


# evaluate(sql) -> rows of a query over public, generated relations only
Evaluator = Callable[[str], list[tuple[Any, ...]]]


def _literal(value: Any, col_type: str) -> str:
    from dpsql.frontend.statements import to_literal

    return exp.cast(to_literal(value), SQL_TYPES[col_type]).sql(dialect="duckdb")


def column_relation(col: ColumnPolicy) -> tuple[str, int] | None:
    """SQL of a one-column relation holding every value the policy allows, and its size."""
    name = exp.to_identifier(col.name).sql(dialect="duckdb")
    sql_type = SQL_TYPES[col.type]
    if col.values is not None:
        body = " UNION ALL ".join(f"SELECT {_literal(v, col.type)} AS {name}" for v in col.values)
        size = len(col.values)
        if not col.values:  # an empty domain (an empty public table): a relation of no rows
            body = f"SELECT CAST(NULL AS {sql_type}) AS {name} WHERE false"
    elif col.type == "bool":
        body = f"SELECT CAST(b AS BOOLEAN) AS {name} FROM (VALUES (false), (true)) t(b)"
        size = 2
    elif col.type == "int" and col.bounded:
        lo, hi = int(col.lower), int(col.upper)  # type: ignore[arg-type]
        size = hi - lo + 1
        if size > MAX_ENUMERATION:
            return None
        body = f"SELECT CAST(range AS BIGINT) AS {name} FROM range({lo}, {hi + 1})"
    elif col.type == "date" and col.date_range is not None:
        # Every day of the declared range: a function of the policy alone, like an int range.
        first, last = col.date_range
        size = (last - first).days + 1
        if size > MAX_ENUMERATION:
            return None
        body = (
            f"SELECT CAST(DATE '{first.isoformat()}' + CAST(range AS INTEGER) AS DATE) AS {name} "
            f"FROM range(0, {size})"
        )
    elif col.type == "float" and col.bounded:
        low, high = float(col.lower), float(col.upper)  # type: ignore[arg-type]
        steps = min(FLOAT_GRID_POINTS, max(1, round((high - low) / col.granularity)))
        size = steps + 1
        body = (
            f"SELECT CAST({low!r} + ({high - low!r}) * range / {steps} AS DOUBLE) AS {name} "
            f"FROM range(0, {steps + 1})"
        )
    else:
        return None
    if col.nullable:
        body += f" UNION ALL SELECT CAST(NULL AS {sql_type}) AS {name}"
        size += 1
    return f"({body})", size


def constant_case(expr: exp.Expression) -> list[Any] | None:
    if not isinstance(expr, exp.Case) or expr.args.get("this") is not None:
        return None
    branches = [i.args["true"] for i in expr.args.get("ifs", [])]
    default = expr.args.get("default")
    branches.append(default if default is not None else exp.Null())
    out: list[Any] = []
    for b in branches:
        if isinstance(b, exp.Null):
            value = None
        elif isinstance(b, exp.Literal):
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
        return ordered_values(constant) if len(constant) <= max_bins else None
    relations = []
    total = 1
    for c in key.columns:
        rel = column_relation(table.columns[c])
        if rel is None:
            return None
        relations.append(rel[0])
        total *= rel[1]
    if total > MAX_ENUMERATION or (
        isinstance(key.expr, exp.Column) and total > max_bins and not key.conditions
    ):
        return None
    source = " CROSS JOIN ".join(f"{r} AS t{i}" for i, r in enumerate(relations))
    from dpsql.frontend.typecheck import canonical_key_value, lower_key

    # Lowered as the engine lowers keys (under TRY, cast to the released type): a value on
    # which the key fails becomes the NULL bin, and the bins are the values the engine yields.
    # WHERE conjuncts over the key's columns run as the engine runs them (under TRY: a value
    # on which one fails is filtered out), on the public values: their bins have no rows.
    where = "".join(f" AND TRY({c})" for c in key.conditions).replace(" AND", " WHERE", 1)
    rows = evaluate(f"SELECT DISTINCT {lower_key(key)} FROM {source}{where} LIMIT {max_bins + 1}")
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
