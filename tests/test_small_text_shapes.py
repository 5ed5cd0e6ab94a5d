"""Shapes found from the text alone (dpsql.service.text_shapes): a statement whose text differs
from one the shape cache served only in the digits of its WHERE slots skips parse and bind,
and gets exactly what the full path gives: the same plan, SQL for the same secret, fingerprint,
answer and charge; anything else (other fixed numbers, other classes, quotes, settings,
analysts, data versions) takes the full path.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import dpsql.pipeline as pipeline
from dpsql.dbapi import connect_service
from dpsql.frontend.bind import parse_statement
from dpsql.lower.compile import compile_plan
from dpsql.pipeline import Service, Settings
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise
from dpsql.service.plan_cache import PreparedPlan
from dpsql.service.text_shapes import scan

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "visits.toml"
EPS = 2.0**-10

SHAPES = [
    "SELECT COUNT(*) FROM visits WHERE age > {a}",
    "SELECT department, COUNT(*) FROM visits WHERE age >= {a} GROUP BY department",
    "SELECT AVG(cost) FROM visits WHERE age < {a}.5",
    "SELECT SUM(age) FROM visits WHERE smoker AND age > {a}",
    "SELECT department, smoker, SUM(cost) AS s FROM visits WHERE age BETWEEN {a} AND {b} "
    "GROUP BY 1, 2 ORDER BY s DESC LIMIT 5",
    "SELECT diagnosis, COUNT(*) FROM visits WHERE department IN ('oncology', 'neurology') "
    "AND cost > {b}.25 GROUP BY diagnosis",
    "SELECT AVG(age), SUM(cost), STDDEV(cost) FROM visits WHERE NOT (age < -{a} OR cost >= {b})",
    "SELECT FLOOR(age / 10) * 10 AS d, COUNT(*) FROM visits WHERE cost > {a} GROUP BY d "
    "HAVING COUNT(*) > 10",
    # the numbers reach the bound keys: never a shape, so never a text shape
    "SELECT age, COUNT(*) FROM visits WHERE age < {a} GROUP BY age",
    "SELECT age, COUNT(*) FROM visits WHERE age IN ({a}, {b}) GROUP BY age",
]
VALUES = [(20, 60), (35, 70), (41, 99), (7, 1000), (52, 61), (3, 4)]


class Counting(Service):
    """Counts the statements that were parsed and bound (the full path)."""

    parsed = 0

    def _prepare(self, *args: Any, **kwargs: Any) -> PreparedPlan:  # key, statement, ..., handle
        self.parsed += 1
        return super()._prepare(*args, **kwargs)


def _service(**options: Any) -> Counting:
    options.setdefault("ledger", MemoryLedger())
    options.setdefault("cache", False)
    return Counting(FIXTURE, **options)


def _settings(service: Service) -> Settings:
    return Settings(EPS, service.policy.delta, service.policy.mechanism)


def _fresh(service: Service, text: str, settings: Settings) -> PreparedPlan:
    return PreparedPlan(service.plan(parse_statement(text, service.policy), settings, "a"))


def _run(service: Service, text: str, settings: Settings, analyst: str = "a") -> None:
    service.execute(text, None, settings, analyst)


def _same(got: PreparedPlan, fresh: PreparedPlan) -> None:
    assert got.template is not None
    secret = 424242
    want = compile_plan(fresh.plan, secret)
    for dialect in ("duckdb", "neutral", "spark"):
        assert got.template.with_secret(secret).render(dialect) == want.render(dialect)
    assert got.plan == fresh.plan and got.plan.cost == fresh.plan.cost
    assert got.fingerprint == fresh.fingerprint == got.plan.fingerprint()
    assert got.plan.query == fresh.plan.query
    assert got.plan.query.text == fresh.plan.query.text


@pytest.mark.parametrize("shape", SHAPES)
def test_a_text_shape_plans_exactly_as_a_fresh_one(shape: str) -> None:
    service = _service()
    settings = _settings(service)
    for a, b in VALUES:
        text = shape.format(a=a, b=b)
        _run(service, text, settings)
        key = service._plans.key(text, None, settings, "a")
        assert key is not None
        got = service._plans.get(key)
        assert got is not None
        _same(got, _fresh(service, text, settings))


def test_text_shapes_skip_parse_and_bind_from_the_fourth_statement() -> None:
    service = _service()
    settings = _settings(service)
    parsed = {}
    for shape in SHAPES:
        before = service.parsed
        for a, b in VALUES:
            _run(service, shape.format(a=a, b=b), settings)
        parsed[shape] = service.parsed - before
    # seen, verified (shape), served by the shape and learned, then from the text: 3 of 6
    assert [parsed[s] for s in SHAPES] == [3] * 8 + [6] * 2


def test_fixed_numbers_classes_and_unscanned_text_take_the_full_path() -> None:
    service = _service()
    settings = _settings(service)
    shape = SHAPES[4]
    for a, b in VALUES[:3]:
        _run(service, shape.format(a=a, b=b), settings)
    assert len(service._texts) == 1
    others = [
        shape.format(a=30, b=40).replace("LIMIT 5", "LIMIT 6"),  # a fixed number
        shape.format(a=30, b="40.5"),  # a decimal where the slot was an integer
        shape.format(a=30, b="040"),  # not a slot literal
        shape.format(a=30, b=40).replace("AS s", 'AS "s"'),  # a quote: not scanned
        shape.format(a=30, b=40) + " -- note",  # a comment
        shape.format(a=30, b=40).replace("BETWEEN", "between"),  # another skeleton
        shape.format(a=30, b=40).replace(" AND", "AND"),  # another skeleton
    ]
    for text in others:
        before = service.parsed
        _run(service, text, settings)
        assert service.parsed == before + 1, text
        got = service._plans.get(service._plans.key(text, None, settings, "a"))  # type: ignore[arg-type]
        assert got is not None
        _same(got, _fresh(service, text, settings))


def test_blanks_do_not_make_a_new_skeleton() -> None:
    service = _service()
    settings = _settings(service)
    shape = SHAPES[4]
    for a, b in VALUES[:3]:
        _run(service, shape.format(a=a, b=b), settings)
    text = "  " + shape.format(a=30, b=40).replace(" ", "\n  ") + " \t"
    before = service.parsed
    _run(service, text, settings)
    assert service.parsed == before
    got = service._plans.get(service._plans.key(text, None, settings, "a"))  # type: ignore[arg-type]
    assert got is not None
    _same(got, _fresh(service, text, settings))


def test_settings_analysts_and_data_versions_key_their_own_text_shapes() -> None:
    service = _service()
    settings = _settings(service)
    shape = SHAPES[1]
    for a, _ in VALUES[:3]:
        _run(service, shape.format(a=a), settings)
    before = service.parsed
    _run(service, shape.format(a=77), settings)
    assert service.parsed == before  # from the text
    for other_settings, analyst in [
        (Settings(EPS / 2, settings.delta, settings.mechanism), "a"),
        (Settings(settings.epsilon, settings.delta, settings.mechanism, quantile_method="pf"), "a"),
        (settings, "b"),
    ]:
        before = service.parsed
        _run(service, shape.format(a=78), other_settings, analyst)
        assert service.parsed == before + 1
    service.engine.versions["visits"] = "2099-01"
    before = service.parsed
    text = shape.format(a=79)
    _run(service, text, settings)
    assert service.parsed == before + 1
    got = service._plans.get(service._plans.key(text, None, settings, "a"))  # type: ignore[arg-type]
    assert got is not None and got.plan.data_version == "2099-01"


def test_a_shape_setting_change_is_not_served_from_the_old_plan() -> None:
    """partition_selection (and quantile_method) reach the plan: the shape cache keys on them
    too (before, this GROUP BY of a key without a public domain was served the plan of the
    setting it was learned under)."""
    service = _service()
    auto = _settings(service)
    threshold = Settings(auto.epsilon, auto.delta, auto.mechanism, partition_selection="threshold")
    shape = "SELECT diagnosis, COUNT(*) FROM visits WHERE age > {a} GROUP BY diagnosis"
    for a, _ in VALUES[:3]:
        _run(service, shape.format(a=a), auto)
    assert len(service._shapes) == 1
    text = shape.format(a=90)
    _run(service, text, threshold)
    got = service._plans.get(service._plans.key(text, None, threshold, "a"))  # type: ignore[arg-type]
    assert got is not None
    _same(got, _fresh(service, text, threshold))


def test_answers_and_charges_equal_a_cache_free_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline.secrets, "randbits", lambda bits: 987654321)
    cached = _service(noise=ZeroNoise())
    plain = _service(noise=ZeroNoise(), plan_cache=0)
    cur, ref = connect_service(cached, "a").cursor(), connect_service(plain, "a").cursor()
    for c in (cur, ref):
        c.execute(f"SET epsilon = {EPS}")
    n = 0
    for shape in SHAPES:
        for a, b in VALUES:
            text = shape.format(a=a, b=b)
            assert cur.execute(text).fetchall() == ref.execute(text).fetchall()
            assert cur.description == ref.description
            assert cur.cost == ref.cost
            n += 1
    spent = [s.ledger.spent("a", s.policy.dataset) for s in (cached, plain)]
    assert spent[0] == spent[1] and spent[0].epsilon == n * EPS
    assert len(cached._texts) == 8 and len(plain._texts) == 0


def test_the_scanner_marks_only_free_standing_numbers() -> None:
    text = "SELECT a1, 'x 5' FROM t WHERE b > 12.5 AND c < 3 LIMIT 7"
    assert scan(text) == (
        "SELECT a1, 'x 5' FROM t WHERE b > \x00 AND c < \x00 LIMIT \x00",
        [(text.index(n), n) for n in ("12.5", "3", "7")],
    )
    assert scan("SELECT 1e5, x.5, 1_0 FROM t")[1] == []  # type: ignore[index]
    assert scan(" SELECT\n a  FROM t WHERE b > 1  ")[0] == "SELECT a FROM t WHERE b > \x00"  # type: ignore[index]
    for text in ('SELECT "a" FROM t', "SELECT a FROM t -- c", "SELECT 'é'", "SELECT $1"):
        assert scan(text) is None


def test_the_date_of_today_is_bound_again_each_day(monkeypatch: pytest.MonkeyPatch) -> None:
    """TODAY() is CURRENT_DATE, fixed at bind: neither a text shape nor the plan cache may
    serve yesterday's date."""
    import datetime as dt

    import dpsql.frontend.rewrite as rewrite
    import dpsql.service.plan_cache as plan_cache

    service = _service()
    settings = _settings(service)
    shape = "SELECT COUNT(*) FROM visits WHERE visit_date < TODAY() AND age > {a}"
    for a, _ in VALUES[:4]:
        _run(service, shape.format(a=a), settings)
    assert len(service._texts) == 0

    class Tomorrow(dt.datetime):
        @classmethod
        def now(cls, tz=None):  # type: ignore[override]
            return dt.datetime(2099, 1, 2, tzinfo=tz)

    fake = type("dt", (), {"datetime": Tomorrow, "UTC": dt.UTC, "date": dt.date})
    monkeypatch.setattr(rewrite, "dt", fake)
    monkeypatch.setattr(plan_cache, "dt", fake)
    for text in (shape.format(a=VALUES[3][0]), shape.format(a=88)):
        _run(service, text, settings)
        got = service._plans.get(service._plans.key(text, None, settings, "a"))  # type: ignore[arg-type]
        assert got is not None and "2099-01-02" in got.plan.query.where.sql()  # type: ignore[union-attr]


