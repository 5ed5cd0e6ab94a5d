"""Exact counts under ``bounding = "scale"`` (issue 31 item 3): a count's rescaled shares are
rounded per unit to integers (dpsql.plan.values, ROUNDED_KINDS: the proof), so the count is
released with integer noise at the discrete optimum, whichever units the bounds rescaled.

- the public-key histogram of educ on the PUMS fixture (R = G = 1, 627 units over 1,000 rows:
  units over R and over G) at ε = 1 with the default settings: the count is an integer
  measure (scale 1) and its released error, against the exact bounded answer, is within 2% of
  the discrete Laplace optimum 2p / (1 − p²) at the mechanism's own scale (p = e^(−1/b));
  before, on the 2^20 grid (a rounded continuous Laplace), it was ~10% above;
- removing a unit over R and G moves each rounded count (COUNT(*), COUNT(col), COUNT(DISTINCT
  unit)) by at most its per-group bound, L1 and L2, in the column programs and the SQL, for
  the engine's offsets and for any constant offset (the proof does not use its value);
- a rounding that rounds every share up (per pair, not along the unit's running sum) breaks
  the L1 bound, and that neighbour check catches it.
"""

from __future__ import annotations

import csv
import math
import tomllib
from pathlib import Path

import numpy as np
import pytest
import sqlglot
from conftest import exact_connect
from sqlglot import exp

import dpsql
from dpsql.frontend.bind import parse_statement
from dpsql.pipeline import Settings
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SQL = "SELECT educ, COUNT(*) FROM PUMS GROUP BY educ"
REPS = 400  # x 16 cells: ~3 s of CPU


def _pums_policy() -> dict:
    """fixtures/pums_sample.toml as shipped, with educ's values declared (public keys)."""
    policy = tomllib.loads((FIXTURES / "pums_sample.toml").read_text())
    policy["tables"]["PUMS"]["source"] = str(FIXTURES / "pums_sample.csv")
    policy["privacy"].update(budget_epsilon=1e9, budget_delta=0.5)  # repetitions
    with open(FIXTURES / "pums_sample.csv", newline="") as fh:
        educ = sorted({row["educ"] for row in csv.DictReader(fh)}, key=int)
    policy["tables"]["PUMS"]["columns"]["educ"] = {
        "type": "text",
        "values": educ,
        "nullable": False,
    }
    return policy


def _discrete_laplace_mae(scale: float) -> float:
    """E|X| of the discrete Laplace P(X = k) ∝ p^|k|, p = e^(−1/scale): 2p / (1 − p²)."""
    p = math.exp(-1.0 / scale)
    return 2 * p / (1 - p * p)


def test_public_key_histogram_is_at_the_discrete_optimum():
    policy = _pums_policy()
    exact = exact_connect(policy)
    try:
        cur = exact.cursor()
        cur.execute(SQL)
        truth = {r[0]: r[1] for r in cur.fetchall()}
        service = exact.service
        plan = service.plan(
            parse_statement(SQL, service.policy), Settings.from_policy(service.policy)
        )
    finally:
        exact.close()
    assert plan.bounding == "scale" and plan.group_scaling  # 16 public bins, G = 1
    (count,) = [m for m in plan.measures if m.kind == "rows"]
    # an integer count: shares on 2^20, rounded per unit; its noise in rows
    assert (count.scale, count.fine, count.l1) == (1, 2**20, 1.0)
    assert all(float(v).is_integer() for v in truth.values()) and len(truth) == 16
    optimum = _discrete_laplace_mae(count.mechanism.scale)

    conn = dpsql.connect(policy=policy, ledger=MemoryLedger(), noise=SeededNoise(7), cache=False)
    errors = []
    try:
        cur = conn.cursor()
        for _ in range(REPS):
            cur.execute(SQL)
            errors += [value - truth[key] for key, value in cur.fetchall()]
    finally:
        conn.close()
    e = np.array(errors, dtype=float)
    assert np.all(e == np.round(e))  # integer noise on integer counts
    mae = float(np.mean(np.abs(e)))
    # 6,400 cells: the mean's standard error is ~0.015 (sd of |X| ~1.17 at the count's ε 0.9,
    # the default bias estimate having a tenth); the rounded continuous Laplace of the 2^20
    # grid is ~9% above the optimum, 6 standard errors: within 2% (plus 2 standard errors)
    se = float(np.std(np.abs(e))) / math.sqrt(len(e))
    assert abs(mae - optimum) <= 0.02 * optimum + 2 * se, (mae, optimum, se)
    # the discrete Laplace's own mark: P(X = 0) = (1 − p) / (1 + p) (0.422 here; a rounded
    # continuous Laplace of that scale gives 1 − e^(−1/(2b)) = 0.362, 10 standard errors off)
    p = math.exp(-1.0 / count.mechanism.scale)
    zero = float(np.mean(e == 0))
    assert abs(zero - (1 - p) / (1 + p)) <= 4 * math.sqrt(zero * (1 - zero) / len(e)), zero


# -- neighbouring datasets: the rounded counts keep sampling's sensitivities ----------------

