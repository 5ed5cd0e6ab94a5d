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

import hashlib
import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from sqlglot import exp

from dpsql.boundary import charged_boundary, post_processing_boundary, remember_paid
from dpsql.engine.api import cancel_check
from dpsql.errors import NotSupportedError
from dpsql.privacy.release import at_confidence, release
from dpsql.sql.bind import CompositeQuery, to_literal
from dpsql.sql.compile import compile_plan
from dpsql.sql.domains import _ordered
from dpsql.sql.plan import KeyPlan, Plan
from dpsql.sql.typecheck import canonical_key_value, type_query

if TYPE_CHECKING:
    from dpsql.engine.api import QueryHandle
    from dpsql.pipeline import Result, Service, Settings


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
    for plan in (inner, outer):
        if plan.clips:
            column = plan.clips[0].column
            raise NotSupportedError(
                f"{column}: automatic clipping is not supported inside a query filtered by "
                "a DP subquery",
                construct=column,
                hint='run the two queries separately, or declare clip = "declared" for it',
            )
    return inner, outer


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
            kp = KeyPlan(kp.key, _ordered(allowed))
        keys.append(kp)
    # Measures, noise scales and cost are those planned and charged.
    return replace(outer, query=replace(outer.query, where=where), keys=tuple(keys))


def _is_placeholder(domain: tuple | None) -> bool:
    return bool(domain) and isinstance(domain[0], _Placeholder)  # type: ignore[index]


def _fingerprint(inner: Plan, outer: Plan, query: CompositeQuery) -> str:
    parts = ["composite", inner.fingerprint(), outer.fingerprint(), query.column, query.output]
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


def run_composite(
    service: Service,
    query: CompositeQuery,
    settings: Settings,
    analyst: str,
    handle: QueryHandle | None,
) -> Result:
    from dpsql.pipeline import _decode, _encode, _not_cancelled

    inner, outer = plan_composite(service, query, settings, analyst)
    dataset = service.policy.dataset
    fingerprint = _fingerprint(inner, outer, query)
    cache_key = fingerprint if service.cache else None
    stored = service.ledger.cached(analyst, dataset, cache_key) if cache_key else None
    cost = inner.cost + outer.cost
    not_cached = None
    if stored is None:
        service.ledger.check(analyst, dataset, cost, service.policy.budget)
        for plan in (inner, outer):
            service._dry_run_post(plan, analyst)
            service._check_drawable(plan)
        _not_cancelled(handle)
        service._reserve(analyst, cost, query.text, fingerprint)
        with charged_boundary():
            inner_encoded = _encode(
                release(
                    inner,
                    service.engine.execute(_compile(inner), handle),
                    service.noise,
                    cancel_check(handle),
                ),
                service._key_types(inner),
            )
            values = _released_values(service, inner, _decode(inner_encoded), query)
            bound = bind_released(outer, query, values)
            outer_encoded = _encode(
                release(
                    bound,
                    service.engine.execute(_compile(bound), handle),
                    service.noise,
                    cancel_check(handle),
                ),
                service._key_types(bound),
            )
            stored = json.dumps({"inner": inner_encoded, "outer": outer_encoded})
        # paid for: a failed cache write returns the answer with a note (dpsql.boundary)
        if cache_key is not None:
            not_cached = remember_paid(service.ledger, analyst, dataset, cache_key, stored)
        charged: Any = cost
    else:
        charged = None
    with post_processing_boundary():
        data = json.loads(stored)
        values = _released_values(service, inner, _decode(data["inner"]), query)
        bound = bind_released(outer, query, values)
        answer = at_confidence(bound, _decode(data["outer"]), settings.confidence)
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
    from dpsql.pipeline import Result

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