# The wire server reads PostgreSQL (dpsql.frontend.dialect): its texts are learned, re-bound and
# served in that dialect. The division shapes are where the dialects bind differently
# (PostgreSQL divides two integers as integers, DuckDB does not).
PG_SHAPES = [
    SHAPES[1],
    SHAPES[2],
    SHAPES[6],
    "SELECT COUNT(*) FROM visits WHERE age / 7 > {a}",
    "SELECT SUM(cost) FROM visits WHERE age / 3 >= {a} AND cost / 2 < {b}.5",
]


def _pg(service: Service) -> Settings:
    return replace(_settings(service), dialect="postgres")


def _fresh_in(service: Service, text: str, settings: Settings) -> PreparedPlan:
    statement = parse_statement(text, service.policy, dialect=settings.dialect)
    return PreparedPlan(service.plan(statement, settings, "a"))


@pytest.mark.parametrize("shape", PG_SHAPES)
def test_a_postgres_text_shape_plans_exactly_as_a_fresh_one(shape: str) -> None:
    service = _service()
    settings = _pg(service)
    parsed = service.parsed
    for a, b in VALUES[:4]:
        text = shape.format(a=a, b=b)
        _run(service, text, settings)
        got = service._plans.get(service._plans.key(text, None, settings, "a"))  # type: ignore[arg-type]
        assert got is not None
        _same(got, _fresh_in(service, text, settings))
    assert service.parsed - parsed == 3  # seen, shape, learned; then from the text


