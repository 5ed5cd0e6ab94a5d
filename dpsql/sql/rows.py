"""Engine SQL for row inputs of a DP algorithm (dp_rule_list): bounded per unit, counted.

The learner's sensitivities assume each privacy unit contributes at most R rows, so the
engine keeps at most R rows per unit, chosen by a keyed hash of the row with a fresh secret
(never RANDOM()); row-level tables need no bounding.
"""

from __future__ import annotations

from dpsql.policy import TablePolicy
from dpsql.sql.hashing import KEYED_HASH
from dpsql.sql.identifiers import quote_ident as _q


def bounded_rows_sql(table: TablePolicy, select_list: str, secret: int) -> str:
    """``SELECT select_list`` over the table, at most R rows per privacy unit."""
    source = _q(table.name)
    relation = source
    if table.joined is not None:  # a unit_path table: its path joined (private_joins)
        from dpsql.frontend.private_joins import joined_source

        relation = joined_source(table).sql(dialect="duckdb")
    if table.privacy_unit is None:
        return f"SELECT {select_list} FROM {relation}"
    columns = ", ".join(_q(c) for c in table.columns)
    return (
        f"SELECT {select_list} FROM (SELECT * FROM {relation} "
        f"WHERE {_q(table.privacy_unit)} IS NOT NULL QUALIFY ROW_NUMBER() OVER "
        f"(PARTITION BY {_q(table.privacy_unit)} ORDER BY {KEYED_HASH}({columns}, {secret})) "
        f"<= {table.max_rows_per_unit}) AS {source}"
    )


def pattern_counts_sql(
    table: TablePolicy, select_list: str, columns: list[str], secret: int
) -> str:
    """Counts of each distinct row pattern of ``columns`` over the bounded rows.

    The engine (DuckDB or Spark) does the scan, the bounding and the counting; only one row
    per distinct 0/1 pattern, with its count ``__w``, reaches the learner. Sorted, so the
    learner sees the same order on every engine.
    """
    names = ", ".join(columns)
    inner = bounded_rows_sql(table, select_list, secret)
    return f"SELECT {names}, COUNT(*) AS __w FROM ({inner}) AS r GROUP BY {names} ORDER BY {names}"
