"""Engine queries for row inputs of a DP algorithm (dp_rule_list, the regressions): bounded per
unit, counted.

The learner's sensitivities assume each privacy unit contributes at most R rows, so the
engine keeps at most R rows per unit, chosen by a keyed hash of the row with a fresh secret
(never RANDOM()); row-level tables need no bounding. The bounding is the query plan's own
(:func:`dpsql.lower.bounding.unit_rows`, one sqlglot tree), and so is the algorithm's select
list (its features, built by its planner from the policy with dpsql.lower.builders): the
whole query is a tree, its secret printed by :func:`dpsql.lower.hashing.with_secret`, and
the engine's fetch_matrix renders it in its own dialect, once. No text on the way.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlglot import exp

from dpsql.lower import sources
from dpsql.lower.bounding import unit_rows
from dpsql.lower.builders import alias, count_star, order_by, select, subquery
from dpsql.lower.hashing import with_secret
from dpsql.plan.relational import Bound, Scan
from dpsql.plan.tree import read_node
from dpsql.policy import TablePolicy


def source(table: TablePolicy) -> exp.Expression:
    """The table's FROM, lowered from the node that reads it (dpsql.plan.tree.read_node,
    dpsql.lower.sources): its quoted name, or a unit_path table's path joined."""
    return sources.source(read_node(table))


def bounded_rows(table: TablePolicy, items: Sequence[exp.Expression]) -> exp.Select:
    """``SELECT items`` over the rows each unit keeps (at most R, :func:`unit_rows`), read
    under the table's name; the tree holds the secret slot (:func:`with_secret`)."""
    if table.privacy_unit is None:
        return select(list(items), source(table))
    kept = unit_rows(table, source(table))
    named = exp.Subquery(
        this=kept, alias=exp.TableAlias(this=exp.Identifier(this=table.name, quoted=True))
    )
    return select(list(items), named)


def pattern_counts(
    table: TablePolicy, items: Sequence[exp.Expression], columns: list[str]
) -> exp.Select:
    """Counts of each distinct row pattern of ``columns`` over the bounded rows.

    The engine (DuckDB or Spark) does the scan, the bounding and the counting; only one row
    per distinct 0/1 pattern, with its count ``__w``, reaches the learner. Sorted, so the
    learner sees the same order on every engine.
    """
    names = [exp.column(c) for c in columns]
    counted = select(
        [*names, alias(count_star(), "__w")],
        subquery(bounded_rows(table, items), "r"),
        group=[n.copy() for n in names],
    )
    return order_by(counted, [n.copy() for n in names])


def engine_text(tree: exp.Expression, secret: int) -> str:
    """A row input's query as text, for reading it (tests, a spy on fetch_matrix): DuckDB's
    dialect, the keyed hash spelled DP_KEYED_HASH, ``secret`` printed. The engines never
    run this text: fetch_matrix takes the tree."""
    return with_secret(tree, secret).sql(dialect="duckdb")


def rows_bound(table: TablePolicy) -> Bound:
    """The relational node of this bounding, for EXPLAIN: a unit keeps at most R rows (one
    "group": the algorithm's whole input)."""
    scan = Scan(table.name, table.privacy_unit)
    return Bound(scan, table.privacy_unit, int(table.max_rows_per_unit), 1)


def bound_note(table: TablePolicy) -> str:
    """One line for an EXPLAIN's notes: the Bound node and its stability."""
    node = rows_bound(table)
    if table.privacy_unit is None:
        return "row input: every row is its own unit (no bounding)"
    return (
        f"row input: {node.describe()}, the rows of smallest keyed hash of the row with a "
        f"fresh secret  -- {node.stability()}"
    )
