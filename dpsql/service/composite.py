"""Run a DP subquery whose released values filter a second DP query, in one reservation.

Privacy (sequential composition, then post-processing):

1. The inner query is an ordinary measurement M1 with cost c1.
2. The outer query is planned *before* M1 runs, with the linked key's domain taken as its
   declared domain or, without one, as at most ``LIMIT n`` (else G) public values: its noise
   scales, G and cost c2 are fixed without looking at data. After M1 is released, its values
   S (post-processing of M1) become the key's public set and a ``column IN S`` filter; the
   outer's measures stay exactly those planned, so the cost spent is c1 + c2 whatever S is.
   With fewer real bins than planned the outer is only over-charged, never under-charged.
3. c1 + c2 is reserved in one charge before the engine reads a row; a failure after that is
   the uniform, charged failure of dpsql.boundary.

Re-running the same text replays the cached answer of both (the same S, the same noise).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from sqlglot import exp

from dpsql.boundary import post_processing_boundary
from dpsql.engine.api import cancel_check
from dpsql.engine.scratch import check_post
from dpsql.errors import InternalError, NotSupportedError, ProgrammingError
from dpsql.frontend.statements import DIALECT, CompositeQuery, ReleasedQuery, to_literal
from dpsql.frontend.typecheck import canonical_key_value, type_query
from dpsql.limits import check_plan_rows
from dpsql.lower.compile import compile_plan
from dpsql.plan.annotated import Plan
from dpsql.plan.canonical import answer_key
from dpsql.plan.domains import ordered_values
from dpsql.plan.measures import ReleasedPostProcess
from dpsql.plan.values import KeyPlan
from dpsql.privacy.release import at_confidence, release
from dpsql.service.finish import dummy_answer
from dpsql.service.postprocess import NULL_TYPE, check_tables, picked, run_post, tagged
from dpsql.service.results import Result, decode_answer, encode_answer, to_python, type_code
from dpsql.service.transaction import paid_once

if TYPE_CHECKING:
    from dpsql.engine.api import QueryHandle
    from dpsql.service.protocol import Service
    from dpsql.service.settings import Settings


def plan_composite(
    service: Service, query: CompositeQuery, settings: Settings, analyst: str
) -> tuple[Plan, Plan]:
    """The inner plan and the outer plan as charged (the linked key's domain an upper bound)."""
    inner = service.plan(query.inner, settings, analyst)
    outer_query = type_query(query.outer, service.shadow, analyst)
    domains = service._domains(outer_query, analyst)
    n = _limit(query.inner)
    for i, key in enumerate(outer_query.keys):
        linked = key.columns == (query.column,) and isinstance(key.expr, exp.Column)
        if linked and domains[i] is None:
            # Released values are public: no threshold. Their number is at most the inner
            # LIMIT; without one, G bins bound what the plan may assume.
            size = n if n is not None else max(outer_query.table.max_groups_per_unit, 1)
            domains[i] = tuple(_Placeholder(j) for j in range(max(size, 1)))
    outer = service.plan_typed(outer_query, domains, settings)
    _refuse_auto_clips(
        (inner, outer), "inside a query filtered by a DP subquery", "the two queries"
    )
    return inner, outer


def _refuse_auto_clips(plans: Sequence[Plan], where: str, what: str) -> None:
    """Automatic clipping spends a share of each plan's ε on a range the statement's other
    measurements would depend on: refused (free, before anything runs) in combined statements."""
    for plan in plans:
        if plan.clips:
            column = plan.clips[0].column
            raise NotSupportedError(
                f"{column}: automatic clipping is not supported {where}",
                construct=column,
                hint=f'run {what} separately, or declare clip = "declared" for it',
            )


class _Placeholder:
    """A stand-in bin of the planned outer domain; replaced by released values before use."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<released value {self.index}>"


def _limit(query: Any) -> int | None:
    limit = query.post.args.get("limit")
    if limit is None:
        return None
    value = limit.expression if limit.expression is not None else limit.this
    try:
        return int(value.this)
    except (AttributeError, ValueError):
        return None


def bind_released(outer: Plan, query: CompositeQuery, values: list[Any]) -> Plan:
    """The outer plan over the rows whose linked column is among ``values`` (released)."""
    column = exp.column(query.column)
    condition: exp.Expression = (
        exp.In(this=column, expressions=[to_literal(v) for v in values]) if values else exp.false()
    )
    where = outer.query.where
    # exp.and_ is typed as returning a Condition; it builds an And node (an Expression)
    where = (
        condition
        if where is None
        else cast(exp.Expression, exp.and_(exp.Paren(this=where.copy()), condition))
    )
    keys = []
    for kp in outer.keys:
        if kp.key.columns == (query.column,) and isinstance(kp.key.expr, exp.Column):
            declared = kp.domain if not _is_placeholder(kp.domain) else None
            allowed = values if declared is None else [v for v in values if v in set(declared)]
            kp = KeyPlan(kp.key, ordered_values(allowed))
        keys.append(kp)
    # Measures, noise scales and cost are those planned and charged.
    return outer.with_(query=outer.query.with_where(where), keys=tuple(keys))


def _is_placeholder(domain: tuple | None) -> bool:
    return bool(domain) and isinstance(domain[0], _Placeholder)  # type: ignore[index]


def _fingerprint(inner: Plan, outer: Plan, query: CompositeQuery) -> str:
    parts = ["composite", answer_key(inner), answer_key(outer), query.column, query.output]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _released_values(
    service: Service, inner: Plan, answer: dict, query: CompositeQuery
) -> list[Any]:
    """The inner query's released values of its output column (post-processing only)."""
    result = service._finish(inner, answer, cost=None, cached=False)
    names = [name.lower() for name, _ in result.description]
    index = names.index(query.output.lower())
    values = [canonical_key_value(row[index]) for row in result.rows]
    return list(dict.fromkeys(v for v in values if v is not None))


def _measured(service: Service, plan: Plan, handle: QueryHandle | None) -> Any:
    """One measurement run and released (after the reserve, inside the charged boundary)."""
    result = service.engine.execute(_compile(plan), handle)
    answer = release(plan, result, service.noise, cancel_check(handle))
    return encode_answer(answer, service._key_types(plan))


def run_composite(
    service: Service,
    query: CompositeQuery,
    settings: Settings,
    analyst: str,
    handle: QueryHandle | None,
) -> Result:
    inner, outer = plan_composite(service, query, settings, analyst)
    cost = inner.cost + outer.cost

    def check() -> None:
        for plan in (inner, outer):
            service._dry_run_post(plan, analyst)
            service._check_drawable(plan)

    def execute() -> tuple[str, bool]:
        inner_encoded = _measured(service, inner, handle)
        values = _released_values(service, inner, decode_answer(inner_encoded), query)
        outer_encoded = _measured(service, bind_released(outer, query, values), handle)
        return json.dumps({"inner": inner_encoded, "outer": outer_encoded}), True

    fingerprint = _fingerprint(inner, outer, query)
    paid = paid_once(
        service, analyst, text=query.text, plan_hash=fingerprint, cost=cost, handle=handle,
        check=check, execute=execute, cache_key=fingerprint,
    )  # fmt: skip
    stored, charged, not_cached = paid.answer, paid.charged, paid.note
    with post_processing_boundary():
        data = json.loads(stored)
        values = _released_values(service, inner, decode_answer(data["inner"]), query)
        bound = bind_released(outer, query, values)
        answer = at_confidence(bound, decode_answer(data["outer"]), settings.confidence)
        out = service._finish(bound, answer, cost=charged, cached=charged is None)
    if not_cached:
        out.notes.append(not_cached)
    return out


def _compile(plan: Plan):
    import secrets

    return compile_plan(plan, secrets.randbits(62))


def explain_composite(
    service: Service, query: CompositeQuery, settings: Settings, analyst: str
) -> Result:
    """EXPLAIN of both measurements: the DP subquery's, then the filtered query's."""
    inner, outer = plan_composite(service, query, settings, analyst)
    first = service.explain(inner, analyst)
    second = service.explain(outer, analyst)
    rows = [("subquery: " + str(r[0]), *r[1:]) for r in first.rows]
    rows += [
        ("filtered by the subquery's released " + query.output + ": " + str(r[0]), *r[1:])
        for r in second.rows
    ]
    result = Result(first.description, rows, status="EXPLAIN")
    result.notes = [*first.notes, *second.notes]
    return result


# -- post-processing over several released tables (dpsql.frontend.released) ------------------
#
# Measurements M1..Mk, each an ordinary DP query planned before anything runs, and one
# post-processing step over their released tables (dpsql.service.postprocess). By sequential
# composition the k releases cost c1 + ... + ck whatever the post-processing is; that sum is
# reserved in ONE charge before the engine reads a row (reserve all -> execute all -> release
# -> remember), so when it does not fit nothing runs and nothing is released.


def plan_released(
    service: Service, query: ReleasedQuery, settings: Settings, analyst: str
) -> tuple[Plan, ...]:
    """Every measurement's plan, as charged (refusals here are free)."""
    plans = tuple(service.plan(m, settings, analyst) for m in query.measurements)
    _refuse_auto_clips(plans, "in post-processing of several DP queries", "the queries")
    return plans


def _released_cost(plans: Sequence[Plan]) -> Any:
    """What the statement reserves: the sum of its plans' costs, checked against the sum of
    the plan trees' privacy maps (dpsql.plan.measures.ReleasedPostProcess) before anything is
    read."""
    charged = functools.reduce(operator.add, (p.cost for p in plans))
    mapped = ReleasedPostProcess(tuple(p.root for p in plans), exp.Null()).cost()
    for part in ("epsilon", "delta", "rho"):
        a, b = getattr(mapped, part), getattr(charged, part)
        if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-300):
            raise InternalError(
                f"the statement charges {part} {b!r} but its measurements cost {a!r}",
                construct="plan",
                hint="this is a dpsql bug; nothing was spent",
            )
    return charged


