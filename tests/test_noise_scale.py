"""Statistical tests of the released noise, with fixed seeds and stated tolerances.

A GROUP BY over a public domain of 200 bins draws 200 independent noises per query, so ten
queries give 2000 draws of a released COUNT's error (every bin holds 60 rows: far from the
clamp at 0). Seeds are fixed, so each test is deterministic; the tolerances are ~4 standard
errors of the estimate, so a different seed would pass too unless the scale is wrong.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from conftest import table_policy, write_csv

import dpsql
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise

BINS, PER_BIN, QUERIES = 200, 60, 10


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    path = tmp_path_factory.mktemp("noise") / "t.csv"
    rows = [(k, (k * 7 + i) % 11) for k in range(BINS) for i in range(PER_BIN)]
    write_csv(path, ["k", "v"], rows)
    return table_policy(
        path,
        {
            "k": {"type": "int", "lower": 0, "upper": BINS - 1, "nullable": False},
            "v": {"type": "int", "lower": 0, "upper": 10},
        },
        privacy={"budget_delta": 0.9},
    )


def released_errors(policy, sql, settings, seed, exact, queries=QUERIES):
    """Released value minus exact value, over ``queries`` repetitions of ``sql``."""
    conn = dpsql.connect(policy=policy, ledger=MemoryLedger(), noise=SeededNoise(seed), cache=False)
    cur = conn.cursor()
    for s in settings:
        cur.execute(s)
    errors = []
    for _ in range(queries):
        cur.execute(sql)
        errors += [value - exact[key] for key, value in cur.fetchall()]
    conn.close()
    return np.array(errors, dtype=float)


def test_laplace_count_std_is_sqrt2_b(table):
    epsilon = 0.5
    b = 1 / epsilon  # COUNT on a row-level table: L1 = 1
    errors = released_errors(
        table,
        "SELECT k, COUNT(*) FROM t GROUP BY k",
        [f"SET epsilon = {epsilon}"],
        seed=11,
        exact=dict.fromkeys(range(BINS), PER_BIN),
    )
    assert len(errors) == BINS * QUERIES
    assert np.all(errors == np.round(errors))  # integer noise on an integer count
    q = math.exp(-1 / b)
    discrete_std = math.sqrt(2 * q) / (1 - q)  # discrete Laplace; = 2.80 vs sqrt(2) b = 2.83
    assert discrete_std == pytest.approx(math.sqrt(2) * b, rel=0.02)
    # std of 2000 Laplace draws has relative standard error ~2.5%: allow 10%
    assert errors.std() == pytest.approx(discrete_std, rel=0.10)
    assert abs(errors.mean()) < 4 * discrete_std / math.sqrt(len(errors))


def test_gaussian_count_std_is_sigma(table):
    table = copy.deepcopy(table)
    table["privacy"].update(mechanism="gaussian", delta=1e-5, epsilon=0.5)
    conn = dpsql.connect(policy=table, ledger=MemoryLedger())
    cur = conn.cursor()
    cur.execute("EXPLAIN SELECT k, COUNT(*) FROM t GROUP BY k")
    sigma = cur.fetchone()[5]
    conn.close()
    assert 5 < sigma < 15
    errors = released_errors(
        table,
        "SELECT k, COUNT(*) FROM t GROUP BY k",
        [],
        seed=12,
        exact=dict.fromkeys(range(BINS), PER_BIN),
    )
    # the discrete Gaussian's std is sigma to within 1e-6 here; the sample std of 2000 draws
    # has relative standard error ~1.6%: allow 7%
    assert errors.std() == pytest.approx(sigma, rel=0.07)
    assert abs(errors.mean()) < 4 * sigma / math.sqrt(len(errors))


def test_avg_error_shrinks_with_epsilon(table):
    exact = {k: float(np.mean([(k * 7 + i) % 11 for i in range(PER_BIN)])) for k in range(BINS)}
    rmse = {}
    for seed, epsilon in enumerate((0.1, 1.0, 10.0)):
        errors = released_errors(
            table,
            "SELECT k, AVG(v) FROM t GROUP BY k",
            [f"SET epsilon = {epsilon}"],
            seed=20 + seed,
            exact=exact,
            queries=3,
        )
        rmse[epsilon] = float(np.sqrt(np.mean(errors**2)))
    # 10x more epsilon -> ~10x less error, except that AVG is clamped to [0, 10] at eps = 0.1
    assert rmse[0.1] > 3 * rmse[1.0] > 9 * rmse[10.0]
    assert rmse[10.0] < 0.05


def test_threshold_releases_a_single_unit_group_with_probability_at_most_delta(tmp_path):
    """4000 groups held by one unit each: the released fraction estimates P(1 + X >= tau)."""
    n, delta = 4000, 0.1
    rows = [(f"n{i}",) for i in range(n)] + [("common",)] * 200
    path = write_csv(tmp_path / "names.csv", ["name"], rows)
    policy = table_policy(path, {"name": {"type": "text"}}, privacy={"delta": delta})
    conn = dpsql.connect(policy=policy, ledger=MemoryLedger(), noise=SeededNoise(7), cache=False)
    cur = conn.cursor()
    cur.execute("SET partition_selection = 'threshold'")  # the τ-threshold (auto: optimal here)
    cur.execute("EXPLAIN SELECT name, COUNT(*) FROM t GROUP BY name")
    rows = cur.fetchall()
    assert rows[1][1].startswith("units >= tau")  # the threshold row: the units measure
    scale, tau = rows[1][5], float(rows[1][1].split("=")[-1])
    cur.execute("SELECT name, COUNT(*) FROM t GROUP BY name")
    released = dict(cur.fetchall())
    conn.close()
    q = math.exp(-1 / scale)
    p = q ** (tau - 1) / (1 + q)  # exact release probability of a count-1 group
    assert p <= delta
    assert "common" in released
    frac = (len(released) - 1) / n
    se = math.sqrt(p * (1 - p) / n)
    # within 4 standard errors of the exact probability, and so not above delta + 4 se
    assert abs(frac - p) < 4 * se
    assert frac <= delta + 4 * math.sqrt(delta * (1 - delta) / n)
