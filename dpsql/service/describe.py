"""The result columns of a statement without running it or spending anything (the wire
protocol's Describe, the DB-API's description before execute)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dpsql.frontend.statements import ExplainStatement, PublicSelect, SettingStatement
from dpsql.service.budget_view import BUDGET_SHOWS, show_budget
from dpsql.service.results import EXPLAIN_COLUMNS, Result

if TYPE_CHECKING:
    from dpsql.service.plan_cache import PreparedPlan
    from dpsql.service.protocol import Service


def columns_of(
    service: Service, statement: Any, prepared: PreparedPlan | None, run: Callable[[], Result]
) -> list[tuple[str, str]]:
    """A planned query's columns (its released table's post-processing over no rows),
    EXPLAIN's and SHOW's fixed ones, a public SELECT's by ``run`` (it reads public tables
    only: free); none for a statement without rows."""
    if prepared is not None:
        plan = prepared.plan
        empty = {
            "keys": [],
            "key_types": service._key_types(plan),
            "outputs": [],
            "intervals": [],
            "suppressed": None,
        }
        return service._finish(plan, empty, cost=None, cached=False, prepared=prepared).description
    if isinstance(statement, ExplainStatement):
        return EXPLAIN_COLUMNS if statement.format == "table" else [("QUERY PLAN", "VARCHAR")]
    if isinstance(statement, SettingStatement) and statement.action == "show":
        if statement.name in BUDGET_SHOWS:
            return show_budget(service, "", wide=statement.name == "budget_wide").description
        return [(statement.name, "VARCHAR")]
    if isinstance(statement, PublicSelect):
        return run().description
    return []
