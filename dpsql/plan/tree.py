"""A finished plan as its tree of typed nodes (for EXPLAIN and the cost check)."""

from __future__ import annotations

from dpsql.frontend.statements import Compute, DPQuery, Read, Where
from dpsql.plan.measures import (
    ClipMeasurement,
    Measurement,
    PostProcess,
    QuantileMeasurement,
    Release,
    Selection,
    Threshold,
)
from dpsql.plan.relational import (
    Aggregate,
    AggregateMeasure,
    Bound,
    ComputedColumn,
    Filter,
    PerUnit,
    Project,
    PublicJoin,
    Scan,
)
from dpsql.plan.values import Measure, OutputAggregate, Plan, QuantileMeasure
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


def plan_tree(plan: Plan) -> PostProcess:
    """The bound tree's rows (relational_nodes), then what planning added: Bound ->
    Aggregate -> Release -> Post."""
    query = plan.query
    table = query.table
    node = relational_nodes(query)
    bound = Bound(
        node,
        table.privacy_unit,
        plan.max_rows,
        plan.max_groups,
        plan.bounding,
        plan.group_scaling,
    )
    measures = tuple(
        AggregateMeasure(
            m.name,
            m.kind,
            m.column,
            _row_bound(m, plan.max_rows) * m.scale,
            per_unit=m.measure_kind.per_pair,
        )
        for m in plan.measures
    )
    hidden = "thresholded"
    if plan.selection is not None and plan.selection.mechanism is not None:
        hidden = "optimal selection"
    domains = tuple(
        hidden if kp.domain is None else f"public: {len(kp.domain)} bins" for kp in plan.keys
    )
    aggregate = Aggregate(bound, tuple(kp.key.sql for kp in plan.keys), domains, measures)
    measurements = []
    for spec, m in zip(measures, plan.measures, strict=True):
        _, l1, l2 = bound.unit_change(spec.row_bound, per_unit=spec.per_unit)
        measurements.append(Measurement(m.name, m.mechanism, l1, l2))
    threshold = None
    if plan.threshold is not None:
        threshold = Threshold(plan.threshold.measure, plan.threshold.tau, plan.threshold.delta)
    quantiles = tuple(
        QuantileMeasurement(
            q.name,
            q.column,
            q.part_epsilon,
            len(q.parts),
            q.max_values,
            bound.max_rows,
            bound.max_groups,
            q.grid.bins,
        )
        if isinstance(q, QuantileMeasure)
        else q.node(bound.max_rows, bound.max_groups)  # its own node (MODE)
        for q in plan.quantiles
    )
    clips = tuple(
        ClipMeasurement(
            c.column,
            c.mechanism.mechanism.scale,
            bound.max_rows,
            bound.max_groups,
            c.histogram.bins,
        )
        for c in plan.clips
    )
    selection = None
    if plan.selection is not None and plan.selection.mechanism is not None:
        spec = next(s for s in measures if s.name == plan.selection.measure)
        _, l1, _ = bound.unit_change(spec.row_bound, per_unit=spec.per_unit)
        selection = Selection(spec.name, plan.selection.mechanism, l1)
    release = Release(
        aggregate,
        tuple(measurements),
        threshold,
        tuple(
            f"{o.call.label} = f({', '.join(o.measures or _quantile_names(plan, o))})"
            for o in plan.outputs
        ),
        quantiles,
        clips,
        selection,
    )
    return PostProcess(release, query.post)


def _quantile_names(plan: Plan, output: OutputAggregate) -> tuple[str, ...]:
    return (plan.quantile_of(output).name,)


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
            for q in node.quantiles:
                cost = q.privacy_map()
                lines.append(f"{pad}  {q.describe()}: eps {cost.epsilon:.6g}")
            for c in node.clips:
                cost = c.privacy_map()
                lines.append(f"{pad}  {c.describe()}: eps {cost.epsilon:.6g}")
            if node.threshold is not None:
                lines.append(f"{pad}  {node.threshold.describe()}")
            if node.selection is not None:
                cost = node.selection.privacy_map()
                lines.append(
                    f"{pad}  {node.selection.describe()}: eps {cost.epsilon:.6g}, "
                    f"delta {cost.delta:.6g}"
                )
        for child in node.children():  # type: ignore[attr-defined]
            visit(child, depth + 1)

    visit(root, 0)
    return lines


def _row_bound(m: Measure, R: int) -> int:
    """The largest |value| one row adds to a measure, from its fixed-point range alone (a
    bias measure: one pair or row, from R and the range: dpsql.plan.bias), as its kind's
    object derives it (dpsql.plan.measure_kinds.MeasureKind.row_bound), not the planner."""
    return m.measure_kind.row_bound(m.lo, m.hi, m.center, m.center2, R)
