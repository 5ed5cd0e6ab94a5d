"""Exact counts under ``bounding = "scale"`` (issue 31 item 3): a count's rescaled shares are
rounded per unit to integers (dpsql.sql.plan, ROUNDED_KINDS: the proof), so the count is
released with integer noise at the discrete optimum, whichever units the bounds rescaled.

- the public-key histogram of educ on the PUMS fixture (R = G = 1, 627 units over 1,000 rows:
  units over R and over G) at ε = 1 with the default settings: the count is an integer
  measure (scale 1) and its released error, against the exact bounded answer, is within 2% of
  the discrete Laplace optimum 2p / (1 − p²) at the mechanism's own scale (p = e^(−1/b));
  before, on the 2^20 grid (a rounded continuous Laplace), it was ~10% above;
- a rounding that rounds every share up (per pair, not systematically) breaks the L1 bound,
  and the neighbour check of tests/test_rescaled_bounding.py catches it.
"""

from __future__ import annotations

import csv
import math
import tomllib
from pathlib import Path

import numpy as np
from conftest import exact_connect

import dpsql
from dpsql.pipeline import Settings
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise
from dpsql.sql.bind import parse_statement

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
