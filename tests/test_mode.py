"""MODE(col) over a public domain (dpsql.aggregates.mode): report-noisy-max per group.

- the right answer at a high ε, with and without GROUP BY (fixed seed);
- a privacy audit on neighbouring datasets D and D' = D + one worst-case unit, through the
  pipeline: the engine's bin counts of both, the mechanism's exact output distributions on
  them (their largest log-ratio stays within the ε the plan charges, and a mechanism
  calibrated to half the sensitivity would exceed it), and the sampler's frequencies over
  seeded releases agree with those distributions;
- the ε is charged once with the query's other aggregates (one reservation);
- refusals (no public domain, an expression): their SQLSTATE, message, position and hint,
  before any data is read and without spending.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import fixture_policy, rows_of, table_policy, write_csv
from recording import RecordingService
from scipy import stats

import dpsql
from dpsql.dbapi import connect_service
from dpsql.errors import PrivacyError
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.quantiles import noisy_max_probabilities, report_noisy_max
from dpsql.privacy.release import release
from dpsql.privacy.samplers import SeededNoise, ZeroNoise

DOMAIN = ["a", "b", "c", "d"]
R = 2
COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "v": {"type": "text", "values": DOMAIN, "nullable": False},
    "k": {"type": "text", "values": ["x", "y"], "nullable": False},
    "name": {"type": "text"},  # no public domain
    # clip "declared": AVG(w) beside MODE in one reservation (unstated, a clamp range would be
    # bought first as an entry of its own: tests/test_default_clamp.py)
    "w": {"type": "float", "lower": 0.0, "upper": 1.0, "clip": "declared"},
}


def rows_d() -> list[tuple[Any, ...]]:
    """20 units of 1-2 rows (within R): value a for 8 units, b 6, c 4, d 2."""
    values = ["a"] * 8 + ["b"] * 6 + ["c"] * 4 + ["d"] * 2
    return [
        (u, v, "xy"[u % 2], f"n{u}", 0.5) for u, v in enumerate(values) for _ in range(1 + u % 2)
    ]


# the worst case for the neighbour: more rows than R, all of the runner-up value
EXTRA = [(999, "b", "x", "n999", 0.5)] * (R + 1)


def _policy(path: Path, **privacy: Any) -> dict:
    return table_policy(path, COLUMNS, unit="uid", rows=R, groups=1, privacy=privacy)


def _recorded(path: Path, sql: str) -> tuple[Any, Any, list]:
    service = RecordingService(
        _policy(path), ledger=MemoryLedger(), noise=SeededNoise(3), cache=False
    )
    rows = connect_service(service, "a").cursor().execute(sql).fetchall()
    service.close()
    return service.plans[-1], service.results[-1], rows


def _counts(plan: Any, result: Any) -> np.ndarray:
    """The one group's bin counts, from the engine's extra query (dpsql.lower.compile)."""
    (qm,) = plan.quantiles
    counts = np.zeros(qm.bins, dtype=np.int64)
    for row, c in zip(result.extras[0].key_rows, result.extras[0].measures[0], strict=True):
        counts[int(row[-1])] += int(c)
    return counts


def test_mode_at_high_epsilon_is_the_exact_mode(monkeypatch):
    # One secret for both services: a unit over R keeps R rows chosen by a keyed hash, so two
    # runs with different secrets count different bounded rows, and close departments can
    # swap places; the subject here is the release of one run's bounded counts
    import secrets

    monkeypatch.setattr(secrets, "randbits", lambda bits: 0x5EC12E7 % (1 << bits))
    service = dpsql.Service(
        fixture_policy(privacy={"budget_epsilon": 1e6}),
        ledger=MemoryLedger(),
        noise=SeededNoise(11),
        cache=False,
    )
    exact = dpsql.Service(fixture_policy(), ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
    noisy, truth = connect_service(service, "a"), connect_service(exact, "a")
    noisy.cursor().execute("SET epsilon = 200")
    for sql in (
        "SELECT MODE(department) FROM visits",
        "SELECT smoker, MODE(department) AS m FROM visits GROUP BY smoker ORDER BY 1",
        "SELECT MODE(smoker), COUNT(*) FROM visits",
    ):
        got, want = rows_of(noisy, sql), rows_of(truth, sql)
        assert [r[:2] for r in got] == [r[:2] for r in want]
        assert isinstance(got[0][0], type(want[0][0]))  # a domain value, typed as the column
    service.close()
    exact.close()


def test_mode_is_released_from_the_bounded_counts_with_the_charged_epsilon(tmp_path):
    d = _recorded(write_csv(tmp_path / "d.csv", list(COLUMNS), rows_d()), "SELECT MODE(v) FROM t")
    d2 = _recorded(
        write_csv(tmp_path / "d2.csv", list(COLUMNS), rows_d() + EXTRA), "SELECT MODE(v) FROM t"
    )
    (plan, result, _), (plan2, result2, _) = d, d2
    c, c2 = _counts(plan, result), _counts(plan2, result2)
    # the worst-case unit is bounded to R rows: one count moves by exactly R
    assert c.tolist() == [12, 9, 6, 3]
    assert (c2 - c).tolist() == [0, R, 0, 0]
    (qm,) = plan.quantiles
    epsilon = float(plan.cost.epsilon)
    assert epsilon == pytest.approx(1.0) and qm.group_epsilon <= epsilon
    p = noisy_max_probabilities(c, qm.group_epsilon, qm.max_values)
    p2 = noisy_max_probabilities(c2, qm.group_epsilon, qm.max_values)
    loss = float(np.max(np.abs(np.log(p) - np.log(p2))))
    # counts only grow when a unit joins, so this neighbour's loss is about ε/2 (the
    # calibration also covers utilities moving apart): within ε, and not vacuous
    assert 0.25 * epsilon < loss <= epsilon + 1e-9
    # power: calibrated to a quarter of the sensitivity, the same neighbours exceed ε
    broken = noisy_max_probabilities(c, 4 * qm.group_epsilon, qm.max_values)
    broken2 = noisy_max_probabilities(c2, 4 * qm.group_epsilon, qm.max_values)
    assert float(np.max(np.abs(np.log(broken) - np.log(broken2)))) > epsilon
    # what is released follows those distributions (seeded releases of the recorded plan)
    for recorded, counts, probabilities in ((d, c, p), (d2, c2, p2)):
        rplan, rresult, _ = recorded
        source = SeededNoise(20261206)
        drawn = [release(rplan, rresult, source).outputs[0][0] for _ in range(300)]
        observed = [drawn.count(v) for v in DOMAIN]
        assert stats.chisquare(observed, probabilities * len(drawn)).pvalue > 1e-3, (
            observed,
            counts,
        )


def test_report_noisy_max_draws_its_distribution():
    counts = np.array([10, 8, 3, 0])
    source = SeededNoise(5)
    draws = [report_noisy_max(counts, 1.0, 1, source) for _ in range(2000)]
    observed = np.bincount(draws, minlength=4)
    expected = noisy_max_probabilities(counts, 1.0, 1) * len(draws)
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    assert report_noisy_max(counts, 1.0, 1, ZeroNoise()) == 0


def test_mode_charges_its_share_in_the_one_reservation(tmp_path):
    path = write_csv(tmp_path / "d.csv", list(COLUMNS), rows_d())
    service = RecordingService(
        _policy(path), ledger=MemoryLedger(), noise=SeededNoise(1), cache=False
    )
    cur = connect_service(service, "a").cursor()
    cur.execute("SELECT k, MODE(v), COUNT(*), AVG(w) FROM t GROUP BY k")
    assert len(cur.fetchall()) == 2
    spent = service.ledger.spent("a", service.policy.dataset)
    assert float(spent.epsilon) == pytest.approx(1.0)  # the query's ε, once, all parts in it
    plan = service.plans[-1]
    (qm,) = plan.quantiles
    assert 0 < float(qm.cost.epsilon) < 1.0 and math.isclose(
        float(plan.cost.epsilon), 1.0, rel_tol=1e-12
    )
    service.close()


REFUSED = [
    ("SELECT MODE(name) FROM t", "MODE(name) needs a public domain", "MODE(", "declare values"),
    ("SELECT MODE(w) FROM t", "MODE(w) needs a public domain", "MODE(", "declare values"),
    ("SELECT k, MODE(v || 'x') FROM t GROUP BY k", "MODE takes a column", "MODE(", "MODE(column)"),
    ("SELECT MODE(DISTINCT v) FROM t", "DISTINCT is only supported", "MODE(", "COUNT(DISTINCT"),
]


@pytest.mark.parametrize(("sql", "message", "at", "hint"), REFUSED, ids=[r[0] for r in REFUSED])
def test_mode_refusals_are_free_and_located(tmp_path, sql, message, at, hint):
    path = write_csv(tmp_path / "d.csv", list(COLUMNS), rows_d())
    service = RecordingService(
        _policy(path), ledger=MemoryLedger(), noise=SeededNoise(1), cache=False
    )
    cur = connect_service(service, "a").cursor()
    with pytest.raises(PrivacyError) as refused:
        cur.execute(sql)
    error = refused.value
    assert error.sqlstate == "42501"
    assert message in str(error) and hint in (error.hint or "")
    column = sql.index(at) + 1
    assert f"line 1, column {column}" in str(error)
    assert service.results == []  # nothing was read
    assert service.ledger.spent("a", service.policy.dataset).epsilon == 0
    service.close()
