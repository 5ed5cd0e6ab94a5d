"""The plan tree: the bound query's rows as relational nodes, the planner's choices as the
release over them (:func:`annotate`), and the tree printed node by node (:func:`tree_lines`)."""

from __future__ import annotations

from sqlglot import exp

from dpsql.aggregates.mode import ModeMeasure
from dpsql.frontend.logic import conjuncts
from dpsql.frontend.safety import cannot_fail
from dpsql.frontend.statements import Compute, DPQuery, Read, Where
from dpsql.plan.measures import Release
from dpsql.plan.relational import (
    Aggregate,
    Bound,
    ComputedColumn,
    Filter,
    JoinedRows,
    JoinSide,
    PerUnit,
    Project,
    PublicJoin,
    PublicRows,
    Scan,
)
from dpsql.plan.values import (
    ClipEstimate,
    KeyPlan,
    Measure,
    OutputAggregate,
    QuantileMeasure,
    Selection,
    Threshold,
)
from dpsql.policy import ColumnPolicy, TablePolicy


def relational_nodes(query: DPQuery) -> Scan | PerUnit | PublicJoin | Filter | Project:
    """The bound tree's rows (Read -> [Where] -> [Compute]) as relational nodes with their
    stability, node for node."""
    read, where, compute = query.read, query.node(Where), query.node(Compute)
    rows = _read(read)
    node = rows if where is None else Filter(rows, where.condition)
    if compute is not None:
        return Project(node, tuple(_computed(c) for c in compute.columns))
    return node


def _read(read: Read) -> Scan | PerUnit | PublicJoin:
    node = read_node(read.table)
    assert not isinstance(node, PublicRows)  # a DP query reads a private table
    return PublicJoin(node, read.joins) if read.joins else node


def read_node(table: TablePolicy) -> Scan | PerUnit | PublicRows:
    """The relational node that reads ``table`` as the engine reads it: a stored table by its
    name (a Scan), a per-unit relation (PerUnit, over its base table's node), or a virtual
    table of private tables joined on the unit, or a unit_path table (a Scan whose
    ``source`` holds the join: each side's node, alias, kind and ON tree). Everything the
    lowerings need is on the nodes (dpsql.lower.sources reads them), built from the validated
    policy table only."""
    if table.joined is None:
        return Scan(table.name, table.privacy_unit)
    return _side_node(table)


def _side_node(table: TablePolicy) -> Scan | PerUnit | PublicRows:
    """``table`` as a side of a join (or the FROM of a joined read): a public table as its
    rows, a per-unit relation, a join, or the stored table."""
    if table.public and table.rows is not None:
        columns = tuple((name, col.type) for name, col in table.columns.items())
        return PublicRows(table.name, columns, tuple(table.rows))
    joined = table.joined
    if joined is None:
        return Scan(table.name, table.privacy_unit)
    spec = getattr(joined, "spec", None)  # a per-unit relation (dpsql.frontend.per_unit)
    if spec is not None:
        base = joined.steps[0].table
        scan = _side_node(base)
        assert isinstance(scan, Scan)  # a per-unit relation groups a private table
        where: tuple[tuple[exp.Expression, bool], ...] = ()
        if spec.where is not None:
            where = tuple((c, cannot_fail(c, base)) for c in conjuncts(spec.where))
        stored = tuple(c for c, col in base.columns.items() if col.expr is None)
        return PerUnit(
            scan,
            spec.describe(),
            len(spec.keys),
            spec.max_rows,
            spec.max_groups,
            spec=spec,
            where=where,
            stored=stored,
        )
    sides = tuple(
        JoinSide(_side_node(step.table), step.alias, step.kind, _on(step.on) if step.on else None)
        for step in joined.steps
    )
    return Scan(table.name, table.privacy_unit, JoinedRows(sides, joined.outputs))


def _on(pairs: tuple[tuple[str, str, str, str], ...]) -> exp.Expression:
    """A join step's ON pairs ``(alias, column, alias, column)`` as one condition tree, the
    equalities ANDed in order."""
    out: exp.Expression | None = None
    for a, ca, b, cb in pairs:
        eq = exp.EQ(this=_column(a, ca), expression=_column(b, cb))
        out = eq if out is None else exp.And(this=out, expression=eq)
    assert out is not None
    return out


def _column(alias: str, column: str) -> exp.Column:
    return exp.Column(
        this=exp.Identifier(this=column, quoted=True),
        table=exp.Identifier(this=alias, quoted=False),
    )


def _computed(column: ColumnPolicy) -> ComputedColumn:
    assert column.expr is not None  # a Compute node holds computed columns only
    return ComputedColumn(
        column.name,
        column.expr,
        column.lower if column.lower is not None else float("nan"),
        column.upper if column.upper is not None else float("nan"),
        column.tree,
    )


def annotate(
    query: DPQuery,
    bound: tuple[int, int, str, bool],
    keys: tuple[KeyPlan, ...],
    measures: tuple[Measure, ...],
    outputs: tuple[OutputAggregate, ...],
    *,
    threshold: Threshold | None = None,
    quantiles: tuple[QuantileMeasure | ModeMeasure, ...] = (),
    clips: tuple[ClipEstimate, ...] = (),
    selection: Selection | None = None,
) -> Release:
    """The planner's choices as the release tree over the query's rows:
    Release(Aggregate(Bound(rows))), ``bound`` = (R, G, bounding, group scaling)."""
    R, G, method, groups_scaled = bound
    rows = relational_nodes(query)
    hidden = "thresholded"
    if selection is not None and selection.mechanism is not None:
        hidden = "optimal selection"
    node = Bound(rows, query.table.privacy_unit, R, G, method, groups_scaled)
    aggregate = Aggregate(node, keys, measures, hidden)
    return Release(aggregate, outputs, threshold, quantiles, clips, selection)


def tree_lines(root: object) -> list[str]:
    """The tree, one node per line, children indented under their parent, with each node's
    stability (or, for a release, its measurements and their privacy maps)."""
    lines: list[str] = []

    def visit(node: object, depth: int) -> None:
        pad = "  " * depth
        lines.append(f"{pad}{node.describe()}  -- {node.stability()}")  # type: ignore[attr-defined]
        if isinstance(node, Release):
            for m in node.measurements:
                cost = m.privacy_map()
                lines.append(f"{pad}  {m.describe()}: eps {cost.epsilon:.6g}, rho {cost.rho:.6g}")
            for q in node.quantile_measurements:
                cost = q.privacy_map()
                lines.append(f"{pad}  {q.describe()}: eps {cost.epsilon:.6g}")
            for c in node.clip_measurements:
                cost = c.privacy_map()
                lines.append(f"{pad}  {c.describe()}: eps {cost.epsilon:.6g}")
            if node.threshold is not None:
                lines.append(f"{pad}  {node.threshold.describe()}")
            selection = node.selection_measurement
            if selection is not None:
                cost = selection.privacy_map()
                lines.append(
                    f"{pad}  {selection.describe()}: eps {cost.epsilon:.6g}, delta {cost.delta:.6g}"
                )
        for child in node.children():  # type: ignore[attr-defined]
            visit(child, depth + 1)

    visit(root, 0)
    return lines
