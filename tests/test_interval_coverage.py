"""Intervals that cover (issue 31 item 4): a fixed-seed simulation of the released intervals.

Each released value's stated 95% interval describes the noise: over fresh noise draws it must
contain the value the query would release without noise (the *bounded* value: after R, G and
the clamps, whose own bias is a separate estimate, dpsql.plan.bias). The plan runs once through
SQL; its exact bounded aggregates are then released REPS times from fixed seeds
(dpsql.privacy.release.release), so the simulation costs the release only.

Tolerance: a 95% interval's coverage over REPS = 300 draws has standard error 0.0126; each
kind's coverage over all its groups must be >= 0.95 − 0.03 (per group, >= 0.95 − 0.065: ~5
standard errors, small groups included). An interval is never zero-width unless its value is
exact (no noise at all).
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
from conftest import table_policy, write_csv

import dpsql
import dpsql.pipeline
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.release import release
from dpsql.privacy.samplers import SeededNoise, ZeroNoise

REPS = 300
LEVEL = 0.95
KIND_SLACK = 0.03  # coverage over all groups of one output: ~3 standard errors of 0.95
GROUP_SLACK = 0.065  # coverage of one group's interval over REPS draws: ~5 standard errors

# group sizes in units: small groups (2-10 units) are where formulas of noisy counts fail
SIZES = {"a": 2, "b": 3, "c": 5, "d": 10, "e": 30, "f": 200}
OUTPUTS = (
    "COUNT(*)",
    "SUM(x)",
    "AVG(x)",
    "VAR_SAMP(x)",
    "STDDEV_SAMP(x)",
    "VAR_POP(x)",
    "STDDEV_POP(x)",
)


def _rows(rows_per_unit: tuple[int, ...], seed: int = 3) -> list[tuple]:
    """Units (uid) with 1..3 rows in one group each; x skewed in [0, 100]; a second key h
    (two public values) that some units span, so G = 1 binds for GROUP BY h."""
    rnd = random.Random(seed)
    out, uid = [], 0
    for g, units in SIZES.items():
        for _ in range(units):
            uid += 1
            for _ in range(rnd.choice(rows_per_unit)):
                x = min(100, int(rnd.expovariate(1 / 25)))
                out.append((uid, g, rnd.choice(["p", "q"]), x))
    return out


def _policy(path, rows: int, groups: int, epsilon: float) -> dict:
    columns = {
        "uid": {"type": "int", "nullable": False},
        "g": {"type": "text", "values": list(SIZES), "nullable": False},
        "h": {"type": "text", "values": ["p", "q"], "nullable": False},
        "x": {"type": "int", "lower": 0, "upper": 100, "nullable": False},
    }
    return table_policy(
        path, columns, unit="uid", rows=rows, groups=groups, privacy={"epsilon": epsilon}
    )


def _captured(conn, sql: str, monkeypatch) -> tuple:
    """The plan and the exact engine result of one run of ``sql`` (charged once)."""
    seen: list[tuple] = []

    def capture(plan, result, source, check=None):
        seen.append((plan, result))
        return release(plan, result, source)

    monkeypatch.setattr(dpsql.pipeline, "release", capture)
    conn.cursor().execute(sql)
    monkeypatch.undo()
    return seen[-1]


def _coverage(plan, result) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per output label: (per-group coverage, per-group share of zero-width intervals, the
    bounded value per group)."""
    truth = release(plan, result, ZeroNoise())
    labels = [o.call.label for o in plan.outputs]
    hits = np.zeros((len(labels), len(truth.key_values)))
    zero = np.zeros_like(hits)
    for seed in range(REPS):
        got = release(plan, result, SeededNoise(1000 + seed))
        assert got.key_values == truth.key_values  # public keys: every group, same order
        for j in range(len(labels)):
            low, high = got.intervals[j][:, 0], got.intervals[j][:, 1]
            value = truth.outputs[j]
            hits[j] += (low - 1e-9 <= value) & (value <= high + 1e-9)
            zero[j] += high - low <= 0
    return {
        label: (hits[j] / REPS, zero[j] / REPS, truth.outputs[j]) for j, label in enumerate(labels)
    }


CASES = {
    # name: (rows per unit in the data, R, G, ε, GROUP BY)
    "one row per unit": ((1,), 1, 1, 1.0, "g"),
    "R binds (1-3 rows, R = 1)": ((1, 2, 3), 1, 1, 1.0, "g"),
    "R = 2, ε = 0.3": ((1, 2, 3), 2, 1, 0.3, "g"),
    "G binds (units span h, G = 1)": ((1, 2, 3), 3, 1, 1.0, "h"),
    "no GROUP BY": ((1, 2), 1, 1, 0.5, None),
}


@pytest.mark.filterwarnings("ignore::dpsql.errors.BudgetWarning")
@pytest.mark.parametrize("case", list(CASES))
def test_intervals_cover_the_bounded_value(case, tmp_path, monkeypatch):
    per_unit, R, G, epsilon, key = CASES[case]
    path = write_csv(tmp_path / "t.csv", ["uid", "g", "h", "x"], _rows(per_unit))
    conn = dpsql.connect(
        policy=_policy(path, R, G, epsilon), ledger=MemoryLedger(), noise=SeededNoise(1)
    )
    select = ", ".join(OUTPUTS)
    sql = f"SELECT {key}, {select} FROM t GROUP BY {key}" if key else f"SELECT {select} FROM t"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan, result = _captured(conn, sql, monkeypatch)
    report = _coverage(plan, result)
    problems = []
    for label, (cover, zero, _) in report.items():
        if cover.mean() < LEVEL - KIND_SLACK or cover.min() < LEVEL - GROUP_SLACK:
            problems.append(f"{label}: coverage {np.round(cover, 3).tolist()}")
        if zero.max() > 0:
            problems.append(f"{label}: zero-width share {np.round(zero, 3).tolist()}")
    assert not problems, f"{case}: " + "; ".join(problems)


@pytest.mark.filterwarnings("ignore::dpsql.errors.BudgetWarning")
def test_lower_levels_keep_the_95_percent_set(tmp_path, monkeypatch):
    """Below 95% an AVG / VAR / STDDEV interval is its 95% confidence set (which covers any
    lower level); scaled down by the linearised error it under-covered small groups."""
    from dpsql.privacy.release import at_confidence

    path = write_csv(tmp_path / "t.csv", ["uid", "g", "h", "x"], _rows((1, 2, 3)))
    conn = dpsql.connect(
        policy=_policy(path, 1, 1, 1.0), ledger=MemoryLedger(), noise=SeededNoise(1)
    )
    sql = "SELECT g, COUNT(*), AVG(x), VAR_POP(x), STDDEV_SAMP(x) FROM t GROUP BY g"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan, result = _captured(conn, sql, monkeypatch)
    got = release(plan, result, SeededNoise(5))
    answer = {
        "outputs": [o.tolist() for o in got.outputs],
        "intervals": [iv.tolist() for iv in got.intervals],
    }
    lower = at_confidence(plan, answer, 0.8)
    assert lower["intervals"][1:] == answer["intervals"][1:]
    count = np.asarray(lower["intervals"][0])  # a count's own noise: narrower at 80%
    assert np.all(count[:, 1] - count[:, 0] < got.intervals[0][:, 1] - got.intervals[0][:, 0])
