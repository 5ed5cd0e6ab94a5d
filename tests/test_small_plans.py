"""The shape cache (dpsql.service.shape_cache): a statement that differs from one planned before
only in its WHERE numbers reuses that plan and SQL template, and gets exactly what a fresh
planning gives: the same engine SQL for the same secret, the same cost, the same fingerprint,
the same answer and charge. Across settings changes, policy reloads and data versions.
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
from dpsql.service.plan_cache import PreparedPlan, SecretTemplate
from dpsql.service.shape_cache import literal_slots

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
    # the numbers reach the bound keys (conditions / allowed values): never a shape hit
    "SELECT age, COUNT(*) FROM visits WHERE age < {a} GROUP BY age",
    "SELECT FLOOR(age / 10) * 10 AS d, COUNT(*) FROM visits WHERE age > {a} GROUP BY d",
    "SELECT age, COUNT(*) FROM visits WHERE age IN ({a}, {b}) GROUP BY age",
]
VALUES = [(20, 60), (35, 70), (41, 99), (7, 1000)]


def _service(**options: Any) -> Service:
    options.setdefault("ledger", MemoryLedger())
    options.setdefault("cache", False)
    return Service(FIXTURE, **options)


def _fresh(service: Service, text: str, settings: Settings) -> PreparedPlan:
    return PreparedPlan(service.plan(parse_statement(text, service.policy), settings, "a"))


def _via_cache(service: Service, text: str, settings: Settings) -> PreparedPlan:
    """What Service.execute prepares for ``text`` (plan cache off for this key)."""
    return service._prepare(None, parse_statement(text, service.policy), settings, "a")


def _same(cached: PreparedPlan, fresh: PreparedPlan) -> None:
    secret = 123456789
    if cached.template is None:  # planned fresh (not a shape): its first run compiles it
        cached.template = SecretTemplate.build(cached.plan)
    got = cached.template.with_secret(secret)
    want = compile_plan(fresh.plan, secret)
    for dialect in ("duckdb", "neutral"):
        assert got.render(dialect) == want.render(dialect)
    assert got.key_columns == want.key_columns and got.measure_columns == want.measure_columns
    assert cached.plan.cost == fresh.plan.cost
    assert cached.fingerprint == fresh.fingerprint == cached.plan.fingerprint()
    assert cached.plan == fresh.plan
    assert cached.plan.query.text == fresh.plan.query.text
    assert [o.call.label for o in cached.plan.outputs] == [o.call.label for o in fresh.plan.outputs]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_cached_shape_plans_exactly_as_a_fresh_one(shape: str) -> None:
    service = _service()
    settings = Settings.from_policy(service.policy)
    for a, b in VALUES:
        text = shape.format(a=a, b=b)
        _same(_via_cache(service, text, settings), _fresh(service, text, settings))


def test_shapes_hit_for_new_numbers_and_not_for_key_numbers() -> None:
    service = _service()
    settings = Settings.from_policy(service.policy)
    hits = {}
    for shape in SHAPES:
        for a, b in VALUES:
            _via_cache(service, shape.format(a=a, b=b), settings)
        last = parse_statement(shape.format(a=3, b=4), service.policy)
        hits[shape] = service._shapes.lookup(service, last, settings, "a") is not None
    assert [hits[s] for s in SHAPES] == [True] * 7 + [False] * 3


def test_settings_changes_key_their_own_shape() -> None:
    service = _service()
    shape = SHAPES[1]
    for epsilon, mechanism in [(1.0, "laplace"), (0.25, "laplace"), (1.0, "gaussian")]:
        settings = Settings(epsilon, 1e-6, mechanism)
        for a, b in VALUES:
            text = shape.format(a=a, b=b)
            cached = _via_cache(service, text, settings)
            _same(cached, _fresh(service, text, settings))
            assert cached.plan.epsilon == epsilon and cached.plan.mechanism == mechanism


def test_a_new_data_version_replans() -> None:
    service = _service()
    settings = Settings.from_policy(service.policy)
    shape = SHAPES[3]
    for a, b in VALUES[:2]:
        _via_cache(service, shape.format(a=a, b=b), settings)
    service.engine.versions["visits"] = "2099-01"
    text = shape.format(a=50, b=1)
    statement = parse_statement(text, service.policy)
    assert service._shapes.lookup(service, statement, settings, "a") is None
    cached = _via_cache(service, text, settings)
    assert cached.plan.data_version == "2099-01"
    _same(cached, _fresh(service, text, settings))
    again = _via_cache(service, shape.format(a=51, b=1), settings)
    _same(again, _fresh(service, shape.format(a=51, b=1), settings))


def test_a_reloaded_policy_plans_with_its_own_bounds(tmp_path: Path) -> None:
    """A reload is a new Service: a shape learned under the old bounds is not reused."""
    text = "SELECT SUM(age) FROM visits WHERE age > 30"
    old = _service()
    settings = Settings.from_policy(old.policy)
    for a in (10, 20):
        _via_cache(old, f"SELECT SUM(age) FROM visits WHERE age > {a}", settings)
    policy = FIXTURE.read_text().replace("max_rows_per_unit = 5", "max_rows_per_unit = 2")
    assert policy != FIXTURE.read_text()
    path = tmp_path / "visits.toml"
    path.write_text(
        policy.replace('source = "visits.csv"', f'source = "{FIXTURE.parent}/visits.csv"')
    )
    new = Service(path, ledger=MemoryLedger(), cache=False)
    cached = _via_cache(new, text, settings)
    _same(cached, _fresh(new, text, settings))
    assert cached.plan.max_rows == 2 and _via_cache(old, text, settings).plan.max_rows == 5


def test_analysts_do_not_share_shapes() -> None:
    service = _service()
    settings = Settings.from_policy(service.policy)
    for a, _ in VALUES:
        _via_cache(service, SHAPES[0].format(a=a), settings)
    statement = parse_statement(SHAPES[0].format(a=77), service.policy)
    assert service._shapes.lookup(service, statement, settings, "a") is not None
    assert service._shapes.lookup(service, statement, settings, "b") is None


def test_answers_and_charges_equal_a_cache_free_service(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ZeroNoise and one secret, every statement through the shape cache answers what a
    service with both caches off answers, and is charged the same each time."""
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
            assert cur.cost == ref.cost
            n += 1
    spent = [s.ledger.spent("a", s.policy.dataset) for s in (cached, plain)]
    assert spent[0] == spent[1] and spent[0].epsilon == n * EPS
    assert len(cached._shapes) > 0 and len(plain._shapes) == 0