def _released_fingerprint(plans: Sequence[Plan], query: ReleasedQuery) -> str:
    parts = ["released", *(answer_key(p) for p in plans), query.post.sql(dialect=DIALECT)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _dummy(service: Service, plan: Plan) -> Result:
    """The measurement's result on one public dummy row (NULL keys, every aggregate 1)."""
    return service._finish(plan, dummy_answer(service, plan), cost=None, cached=False)


def _empty(service: Service, plan: Plan) -> Result:
    answer = {
        "keys": [],
        "key_types": service._key_types(plan),
        "outputs": [[] for _ in plan.outputs],
        "intervals": [[] for _ in plan.outputs],
        "suppressed": None,
    }
    return service._finish(plan, answer, cost=None, cached=False)


def _tables(query: ReleasedQuery, results: Sequence[Result]) -> list[Any]:
    """The released tables post-processing reads: each measurement's result (description,
    rows), a column its SELECT list holds as a NULL literal typed NULL (dpsql.service.
    postprocess: it takes the type of what it is combined with, as in SQL)."""
    tables = []
    for bound, result in zip(query.measurements, results, strict=True):
        description = [
            (name, NULL_TYPE if isinstance(item.unalias(), exp.Null) else code)
            for (name, code), item in zip(result.description, bound.post.expressions, strict=True)
        ]
        tables.append((description, result.rows))
    return tables


def check_released(
    service: Service, query: ReleasedQuery, plans: Sequence[Plan], analyst: str
) -> list[tuple[str, str]]:
    """Every check that needs no data: each measurement's own, then the post-processing on
    empty released tables and on one dummy row each. Returns the result's description."""
    for plan in plans:
        service._dry_run_post(plan, analyst)
        service._check_drawable(plan)
    check_post(query.post.sql(dialect=DIALECT), query.post)
    check_tables(query.post)
    empty = _tables(query, [_empty(service, plan) for plan in plans])
    description, _ = run_post(query.post, empty, query.names)
    dummy = _tables(query, [_dummy(service, plan) for plan in plans])
    try:
        run_post(query.post, dummy, query.names)
        for tables in (empty, dummy):  # the form that carries intervals, when there is one
            if (tagged_post := tagged(query.post, tables)) is not None:
                run_post(tagged_post, tables, query.names)
    except ProgrammingError as exc:
        raise ProgrammingError(
            f"the query's post-processing fails before any data is used: {exc.message}",
            sqlstate=exc.sqlstate,
            construct=exc.construct,
            hint="fix the query over the released results; nothing was spent",
        ) from None
    return [(name, type_code(t)) for name, t in description]


# -- run, explain, describe ----------------------------------------------------------------------


def run_released(
    service: Service,
    query: ReleasedQuery,
    settings: Settings,
    analyst: str,
    handle: QueryHandle | None,
) -> Result:
    """One release transaction: reserve all -> execute all -> release -> remember; then the
    post-processing of the released tables (free)."""
    plans = plan_released(service, query, settings, analyst)
    for plan in plans:
        check_plan_rows(plan, service.policy.limits)
    fingerprint = _released_fingerprint(plans, query)

    def check() -> None:
        checked = ("released", analyst, fingerprint)  # the text's checks passed before
        if checked not in service._post_checked:
            check_released(service, query, plans, analyst)
            service._post_checked.add(checked)

    def execute() -> tuple[str, bool]:
        encoded = [_measured(service, plan, handle) for plan in plans]
        # the data moved while it ran: answered, never replayed
        moved = any(service.data_version(p.query.table) != p.data_version for p in plans)
        return json.dumps({"measurements": encoded}), not moved

    paid = paid_once(
        service, analyst, text=query.text, plan_hash=fingerprint, cost=_released_cost(plans),
        handle=handle, check=check, execute=execute, cache_key=fingerprint,
    )  # fmt: skip
    stored, charged, not_cached = paid.answer, paid.charged, paid.note
    with post_processing_boundary():
        data = json.loads(stored)
        results = [
            service._finish(
                plan,
                at_confidence(plan, decode_answer(answer), settings.confidence),
                cost=None,
                cached=False,
            )
            for plan, answer in zip(plans, data["measurements"], strict=True)
        ]
        out = _post_result(query, results, charged)
    if not_cached:
        out.notes.append(not_cached)
    return out


def _post_result(query: ReleasedQuery, results: Sequence[Result], cost: Any) -> Result:
    tables = _tables(query, results)
    tagged_post = tagged(query.post, tables)
    picks = picked(query.post, tables) if tagged_post is None else None
    if picks is not None:
        try:
            description, rows = run_post(picks[0], tables, query.names)
        except ProgrammingError:  # the tagged form only adds columns; without them, no interval
            picks = None
    if tagged_post is None and picks is None:
        description, rows = run_post(query.post, tables, query.names)
    elif tagged_post is not None:
        description, rows = run_post(tagged_post, tables, query.names)
    if picks is not None:
        visible = len(query.post.expressions)
        intervals = [
            tuple(
                None
                if pick is None or row[visible + pick[0]] is None
                else results[pick[1]].intervals[row[visible + pick[0]]][pick[2]]
                for pick in picks[1]
            )
            for row in rows
        ]
    elif tagged_post is None:
        visible = len(description)
        intervals = [tuple(None for _ in range(visible)) for _ in rows]
    else:
        visible = len(description) - 2
        intervals = [
            tuple(results[row[-2]].intervals[row[-1]][:visible])
            if row[-2] is not None
            else tuple(None for _ in range(visible))
            for row in rows
        ]
    return Result(
        description=[(name, type_code(t)) for name, t in description[:visible]],
        rows=[tuple(to_python(v) for v in row[:visible]) for row in rows],
        intervals=intervals,  # type: ignore[arg-type]
        cost=cost,
        cached=cost is None,
    )


def explain_released(
    service: Service,
    query: ReleasedQuery,
    settings: Settings,
    analyst: str,
    fmt: str = "table",
) -> Result:
    """EXPLAIN of every measurement (rows prefixed by where it was written, each with its own
    ``<name>: total``), then the post-processing (free) as one row; ``fmt`` "text": one
    QUERY PLAN column, each measurement's text plan under its name."""
    plans = plan_released(service, query, settings, analyst)
    cost = _released_cost(plans)
    if fmt == "text":
        from dpsql.service.explain import explain_text

        lines: list[tuple[Any, ...]] = []
        for i, (plan, name) in enumerate(zip(plans, query.names, strict=True)):
            lines.append((f"measurement {i + 1} ({name}):",))
            lines += [("  " + str(r[0]),) for r in explain_text(service, plan, analyst).rows]
        tree = ReleasedPostProcess(tuple(p.root for p in plans), query.post)
        lines.append((tree.describe() + "  -- " + tree.stability(),))
        lines.append((f"total: ε {cost.epsilon:g}, δ {cost.delta:g}, one reservation",))
        return Result([("QUERY PLAN", "VARCHAR")], lines, status="EXPLAIN")
    rows: list[tuple[Any, ...]] = []
    notes: list[str] = []
    description = None
    for i, (plan, name) in enumerate(zip(plans, query.names, strict=True)):
        part = service.explain(plan, analyst)
        description = description or part.description
        rows += [(f"measurement {i + 1} ({name}): {r[0]}", *r[1:]) for r in part.rows]
        notes += part.notes
    assert description is not None
    what = ", ".join(query.operations) or "SELECT"
    width = len(description) - 1
    post_row = (
        f"post-processing of the released results ({what}): free",
        query.post.sql(dialect=DIALECT),
        *([None] * (width - 1)),
    )
    rows.append(post_row)
    result = Result(description, rows, status="EXPLAIN")
    result.notes = list(dict.fromkeys(notes))
    result.notes.append(
        f"{len(plans)} measurements charged together in one reservation; the post-processing "
        "reads their released values only"
    )
    return result


def describe_released(
    service: Service, query: ReleasedQuery, settings: Settings, analyst: str
) -> list[tuple[str, str]]:
    """The result's columns without running anything (post-processing over empty tables)."""
    plans = plan_released(service, query, settings, analyst)
    empty = _tables(query, [_empty(service, plan) for plan in plans])
    description, _ = run_post(query.post, empty, query.names)
    return [(name, type_code(t)) for name, t in description]
