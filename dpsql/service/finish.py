"""The released table's post-processing: what a query's released aggregates become as rows.

Everything here reads released values (or a fixed public dummy row) only, so it is
post-processing: free, and run after the charge except for the dry run, which decides on the
dummy row alone whether the query's post-processing fails before anything is spent. The
service's ``_finish`` / ``_dry_run_post`` / ``_key_types`` call these (tests patch those).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlglot import exp

from dpsql.engine.scratch import NotPlain
from dpsql.errors import Error, ProgrammingError
from dpsql.frontend.positions import position_of
from dpsql.frontend.statements import DIALECT
from dpsql.frontend.typecheck import BOOLEAN_TYPES, lower_key, released_key_type
from dpsql.service.bias_notes import answer_notes
from dpsql.service.plan_cache import PostPlan, PreparedPlan
from dpsql.service.results import Result, project_rows, released_table, to_python, type_code

if TYPE_CHECKING:
    from dpsql.plan.annotated import Plan
    from dpsql.service.protocol import Service


def dummy_answer(service: Service, plan: Plan) -> dict:
    """A released table of one public dummy row (NULL keys, every aggregate 1, its interval
    [1, 1]): what a post-processing step is dry-run on before anything is read or charged."""
    n = len(plan.outputs)
    return {
        "keys": [[None] * len(plan.keys)],
        "key_types": service._key_types(plan),
        "outputs": [[1.0]] * n,
        "intervals": [[[1.0, 1.0]]] * n,
        "suppressed": None,
    }


def dry_run_post(service: Service, plan: Plan, analyst: str) -> None:
    """Run post-processing on one fixed, public dummy row before anything is spent.

    The row (NULL keys, every aggregate 1) depends on nothing private, so refusing a
    query whose post-processing fails on it (``CAST(COUNT(*) AS DATE)``) leaks nothing.
    Failures that depend on the noisy values can only surface after the charge, as they
    must.
    """
    post = plan.query.post
    trivial = (
        exp.Column,
        exp.Alias,
        exp.Identifier,
        exp.Literal,
        exp.Ordered,
        exp.Select,
        exp.From,
        exp.Table,
        exp.Order,
        exp.Limit,
        exp.Offset,
        exp.Star,
    )
    if all(isinstance(node, trivial) for node in post.walk()):
        return
    # The same post-processing text reads keys k0.. whose types depend on the GROUP BY.
    key = (
        analyst,
        plan.query.table.name,
        tuple(k.key.sql for k in plan.keys),
        post.sql(DIALECT),
    )
    if key in service._post_checked:
        return
    answer = dummy_answer(service, plan)
    try:
        service._finish(plan, answer, cost=None, cached=False)
    except Error as exc:
        raise type(exc)(
            f"the query's post-processing fails before any data is used: {exc.message}",
            sqlstate=exc.sqlstate,
            construct=exc.construct,
            hint="fix the expression over the aggregates; nothing was spent",
        ) from None
    check_having_type(service, plan, answer)
    service._post_checked.add(key)


def check_having_type(service: Service, plan: Plan, dummy_answer: dict) -> None:
    """HAVING must be BOOLEAN, like WHERE: its type over the released table's schema
    (the public dummy row), or a free refusal before anything is spent."""
    having = plan.query.post.args.get("where")  # bind rewrites HAVING as the post's WHERE
    if having is None:
        return
    probe = plan.query.post.copy()
    for arg in ("where", "order", "limit", "offset", "distinct"):
        probe.set(arg, None)
    probe.set("expressions", [exp.alias_(having.this.copy(), "__having")])
    columns, types, rows = released_table(plan, dummy_answer)
    description, _ = service.scratch.post_process(probe, columns, types, rows)
    duck_type = description[0][1]
    if duck_type not in BOOLEAN_TYPES:
        raise ProgrammingError(
            f"a HAVING condition must be BOOLEAN, but it is {duck_type}",
            sqlstate="42804",
            construct="HAVING",
            position=position_of(having),
            hint="compare the aggregate with a value, e.g. HAVING COUNT(*) > 10",
        )


def finish(
    service: Service,
    plan: Plan,
    answer: dict,
    *,
    cost: Any,
    cached: bool,
    prepared: PreparedPlan | None = None,
) -> Result:
    """Post-processing of the released table only: in Python when the query just picks
    (and renames) released columns, else on the scratch connection; the same result."""
    columns, types, rows = released_table(plan, answer)
    post = prepared.post if prepared is not None else None
    if post is None:
        post = PostPlan.of(plan.query.post, columns)
        if prepared is not None:
            prepared.post = post
    if post.projection is not None:
        try:
            out = project_rows(post.projection, columns, types, rows, cost=cost, cached=cached)
            out.bias_notes = answer_notes(plan, out.description, out.biases, out.intervals)
            return out
        except NotPlain:
            pass  # a value of an unexpected Python type: let DuckDB cast it
    visible = post.visible
    description, out_rows = service.scratch.post_process(
        post.query or PostPlan.render(plan.query.post), columns, types, rows
    )
    hidden = {name: i for i, (name, _) in enumerate(description)}
    intervals = []
    for row in out_rows:
        intervals.append(
            tuple(
                (row[hidden[f"__lo{j}"]], row[hidden[f"__hi{j}"]]) if f"__lo{j}" in hidden else None
                for j in range(visible)
            )
        )
    biases = [
        tuple(
            (row[hidden[f"__b{j}"]], row[hidden[f"__blo{j}"]], row[hidden[f"__bhi{j}"]])
            if f"__b{j}" in hidden and row[hidden[f"__b{j}"]] is not None
            else None
            for j in range(visible)
        )
        for row in out_rows
    ]
    out = Result(
        description=[(n, type_code(t)) for n, t in description[:visible]],
        rows=[tuple(to_python(v) for v in row[:visible]) for row in out_rows],
        intervals=intervals,
        cost=cost,
        cached=cached,
        biases=biases,
    )
    out.bias_notes = answer_notes(plan, out.description, out.biases, out.intervals)
    return out


def key_types(service: Service, plan: Plan) -> list[str]:
    """DB-API type codes of the released keys (as :func:`lower_key` casts them)."""
    if all(k.key.type is not None for k in plan.keys):
        return [type_code(released_key_type(k.key.type)) for k in plan.keys]  # type: ignore[arg-type]
    types = service.shadow.types(plan.query.table.name, [lower_key(k.key) for k in plan.keys])
    return [type_code(t) for t in types]