def test_dialects_never_share_a_text_shape() -> None:
    """The same text learned in one dialect is parsed again in the other, and each gets its
    own dialect's plan (age / 7 is an integer division only in PostgreSQL)."""
    service = _service()
    duck, pg = _settings(service), _pg(service)
    shape = PG_SHAPES[3]
    for a, _ in VALUES[:3]:
        _run(service, shape.format(a=a), duck)
    text = shape.format(a=9)
    before = service.parsed
    _run(service, text, pg)
    assert service.parsed == before + 1
    got = service._plans.get(service._plans.key(text, None, pg, "a"))  # type: ignore[arg-type]
    assert got is not None
    _same(got, _fresh_in(service, text, pg))
    assert got.plan != _fresh_in(service, text, duck).plan


# Statements with parameters (the wire server's extended protocol, $n bound per execution):
# a slot fed by an integer parameter is served from the text and the parameters.
PARAM_SHAPES = [
    ("SELECT COUNT(*) FROM visits WHERE age > $1", 1),
    ("SELECT department, COUNT(*) FROM visits WHERE age BETWEEN $2 AND $1 GROUP BY department", 2),
    ("SELECT SUM(cost) FROM visits WHERE age / 3 >= $1 AND cost < $1", 1),
]


def _fresh_params(service: Service, text: str, params: list, settings: Settings) -> PreparedPlan:
    statement = parse_statement(text, service.policy, params, dialect=settings.dialect)
    return PreparedPlan(service.plan(statement, settings, "a"))