def test_only_numbers_compared_in_the_where_are_slots() -> None:
    policy = _service().policy
    text = (
        "SELECT COUNT(*) FROM visits WHERE age > 4 AND cost BETWEEN 1.5 AND 9 AND "
        "department = 'x' AND age + 3 > 10 AND age > 1e3 AND age > 0012 AND age < -2"
    )
    statement = parse_statement(text, policy)
    assert statement.where is not None
    assert sorted(str(n.this) for n, _ in literal_slots(statement.where)) == [
        "1.5",
        "10",
        "2",
        "4",
        "9",
    ]


def test_with_literals_renders_every_dialect_with_the_statement_numbers() -> None:
    service = _service()
    settings = Settings.from_policy(service.policy)
    shape = SHAPES[4]
    for a, b in VALUES[:2]:
        _via_cache(service, shape.format(a=a, b=b), settings)
    text = shape.format(a=44, b=55)
    cached = _via_cache(service, text, settings)
    assert cached.template is not None
    fresh = compile_plan(_fresh(service, text, settings).plan, 9)
    # Spark was never rendered for the template: rendering it swaps the sentinels too
    assert cached.template.with_secret(9).render("spark") == fresh.render("spark")
    assert replace(fresh, secret=9).render("duckdb") == cached.template.with_secret(9).render()


def test_small_eager_tables_run_on_one_duckdb_thread_unless_set() -> None:
    service = _service()
    threads = service.engine._con.execute("SELECT current_setting('threads')").fetchone()
    assert threads is not None and int(threads[0]) == 1
    import tomllib

    policy = tomllib.loads(FIXTURE.read_text())
    policy["tables"]["visits"]["source"] = str(FIXTURE.parent / "visits.csv")
    policy["engine"] = {"threads": 2}
    two = Service(policy, ledger=MemoryLedger(), cache=False)
    threads = two.engine._con.execute("SELECT current_setting('threads')").fetchone()
    assert threads is not None and int(threads[0]) == 2


def test_a_replaced_policy_object_misses() -> None:
    service = _service()
    settings = Settings.from_policy(service.policy)
    for a, _ in VALUES[:2]:
        _via_cache(service, SHAPES[0].format(a=a), settings)
    statement = parse_statement(SHAPES[0].format(a=77), service.policy)
    assert service._shapes.lookup(service, statement, settings, "a") is not None
    service.policy = replace(service.policy)
    assert service._shapes.lookup(service, statement, settings, "a") is None


def test_a_shape_is_verified_on_its_second_statement_and_used_from_its_third() -> None:
    class Counting(Service):
        calls = 0

        def plan(self, query: Any, settings: Settings, analyst: str = "") -> Any:
            self.calls += 1
            return super().plan(query, settings, analyst)

    service = Counting(FIXTURE, ledger=MemoryLedger(), cache=False)
    settings = Settings.from_policy(service.policy)
    counts = []
    for a, _ in VALUES:
        before = service.calls
        _via_cache(service, SHAPES[1].format(a=a), settings)
        counts.append(service.calls - before)
    assert counts == [1, 2, 0, 0]  # seen once: planned; again: planned and verified; then hits


def test_a_shape_with_extra_queries_swaps_their_numbers_too():
    """MEDIAN and COUNT(DISTINCT col) run their own engine queries over the same WHERE: a
    shape hit must put its numbers into those too (not the sentinels, not the first numbers)."""
    from conftest import exact_connect, fixture_policy, rows_of

    cached = exact_connect(fixture_policy())
    fresh = exact_connect(fixture_policy(), plan_cache=0)
    for low in (20, 30, 40, 50, 60):
        sql = (
            f"SELECT MEDIAN(age), MIN(age), COUNT(DISTINCT diagnosis), COUNT(*) FROM visits "
            f"WHERE age > {low}"
        )
        got, want = rows_of(cached, sql), rows_of(fresh, sql)
        assert got[0][1] == want[0][1] > low  # noise off: MIN is the data's
        assert got[0][0] == want[0][0] and got[0][2] == want[0][2]
    assert len(cached.service._shapes) >= 1
    cached.close()
    fresh.close()
