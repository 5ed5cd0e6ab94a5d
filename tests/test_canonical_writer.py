"""The canonical writer's generated per-class functions write what the generic field loop
writes (dpsql.plan.canonical._writer): the loop below is the reference, and the plans of the
fixture's typical queries and of generated ones must serialise byte for byte alike, with and
without the answer key's skipped fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fuzz_grammar import Query, where_queries
from hypothesis import HealthCheck, given, settings

import dpsql
from dpsql.errors import Error
from dpsql.frontend.bind import parse_statement
from dpsql.plan import canonical as c
from dpsql.privacy.ledger import MemoryLedger
from dpsql.service.settings import Settings

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "visits.toml"
SERVICE = dpsql.Service(FIXTURE, ledger=MemoryLedger(), cache=False, plan_cache=0)
SETTINGS = Settings.from_policy(SERVICE.policy)

QUERIES = [
    "SELECT COUNT(*) FROM visits WHERE age > 3",
    "SELECT department, COUNT(*) FROM visits WHERE age >= 3 GROUP BY department",
    "SELECT AVG(cost) FROM visits WHERE age < 40",
    "SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis",
    "SELECT department, smoker, SUM(cost) AS s FROM visits WHERE age BETWEEN 20 AND 50 "
    "GROUP BY department, smoker",
    "SELECT MEDIAN(age), VARIANCE(cost) FROM visits",
    "SELECT COUNT(DISTINCT patient_id) FROM visits",
    "SELECT age, COUNT(*) FROM visits WHERE age < 10 AND age > 2 GROUP BY age",
]


def _reference(value: Any, out: list[str], ctx: Any) -> None:
    """The generic loop the generated writers replaced (memoisation aside)."""
    cls = type(value)
    name = cls.__name__
    out.append(name + "(")
    for field_name, how in c._fields(cls):
        if ctx.skip and (name, field_name) in ctx.skip:
            continue
        item = getattr(value, field_name)
        out.append(field_name + "=")
        if how == "rows":
            out.append("None" if item is None else c._digest(repr(item)))
        elif how == "set" and isinstance(item, tuple):
            out.append("(" + ",".join(sorted(c.canonical(v, skip=ctx.skip) for v in item)) + ")")
        elif how == "where" and isinstance(item, c.exp.Expression):
            c._where(item, out)
        else:
            c._write(item, out, ctx)
        out.append(";")
    out.append(")")


def _plan(text: str) -> Any:
    try:
        statement = parse_statement(text, SERVICE.policy)
        key = SERVICE._plans.key(text, None, SETTINGS, "test")
        return SERVICE._prepare(key, statement, SETTINGS, "test").plan
    except Error:
        return None


def _both(plan: Any, monkeypatch: Any) -> None:
    for skip in (frozenset(), c._POST):
        generated = c.canonical(plan, skip=skip)
        with monkeypatch.context() as m:
            m.setattr(c, "_MEMO", {})
            m.setattr(c, "_WRITERS", {})
            m.setattr(c, "_writer", lambda cls, skip: _reference)
            reference = c.canonical(plan, skip=skip)
        assert generated == reference


def test_generated_writers_write_what_the_loop_writes(monkeypatch: Any) -> None:
    plans = [p for p in map(_plan, QUERIES) if p is not None]
    assert len(plans) >= 6
    for plan in plans:
        _both(plan, monkeypatch)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(where_queries())
def test_generated_writers_on_generated_queries(query: Query) -> None:
    import pytest

    plan = _plan(query.sql)
    if plan is not None:
        with pytest.MonkeyPatch.context() as monkeypatch:
            _both(plan, monkeypatch)