@pytest.mark.parametrize("shape", PARAM_SHAPES)
def test_a_parameter_text_shape_plans_exactly_as_a_fresh_one(shape: tuple[str, int]) -> None:
    text, count = shape
    service = _service()
    settings = _pg(service)
    before = service.parsed
    for a, b in VALUES[:4]:
        params = [b, a][:count] if count == 2 else [a]
        service.execute(text, params, settings, "a")
        got = service._plans.get(service._plans.key(text, params, settings, "a"))  # type: ignore[arg-type]
        assert got is not None
        _same(got, _fresh_params(service, text, params, settings))
    assert service.parsed - before == 3  # seen, shape, learned; then from text + parameters


def test_other_parameters_take_the_full_path() -> None:
    """A parameter that is not a WHERE slot must be equal; a non-integer parameter, and a
    slot written as a number beside a parameter, are bound every time."""
    service = _service()
    settings = _pg(service)
    text = "SELECT department, COUNT(*) AS n FROM visits WHERE age > $1 GROUP BY 1 LIMIT $2"
    for a, _ in VALUES[:3]:
        service.execute(text, [a, 5], settings, "a")
    for params in ([40, 5], [41, 6], [41.5, 5], [-3, 5], [True, 5]):
        before = service.parsed
        service.execute(text, params, settings, "a")
        assert service.parsed == before + (params != [40, 5]), params
        got = service._plans.get(service._plans.key(text, params, settings, "a"))  # type: ignore[arg-type]
        assert got is not None
        _same(got, _fresh_params(service, text, params, settings))
    mixed = "SELECT COUNT(*) FROM visits WHERE age > $1 AND cost < 100"
    for a, _ in VALUES:
        before = service.parsed
        service.execute(mixed, [a], settings, "a")
        assert service.parsed == before + 1
