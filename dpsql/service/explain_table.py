"""EXPLAIN, the statement: which plan it explains, and EXPLAIN (FORMAT TABLE), the default.

EXPLAIN reads no data and spends nothing: every row is computed from the plan and the public
noise distributions (FORMAT TEXT: dpsql.service.explain). The table's columns:
``dpsql.service.results.EXPLAIN_COLUMNS``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from dpsql.frontend.statements import CompositeQuery, ExplainStatement, ReleasedQuery, RuleListCall
from dpsql.lower.compile import compile_plan
from dpsql.plan.annotated import Plan
from dpsql.plan.tree import tree_lines
from dpsql.plan.values import Measure, QuantileMeasure
from dpsql.service import group_clamps
from dpsql.service.bias_notes import bounds_lines
from dpsql.service.explain import budget_notes, explain_text, pending_choice
from dpsql.service.results import EXPLAIN_COLUMNS, Result

if TYPE_CHECKING:
    from dpsql.service.protocol import Service
    from dpsql.service.settings import Settings


def explain_statement(
    service: Service, statement: ExplainStatement, settings: Settings, analyst: str
) -> Result:
    """The EXPLAIN of each statement kind: a table function's, a statement of several
    measurements', or a query's plan (FORMAT TABLE or TEXT)."""
    query = statement.query
    if isinstance(query, RuleListCall):
        if query.function != "dp_rule_list":
            from dpsql.models.regression_function import explain_regression

            return explain_regression(service, query, settings)
        from dpsql.rulelist.sql_run import explain_rule_list

        return explain_rule_list(service, query, settings)
    if isinstance(query, CompositeQuery):
        from dpsql.service.composite import explain_composite

        return explain_composite(service, query, settings, analyst)
    if isinstance(query, ReleasedQuery):
        from dpsql.service.composite import explain_released

        return explain_released(service, query, settings, analyst, statement.format)
    plan = service.plan(query, settings, analyst)
    if statement.format == "text":
        return explain_text(service, plan, analyst)
    return service.explain(plan, analyst)


def explain_table(service: Service, plan: Plan, analyst: str | None = None) -> Result:
    """EXPLAIN (FORMAT TABLE): one row per measure, range, threshold, selection and bias
    measure, the bounds' notes, the plan tree, the total and the engine SQL."""
    rows: list[tuple[Any, ...]] = []
    for o in plan.outputs:
        if not o.measures:  # a quantile (EXPLAIN (FORMAT TEXT) explains its guarantee)
            qm = plan.quantile_of(o)
            quantile = isinstance(qm, QuantileMeasure)
            rows.append(
                (
                    o.call.label,
                    f"quantiles({qm.column}) on {qm.bins} bins"
                    if quantile
                    else f"mode({qm.column}) over {qm.bins} public values",
                    "exponential_mechanism" if quantile else "report_noisy_max",
                    float(qm.max_values),
                    None,
                    None,
                    float(qm.cost.epsilon),
                    0.0,
                    0.0,
                    None,
                )
            )
        for name in o.measures:
            m = plan.measure(name)
            rows.append(_measure_row(o.call.label, m, m.delta, float(m.mechanism.cost.rho)))
    rows.extend(range_rows(plan, service.policy.budget))
    if plan.threshold is not None:
        m = plan.measure(plan.threshold.measure)
        rows.append(
            (
                "GROUP BY " + ", ".join(k.key.sql for k in plan.keys),
                f"units >= tau = {plan.threshold.tau:g}",
                m.mechanism.name,
                float(m.l1),
                float(m.l2),
                float(m.mechanism.scale),
                m.epsilon,
                m.delta + plan.threshold.delta,
                float(m.mechanism.cost.rho),
                float(m.mechanism.interval_halfwidth()),
            )
        )
    selection = plan.selection
    if selection is not None and selection.mechanism is not None:
        sel = selection.mechanism
        rows.append(
            (
                "GROUP BY " + ", ".join(k.key.sql for k in plan.keys),
                f"optimal partition selection, kept always from n = {sel.saturation}",
                sel.name,
                float(sel.max_groups),
                float(math.sqrt(sel.max_groups)),
                None,
                sel.epsilon,
                sel.delta,
                0.0,
                None,
            )
        )
    for m in plan.measures:  # what the bounds cut, measured (dpsql.plan.bias)
        if m.measure_kind.bias:
            rows.append(_measure_row("bias", m, 0.0, 0.0))
    for line in bounds_lines(plan):  # e.g. "R = 5 may drop rows of units with more ..."
        rows.append(("bounds", line, None, None, None, None, None, None, None, None))
    for line in group_clamps.explain_lines(plan):  # a grouped AVG's clamp chosen per group
        rows.append(("clamp", line, None, None, None, None, None, None, None, None))

    for line in tree_lines(plan.root):  # the plan tree, root first
        rows.append(("plan", line, None, None, None, None, None, None, None, None))
    c = plan.cost
    budget = service.policy.budget
    rows.append(
        (
            "total",
            f"R={plan.max_rows} rows/group, G={plan.max_groups} groups/unit",
            plan.mechanism,
            None,
            None,
            None,
            c.epsilon if c.rho == 0 else budget.epsilon_of(c),
            c.delta,
            c.rho,
            None,
        )
    )
    engine_sql = compile_plan(plan, 0).render(service.engine.dialect)
    rows.append(("engine_sql", engine_sql, None, None, None, None, None, None, None, None))
    result = Result(EXPLAIN_COLUMNS, rows, status="EXPLAIN")
    result.notes = budget_notes(service, plan, analyst)
    return result


def _measure_row(label: str, m: Measure, delta: float, rho: float) -> tuple[Any, ...]:
    """One measure's EXPLAIN row, in the answer's units (a rescaled measure's fine grid
    divided out): its sensitivities, noise scale, ε, the given δ and ρ, and its 95% half-width."""
    g = m.unit
    return (
        label,
        f"{m.kind}({m.column or '*'})",
        m.mechanism.name,
        float(m.l1 * g),
        float(m.l2 * g),
        float(m.mechanism.scale * g),
        m.epsilon,
        delta,
        rho,
        float(m.mechanism.interval_halfwidth() * g),
    )


def range_rows(plan: Plan, budget: Any) -> list[tuple[Any, ...]]:
    """EXPLAIN's rows of what buys a range before the query's measures: each automatic clip
    (its ε inside the total) and a pending bounds choice, bought first as its own ledger entry
    (charged beside the total; once per analyst and data version with the answer cache on)."""
    rows: list[tuple[Any, ...]] = [
        (
            f"clip({clip.column})",
            f"|{clip.column}| on {clip.histogram.bins} log bins",
            "laplace",
            float(clip.max_values),
            None,
            float(clip.mechanism.mechanism.scale),
            clip.epsilon,
            0.0,
            0.0,
            None,
        )
        for clip in plan.clips
    ]
    if (pending := pending_choice(plan)) is not None:
        p = pending.cost
        epsilon = p.epsilon if p.rho == 0 else budget.epsilon_of(p)
        rows.append(("choose", pending.describe(), "laplace", None, None, None, epsilon, p.delta,
                     p.rho, None))  # fmt: skip
    return rows