R, G = 2, 1
DEPTS = ["a", "b", "c"]
COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "dept": {"type": "text", "values": DEPTS, "nullable": False},
    "age": {"type": "int", "lower": 0, "upper": 90},  # nullable: COUNT(age) rescaled by R/n
}
COUNTS = "SELECT dept, COUNT(*), COUNT(age), COUNT(DISTINCT uid) FROM t GROUP BY dept"
# units over R and over G whose shares are fractions (R·G/k = 2/3 rows in each of 3 depts,
# 1/2 in each of 2, COUNT(age) at 2/3 of 3 rows with 2 ages): rounded each up on its own,
# their counts would move by 3 > G·R = 2 rows
HEAVY = {
    999: [(d, 40) for d in DEPTS for _ in range(5)],
    998: [("a", 1), ("b", 2)],
    997: [("a", 3), ("a", None), ("a", 5)],
    996: [("a", None), ("b", None), ("c", 7), ("c", 8), ("c", 9)],
    995: [(d, None) for d in DEPTS],
}


def _unit_rows() -> list[tuple]:
    rnd = np.random.default_rng(5)
    rows = [
        (uid, DEPTS[int(rnd.integers(3))], int(rnd.integers(0, 90)))
        for uid in range(1, 41)
        for _ in range(int(rnd.integers(1, 4)))
    ]
    rows += [(uid, d, a) for uid, held in HEAVY.items() for d, a in held]
    return rows


def _measures(conn, sql: str) -> tuple:
    """(plan, {dept: [exact measures]}) as the engine computes them (bias measures off)."""
    from dpsql.lower.compile import compile_plan

    service = conn.service
    settings = Settings.from_policy(service.policy)
    settings.bias_estimate = "off"
    plan = service.plan(parse_statement(sql, service.policy), settings)
    result = service.engine.execute(compile_plan(plan, 3))
    got = {k[0]: [int(m[i] or 0) for m in result.measures] for i, k in enumerate(result.key_rows)}
    return plan, got


def _check_neighbours(conn) -> list[tuple[int, int]]:
    """Remove each heavy unit (a WHERE that drops its rows: the pairs are formed after the
    WHERE, so the other units' pairs are those of the neighbouring dataset): every count
    moves by at most its per-group bound, its L1 and its L2. Returns per measure the largest
    (per-group, L1) move seen."""
    plan, full = _measures(conn, COUNTS)
    assert plan.group_scaling and all(m.fine == 2**20 and m.scale == 1 for m in plan.measures)
    worst = [(0, 0)] * len(plan.measures)
    for uid in HEAVY:
        _, less = _measures(conn, COUNTS.replace("GROUP BY", f"WHERE uid <> {uid} GROUP BY"))
        for j, m in enumerate(plan.measures):
            moves = [abs(full[k][j] - less.get(k, [0] * len(plan.measures))[j]) for k in full]
            assert max(moves) <= m.per_group_bound, (uid, m.kind, moves)
            assert sum(moves) <= m.l1, (uid, m.kind, moves)
            assert math.sqrt(sum(x * x for x in moves)) <= m.l2 + 1e-9, (uid, m.kind, moves)
            worst[j] = (max(worst[j][0], max(moves)), max(worst[j][1], sum(moves)))
    return worst


def _unit_connect(tmp_path: Path, small_tables: str):
    from conftest import table_policy, write_csv

    path = write_csv(tmp_path / "t.csv", list(COLUMNS), _unit_rows())
    policy = table_policy(path, COLUMNS, unit="uid", rows=R, groups=G)
    policy["engine"] = {"small_tables": small_tables}
    return exact_connect(policy)


@pytest.mark.parametrize("small_tables", ["columns", "sql"])
def test_rounded_counts_keep_the_sampled_sensitivities(tmp_path, small_tables):
    conn = _unit_connect(tmp_path, small_tables)
    try:
        worst = _check_neighbours(conn)
    finally:
        conn.close()
    assert worst[0] == (R, G * R)  # unit 999 reaches the bound (2 of its 3 depts get a row)


@pytest.mark.parametrize("offset", [0, 1, 2**19, 2**20 - 1])
def test_the_bounds_hold_for_every_offset(tmp_path, monkeypatch, offset):
    """The proof does not use the offset's value: the most and least rounding up pass too."""
    from dpsql.lower import bounding

    monkeypatch.setattr(bounding, "unit_offset", lambda plan, grid: exp.Literal.number(offset))
    conn = _unit_connect(tmp_path, "sql")
    try:
        _check_neighbours(conn)
    finally:
        conn.close()


def test_rounding_each_share_up_on_its_own_is_caught(tmp_path, monkeypatch):
    """The deliberately broken rounding: each pair's share rounded up by itself (not along
    the unit's running sum). A unit with 2/3 of a row in each of 3 depts then counts 3 rows,
    over G·R = 2: the neighbour check must fail on it (else it could not catch a real one)."""
    from dpsql.lower import bounding

    def ceiling(plan, ks, source):
        rounded = dict(bounding.rounded_columns(plan))
        items = [
            f"({c} + {rounded[c] - 1}) // {rounded[c]} AS {c}" if c in rounded else c
            for c in bounding.pair_columns(plan, ks)
        ]
        return sqlglot.parse_one(f"SELECT {', '.join(items)} FROM {source}", read="duckdb")

    monkeypatch.setattr(bounding, "rounded_counts", ceiling)
    conn = _unit_connect(tmp_path, "sql")
    try:
        with pytest.raises(AssertionError):
            _check_neighbours(conn)
    finally:
        conn.close()
