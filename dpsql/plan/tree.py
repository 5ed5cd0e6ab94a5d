"""The plan tree: the bound query's rows as relational nodes, the planner's choices as the
release over them (:func:`annotate`), and the tree printed node by node (:func:`tree_lines`)."""

from __future__ import annotations

from dpsql.aggregates.mode import ModeMeasure
from dpsql.frontend.statements import Compute, DPQuery, Read, Where
from dpsql.plan.measures import Release
from dpsql.plan.relational import (
    Aggregate,
    Bound,
    ComputedColumn,
    Filter,
    PerUnit,
    Project,
    PublicJoin,
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
from dpsql.policy import ColumnPolicy


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
    table = read.table
    node: Scan | PerUnit = Scan(table.name, table.privacy_unit)
    spec = getattr(table.joined, "spec", None)  # a per-unit relation (dpsql.frontend.per_unit)
    if spec is not None:
        base = table.joined.steps[0].table  # type: ignore[union-attr]
        node = PerUnit(
            Scan(base.name, base.privacy_unit),
            spec.describe(),
            len(spec.keys),
            spec.max_rows,
            spec.max_groups,
        )
    return PublicJoin(node, read.joins) if read.joins else node


def _computed(column: ColumnPolicy) -> ComputedColumn:
    assert column.expr is not None  # a Compute node holds computed columns only
    return ComputedColumn(
        column.name,
        column.expr,
        column.lower if column.lower is not None else float("nan"),
        column.upper if column.upper is not None else float("nan"),
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
