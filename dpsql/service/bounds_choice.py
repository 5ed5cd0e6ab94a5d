"""The purchase of "auto" contribution bounds (and default clamp ranges) before a query runs.

A query planned on placeholder bounds (dpsql.service.bounds) buys its choice first, as its
own ledger entry through the release transaction; the query is then planned again with the
chosen bounds at the rest of its ε, and charged next by the service's run.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from dpsql.lower.compile import CompiledQuery, clamp_histogram_query, contribution_query
from dpsql.plan.annotated import Plan
from dpsql.service.bounds import buy as buy_bounds
from dpsql.service.drawable import undrawable
from dpsql.service.plan_cache import PreparedPlan
from dpsql.service.transaction import paid_once

if TYPE_CHECKING:
    from dpsql.engine.api import QueryHandle
    from dpsql.policy import TablePolicy
    from dpsql.service.protocol import Service


def choose_bounds(
    service: Service, prepared: PreparedPlan, analyst: str, handle: QueryHandle | None
) -> PreparedPlan:
    """A query on "auto" bounds whose histogram this analyst has not bought at this data
    version (dpsql.service.bounds): planned again, free, if it was bought since the plan
    was cached; else every free check runs on the placeholder plan, the choice is charged
    as its own ledger entry (share · ε), its histograms released and kept, and the query
    planned with the chosen bounds at the rest of its ε (charged next, by the service's run)."""
    settings, domains = prepared.plan.extra["bounds_settings"]
    query = prepared.plan.query  # as bound: the placeholder bounds, "auto" still marked
    plan = service.plan_typed(query, domains, settings, analyst)
    pending = plan.extra["bounds"].pending
    if pending is None:
        return PreparedPlan(plan)

    def check() -> None:
        service._dry_run_post(plan, analyst)
        service._check_drawable(plan)
        for histogram in pending.mechanisms:
            try:
                histogram.mechanism.sample(service.noise, 0)
                _ = histogram.threshold
            except (ValueError, OverflowError):
                raise undrawable("the contribution bounds' histogram", bounds=False) from None

    def execute() -> tuple[Plan, bool]:
        chosen_query, measured, chosen = buy_bounds(
            service, pending, query, analyst, handle, contribution_query, clamp_query
        )
        chosen_plan = service.plan_typed(chosen_query, domains, replace(settings, epsilon=measured))
        chosen_plan.extra["bounds"] = chosen
        chosen_plan.extra["bounds_settings"] = (settings, domains)  # a per-group clamp's plans
        chosen_plan.extra["bounds_charged"] = pending.cost  # reported with the answer's
        return chosen_plan, False  # kept by buy_bounds per analyst and data version

    # its own ledger entry; the budget check asks room for the query that follows it too
    run = paid_once(
        service, analyst, text=pending.describe(), plan_hash=pending.needs[0].cache_key,
        cost=pending.cost, budget_cost=pending.cost + plan.cost, handle=handle,
        check=check, execute=execute,
    ).answer  # fmt: skip
    return PreparedPlan(run)


def clamp_query(table: TablePolicy, column: str, hist: Any) -> CompiledQuery:
    """The engine query of a clamp range's histogram, with a fresh secret (its rows per unit
    are chosen by keyed hash): dpsql.service.bounds.buy runs it after the charge."""
    return clamp_histogram_query(table, column, hist, secrets.randbits(62))
