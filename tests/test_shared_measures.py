"""Shared and optimised measures (issue 17 item 3): one noisy count for COUNT(*), COUNT of a
non-null column, the AVG/VAR denominators and (R = 1) the unit count; the ε split
ε_i ∝ C_i^(1/3) (dpsql.plan.sharing, derived in docs/mechanisms.md)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from conftest import table_policy, write_csv

import dpsql
from dpsql.frontend.bind import parse_statement
from dpsql.plan import sharing
from dpsql.plan.check import check_plan
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise, ZeroNoise
from dpsql.service.settings import Settings

# clip "declared": the measures share the query's whole ε at the declared bounds (unstated, a
# SUM/AVG's clamp range is bought first, an entry of its own: tests/test_default_clamp.py)
COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "grp": {"type": "text", "values": ["a", "b"], "nullable": False},
    "age": {"type": "int", "lower": 0, "upper": 100, "nullable": False, "clip": "declared"},
    "cost": {"type": "float", "lower": 0.0, "upper": 1000.0, "clip": "declared"},  # nullable
}


def _data(path, null_age=False):
    rows = [
        (i, "ab"[i % 2], "" if null_age and i == 0 else 20 + i % 50, "" if i % 7 == 0 else i % 900)
        for i in range(400)
    ]
    return write_csv(path, ["uid", "grp", "age", "cost"], rows)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return _data(tmp_path_factory.mktemp("shared") / "t.csv")


def _connect(path, rows=1, noise=None, unit="uid"):
    policy = table_policy(path, COLUMNS, unit=unit, rows=rows, groups=2)
    return dpsql.connect(
        policy=policy, ledger=MemoryLedger(), noise=noise or SeededNoise(1), cache=False
    )


def _plan(conn, sql, epsilon=1.0, delta=1e-6, mechanism="laplace", mode="auto"):
    service = conn._service
    settings = Settings(epsilon, delta, mechanism, partition_selection=mode)
    return service.plan(parse_statement(sql, service.policy), settings)


def _kinds(plan):
    return [(m.kind, m.column) for m in plan.measures]


def test_count_of_a_non_null_column_is_count_star(table):
    conn = _connect(table, rows=3)
    plan = _plan(conn, "SELECT COUNT(*), COUNT(age) FROM t")
    assert _kinds(plan) == [("rows", None)]
    assert plan.outputs[0].measures == plan.outputs[1].measures
    assert plan.cost.epsilon == pytest.approx(1.0)  # the whole ε on the one count
    # a nullable column keeps its own count
    assert _kinds(_plan(conn, "SELECT COUNT(*), COUNT(cost) FROM t")) == [
        ("rows", None),
        ("values", "cost"),
    ]


def test_avg_and_var_denominators_share_count_star(table):
    conn = _connect(table, rows=3)
    plan = _plan(conn, "SELECT COUNT(*), AVG(age), VAR_SAMP(age) FROM t")
    assert _kinds(plan) == [("rows", None), ("sum", "age"), ("sumsq", "age")]
    total = plan.measure(plan.outputs[1].measures[0])
    assert total.center == 50 and total.count == plan.outputs[0].measures[0]
    # SUM of a non-null column is centred on its range when COUNT(*) is measured anyway
    centred = _plan(conn, "SELECT COUNT(*), SUM(age) FROM t")
    assert (
        centred.measure("m1").center == 50
        and centred.measure("m1").l1 == 3 * 50 * centred.measure("m1").scale
    )  # R · h (G = 1)


def test_r1_row_count_is_the_unit_count(table):
    conn = _connect(table, rows=1)
    plan = _plan(conn, "SELECT COUNT(*), COUNT(DISTINCT uid), AVG(age) FROM t")
    assert _kinds(plan) == [("units", None), ("sum", "age")]
    # with R > 1 the row count and the unit count differ: two measures
    conn3 = _connect(table, rows=3)
    plan3 = _plan(conn3, "SELECT COUNT(*), COUNT(DISTINCT uid) FROM t")
    assert _kinds(plan3) == [("rows", None), ("units", None)]


def test_threshold_unit_count_serves_count_distinct(table):
    conn = _connect(table, rows=3)
    sql = "SELECT cost, COUNT(DISTINCT uid) FROM t GROUP BY cost"
    plan = _plan(conn, sql, mode="threshold")
    assert _kinds(plan) == [("units", None)]
    assert plan.outputs[0].measures == (plan.threshold.measure,)


def test_split_minimises_the_summed_variance():
    w = [1.0, 8.0, 27.0]
    shares = sharing.split(3.0, w)
    assert shares == pytest.approx([0.5, 1.0, 1.5])  # ∝ C^(1/3) = 1, 2, 3
    assert sum(Fraction(s) for s in shares) <= 3
    # against random perturbations that keep the total: never a smaller objective
    rng = np.random.default_rng(0)
    best = sum(c / e**2 for c, e in zip(w, shares, strict=True))
    for _ in range(200):
        x = np.array(shares) * np.exp(rng.normal(0, 0.2, 3))
        x *= 3.0 / x.sum()
        assert sum(c / e**2 for c, e in zip(w, x, strict=True)) >= best * (1 - 1e-12)
    assert sharing.split(1.0, [2.0, 2.0]) == [0.5, 0.5]  # equal weights: ε/k exactly


def test_avg_alone_is_split_equally_and_a_shared_count_gets_more(table):
    conn = _connect(table, rows=3)
    avg = _plan(conn, "SELECT AVG(age) FROM t")
    assert [m.epsilon for m in avg.measures] == [0.5, 0.5]  # the minimax split
    both = _plan(conn, "SELECT COUNT(*), AVG(age) FROM t")
    count, total = both.measure("m0"), both.measure("m1")
    # C_count = (R·1)² + (R·h/M)², C_sum = (R·h/M)², h/M = 50/100
    c_count, c_sum = 9 * (1 + 0.25), 9 * 0.25
    assert count.epsilon / total.epsilon == pytest.approx((c_count / c_sum) ** (1 / 3))
    assert count.epsilon + total.epsilon == pytest.approx(1.0)


def test_budget_charged_equals_plan_cost_and_the_ir_check_passes(table):
    for sql in (
        "SELECT COUNT(*), COUNT(age), AVG(age), STDDEV(age), SUM(cost) FROM t",
        "SELECT grp, COUNT(*), AVG(cost) FROM t GROUP BY grp",
    ):
        for mechanism in ("laplace", "gaussian"):
            ledger = MemoryLedger()
            policy = table_policy(table, COLUMNS, unit="uid", rows=2, groups=2)
            conn = dpsql.connect(policy=policy, ledger=ledger, noise=SeededNoise(2), cache=False)
            cur = conn.cursor()
            cur.execute(f"SET mechanism = '{mechanism}'")
            plan = _plan(conn, sql, mechanism=mechanism)
            cur.execute("SET bias_estimate = off")  # _plan's settings (with it: test_bias.py)
            check_plan(plan)
            cur.execute(sql)
            assert ledger.spent(conn.analyst, conn._service.policy.dataset) == plan.cost


def test_a_null_in_a_non_null_column_is_counted_as_a_row(tmp_path):
    """The policy's declaration decides: COUNT(age) of a nullable = false column is COUNT(*),
    also on data that violates it (no error, no data-dependent branch)."""
    path = _data(tmp_path / "t.csv", null_age=True)
    conn = _connect(path, rows=1, noise=ZeroNoise())
    cur = conn.cursor()
    cur.execute("SELECT COUNT(*), COUNT(age), COUNT(cost) FROM t")
    n, n_age, n_cost = cur.fetchone()
    assert n == n_age == 400 and n_cost == 400 - len(range(0, 400, 7))


def test_count_noise_has_the_scale_of_its_share(tmp_path):
    """One noisy count for COUNT(*) and COUNT(age): 4000 draws (a public domain of 400 bins,
    10 queries) have the variance of discrete Laplace at the whole ε (4 standard errors)."""
    bins = 400
    rows = [(i, i % bins, 30) for i in range(bins * 20)]
    path = write_csv(tmp_path / "t.csv", ["uid", "k", "age"], rows)
    columns = {
        "uid": {"type": "int", "nullable": False},
        "k": {"type": "int", "lower": 0, "upper": bins - 1, "nullable": False},
        "age": {"type": "int", "lower": 0, "upper": 100, "nullable": False},
    }
    policy = table_policy(path, columns, unit="uid")
    conn = dpsql.connect(policy=policy, ledger=MemoryLedger(), noise=SeededNoise(8), cache=False)
    cur = conn.cursor()
    cur.execute("SET bias_estimate = off")  # the whole ε on the count
    errors = []
    for _ in range(10):
        cur.execute("SELECT k, COUNT(*), COUNT(age) FROM t GROUP BY k")
        got = cur.fetchall()
        assert all(r[1] == r[2] for r in got)  # one measure
        errors += [r[1] - 20 for r in got]
    b = 1.0  # L1 1 at ε = 1: the discrete Laplace variance is 2q/(1−q)², q = e^(−1/b)
    q = math.exp(-1 / b)
    var = 2 * q / (1 - q) ** 2
    assert np.var(errors) == pytest.approx(var, rel=4 * math.sqrt(2 / len(errors)) * 2.5)


def test_explain_shows_the_split_and_the_shared_count(table):
    conn = _connect(table, rows=3)
    cur = conn.cursor()
    cur.execute("SET bias_estimate = off")  # the answer's measures only (m0, m1)
    cur.execute("EXPLAIN (FORMAT TEXT) SELECT COUNT(*), COUNT(age), AVG(age) FROM t")
    text = "\n".join(r[0] for r in cur.fetchall())
    assert "ε split" in text and "ε_i ∝ C_i^(1/3)" in text
    assert text.count("count of rows: laplace noise") == 3  # the one count, under each output
    assert "Measure m1" in text and "Measure m2" not in text
