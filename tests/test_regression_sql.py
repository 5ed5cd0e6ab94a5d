"""dp_linear_regression / dp_logistic_regression through the SQL pipeline."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import dpsql
from dpsql.boundary import ChargedFailure
from dpsql.dbapi import connect_service
from dpsql.errors import Error
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "visits.toml"
LINEAR = (
    "SELECT * FROM dp_linear_regression('visits', label => 'cost', "
    "features => ['age', 'smoker', 'department'], epsilon => 1.0)"
)
LOGISTIC = (
    "SELECT * FROM dp_logistic_regression('visits', label => 'smoker', "
    "features => ['age', 'department'], epsilon => 1.0, steps => 200, sample_rate => 0.02)"
)


@pytest.fixture(scope="module")
def service():
    svc = dpsql.Service(FIXTURE, ledger=MemoryLedger(), noise=SeededNoise(3))
    yield svc
    svc.close()


def spent(service, analyst):
    return service.ledger.spent(analyst, service.policy.dataset)


@pytest.mark.parametrize(
    "query", [LINEAR, LOGISTIC, LINEAR.replace("1.0)", "1.0, method => 'dpsgd')")]
)
def test_charges_once_then_replays_from_the_cache(service, query):
    analyst = f"reg-{abs(hash(query)) % 10_000}"
    cur = connect_service(service, analyst).cursor()
    cur.execute(query)
    rows = cur.fetchall()
    assert [d[0] for d in cur.description] == [
        "position",
        "feature",
        "coefficient",
        "ci_low",
        "ci_high",
    ]
    assert rows[0][1] == "(intercept)" and [r[0] for r in rows] == list(range(len(rows)))
    assert "department = 'dermatology'" in [r[1] for r in rows]  # first value is the reference
    assert cur.cost.epsilon == pytest.approx(1.0) and cur.cost.delta == pytest.approx(1e-6)
    before = spent(service, analyst)
    assert before.epsilon == pytest.approx(1.0)
    cur.execute(
        query.replace("SELECT *", "SELECT feature, coefficient")
        + " WHERE feature <> '(intercept)' ORDER BY position DESC"
    )
    again = cur.fetchall()
    assert cur.cached and cur.cost is None and spent(service, analyst) == before
    assert [r[1] for r in again] == [r[2] for r in reversed(rows[1:])]


def test_sufficient_statistics_give_intervals_dpsgd_does_not(service):
    cur = connect_service(service, "reg-intervals").cursor()
    cur.execute(LINEAR)
    for _, _, c, low, high in cur.fetchall():
        assert low <= high and c == c  # the point estimate need not lie inside a bootstrap interval
    cur.execute(LOGISTIC)
    assert all(r[3] is None and r[4] is None for r in cur.fetchall())


def test_explain_shows_the_mechanism_and_spends_nothing(service):
    cur = connect_service(service, "reg-explain").cursor()
    cur.execute("EXPLAIN " + LOGISTIC)
    total, *rows = cur.fetchall()
    text = rows[1][1]
    for part in ("steps 200", "sample rate q 0.02", "clip C 1", "noise multiplier z", "sigma"):
        assert part in text
    assert sum(r[6] for r in rows) == pytest.approx(1.0)  # epsilon column sums to the charge
    assert max(r[7] for r in rows) == pytest.approx(1e-6)
    # the total row, as a query's EXPLAIN has one: the charge of both measurements
    assert total[0] == "total" and total[6] == pytest.approx(1.0) and total[7] == 1e-6
    cur.execute("EXPLAIN " + LINEAR)
    (row,) = cur.fetchall()
    assert row[2] == "discrete_gaussian" and row[6] == pytest.approx(1.0) and row[4] > 0
    assert spent(service, "reg-explain").is_zero


def test_rows_bounded_per_unit_by_keyed_hash(service, monkeypatch):
    seen = {}
    original = service.engine.fetch_matrix

    def spy(query, handle=None):
        seen["sql"] = query.sql(dialect="duckdb")  # a tree: the engine renders it
        return original(query, handle)

    monkeypatch.setattr(service.engine, "fetch_matrix", spy)
    connect_service(service, "reg-bound").cursor().execute(LINEAR.replace("1.0)", "0.5)"))
    sql = seen["sql"]
    assert "RANDOM" not in sql.upper()
    assert re.search(r'PARTITION BY "patient_id" ORDER BY DP_KEYED_HASH\(.*\)\) <= 5', sql)


def test_delta_zero_is_a_free_refusal_with_a_hint(service):
    conn = connect_service(service, "reg-delta")
    cur = conn.cursor()
    cur.execute("SET delta = 0")
    with pytest.raises(Error) as info:
        cur.execute(LOGISTIC)
    assert info.value.sqlstate == "42501" and "delta" in info.value.hint
    # Pure epsilon remains available: sufficient statistics with Laplace noise.
    cur.execute(LINEAR.replace("1.0)", "1.0, noise => 'laplace')"))
    assert cur.cost.delta == 0 and cur.cost.epsilon == pytest.approx(1.0)
    assert spent(service, "reg-delta").delta == 0


def test_budget_without_delta_refuses_before_charging(tmp_path):
    text = FIXTURE.read_text().replace("budget_delta = 1e-5", "budget_delta = 0.0")
    text = text.replace('source = "visits.csv"', f'source = "{FIXTURE.parent / "visits.csv"}"')
    policy = tmp_path / "visits.toml"
    policy.write_text(text)
    try:
        svc = dpsql.Service(policy, ledger=MemoryLedger(), noise=SeededNoise(0))
    except Error:
        pytest.skip("this policy loader refuses a zero delta budget outright")
    try:
        cur = connect_service(svc, "reg-nodelta").cursor()
        with pytest.raises(Error) as info:
            cur.execute(LINEAR)
        assert info.value.sqlstate in ("42501", "53400") and "delta" in str(info.value)
        assert svc.ledger.spent("reg-nodelta", svc.policy.dataset).is_zero
    finally:
        svc.close()


@pytest.mark.parametrize(
    "query, sqlstate",
    [
        (LINEAR.replace("epsilon => 1.0", "epsilon => 1.0, nope => 1"), "42883"),
        (LINEAR.replace("'cost'", "'missing'"), "42703"),
        (LINEAR.replace("'cost'", "'diagnosis'"), "42501"),  # no declared bounds
        (LINEAR.replace("'department'", "'diagnosis'"), "42501"),  # feature without a domain
        (LINEAR.replace("epsilon => 1.0", "epsilon => 'x'"), "42804"),
        (LINEAR.replace("epsilon => 1.0", "epsilon => 1.0, steps => 2.5"), "42804"),
        (LOGISTIC.replace("sample_rate => 0.02", "sample_rate => 2"), "22023"),
        (LOGISTIC.replace("steps => 200", "method => 'sufficient_stats'"), "22023"),
        (LOGISTIC.replace("'smoker'", "'department'"), "22023"),  # needs positive =>
        (LOGISTIC.replace("'smoker',", "'department', positive => 'nope',"), "22023"),
        (LOGISTIC.replace("'smoker',", "'smoker', positive => 'yes',"), "42804"),
        (LINEAR.replace("epsilon => 1.0", "epsilon => -1"), "22023"),
        # Calibration that cannot succeed ends (and is free): found hanging before the floor.
        (LINEAR.replace("epsilon => 1.0", "epsilon => 1e-300"), "22023"),
        (LINEAR.replace("1.0)", "1e-300, noise => 'laplace')"), "22023"),
        (LOGISTIC.replace("epsilon => 1.0", "epsilon => 1e-300"), "22023"),
    ],
)
def test_refusals_are_free(service, query, sqlstate):
    cur = connect_service(service, "reg-refused").cursor()
    with pytest.raises(Error) as info:
        cur.execute(query)
    assert info.value.sqlstate == sqlstate, info.value
    assert info.value.hint is not None
    assert spent(service, "reg-refused").is_zero


def test_logistic_with_a_declared_value_as_positive(service):
    cur = connect_service(service, "reg-positive").cursor()
    cur.execute(
        "SELECT feature FROM dp_logistic_regression('visits', label => 'department', "
        "positive => 'pediatrics', features => ['age', 'smoker'], steps => 100)"
    )
    assert [r[0] for r in cur.fetchall()] == ["(intercept)", "age", "smoker"]


def test_failure_after_the_read_is_charged_and_uniform(service, monkeypatch):
    def boom(sql, handle=None):
        raise RuntimeError("engine exploded on some private value 42")

    monkeypatch.setattr(service.engine, "fetch_matrix", boom)
    cur = connect_service(service, "reg-boom").cursor()
    with pytest.raises(ChargedFailure) as info:
        cur.execute(LINEAR.replace("1.0)", "0.25)"))
    assert "42" not in str(info.value)
    assert spent(service, "reg-boom").epsilon == pytest.approx(0.25)


def test_model_is_stored_and_applies_in_sql(service):
    import duckdb
    import sqlglot

    from dpsql.models.predict import PREDICTORS, expand_predictions
    from dpsql.models.store import ModelStore

    assert {"linear_regression", "logistic_regression"} <= set(PREDICTORS)
    cur = connect_service(service, "reg-model").cursor()
    cur.execute(LINEAR.replace("1.0)", "1.0, model => 'cost_v1')"))
    coefficients = {r[1]: r[2] for r in cur.fetchall()}
    charged = spent(service, "reg-model")
    cur.execute(LINEAR.replace("1.0)", "1.0, model => 'cost_v2')"))  # same fit, named again
    assert cur.cached and spent(service, "reg-model") == charged
    store = ModelStore.for_ledger(service.ledger)
    stored = store.get("reg-model", service.policy.dataset, "cost_v1")
    assert stored.kind == "linear_regression" and stored.epsilon == pytest.approx(1.0)
    assert store.get("reg-model", service.policy.dataset, "cost_v2") is not None
    tree = sqlglot.parse_one("SELECT dp_predict('cost_v1') AS p FROM visits", read="duckdb")
    sql = expand_predictions(tree, store.lookup("reg-model", service.policy.dataset)).sql("duckdb")
    con = duckdb.connect()
    con.execute(f"CREATE TABLE visits AS SELECT * FROM read_csv('{FIXTURE.parent / 'visits.csv'}')")
    got = con.execute(sql + " LIMIT 1").fetchone()[0]
    row = con.execute("SELECT age, smoker, department FROM visits LIMIT 1").fetchone()
    age, smoker, department = row
    want = coefficients["(intercept)"] + coefficients["age"] * age
    want += coefficients["smoker"] * smoker + coefficients.get(f"department = '{department}'", 0)
    assert got == pytest.approx(want)


def test_model_name_is_checked_for_free(service):
    cur = connect_service(service, "reg-badname").cursor()
    with pytest.raises(Error) as info:
        cur.execute(LINEAR.replace("1.0)", "1.0, model => '1 bad name')"))
    assert info.value.sqlstate == "42602"
    assert spent(service, "reg-badname").is_zero


@pytest.mark.parametrize("method", ["dpsgd", "sufficient_stats"])
def test_no_rows_still_release_finite_coefficients(method):
    """An empty (bounded) row set is a release like any other: finite, in the weight box."""
    import numpy as np

    from dpsql.models.regression_function import plan_regression, release_regression
    from dpsql.policy import load_policy

    table = load_policy(FIXTURE).tables["visits"]
    plan = plan_regression(
        "dp_linear_regression", table, label="cost", features=["age", "smoker"], delta=1e-6,
        method=method,
    )  # fmt: skip
    out = release_regression(plan, np.zeros((0, 0), dtype=np.int64), SeededNoise(0))
    assert len(out["rows"]) == 3 and all(np.isfinite(r[2]) for r in out["rows"])
