"""Partition selection through SQL (issue 17 item 4): optimal selection, τ-threshold, auto.

Statistical tests use fixed seeds; each tolerance is ~4 standard errors of the estimate it
bounds (stated next to it), so another seed would pass too unless the mechanism is wrong.
"""

from __future__ import annotations

import math
import random

import pytest
from conftest import table_policy, write_csv

import dpsql
from dpsql.errors import DatabaseError, InternalError
from dpsql.frontend.bind import parse_statement
from dpsql.plan.check import check_plan
from dpsql.plan.sharing import threshold_suppression
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.partition import OptimalSelection, Unreleased
from dpsql.privacy.samplers import SeededNoise
from dpsql.service.settings import Settings

EPS, DELTA = 1.0, 0.01  # π(4) ≈ 0.31, π(5) ≈ 0.75: both far from 0 and 1
GROUPS = 1000  # per size


def _rows(sizes: dict[str, int], start: int = 0) -> list[tuple[int, str]]:
    rows, uid = [], start
    for name, n in sizes.items():
        for _ in range(n):
            rows.append((uid, name))
            uid += 1
    return rows


def _connect(path, seed=1, delta=DELTA, epsilon=EPS, **privacy):
    policy = table_policy(
        path,
        {"uid": {"type": "int", "nullable": False}, "name": {"type": "text"}},
        unit="uid",
        privacy={"epsilon": epsilon, "delta": delta, "budget_delta": 0.99, **privacy},
    )
    return dpsql.connect(policy=policy, ledger=MemoryLedger(), noise=SeededNoise(seed), cache=False)


def _plan(conn, sql, mode="auto", epsilon=EPS, delta=DELTA):
    service = conn._service
    settings = Settings(epsilon, delta, "laplace", partition_selection=mode)
    return service.plan(parse_statement(sql, service.policy), settings)


@pytest.fixture(scope="module")
def sized(tmp_path_factory):
    """GROUPS keys of 4 units and GROUPS keys of 5 units (one row per unit)."""
    sizes = {f"a{i:04d}": 4 for i in range(GROUPS)} | {f"b{i:04d}": 5 for i in range(GROUPS)}
    path = write_csv(tmp_path_factory.mktemp("sel") / "t.csv", ["uid", "name"], _rows(sizes))
    return path


def _released(conn, sql):
    cur = conn.cursor()
    cur.execute(sql)
    return [r[0] for r in cur.fetchall()]


def test_optimal_release_rate_is_pi_of_n(sized):
    conn = _connect(sized, seed=11)
    conn.cursor().execute("SET partition_selection = 'optimal'")
    keys = _released(conn, "SELECT name FROM t GROUP BY name")
    sel = OptimalSelection(EPS, DELTA)
    for prefix, n in (("a", 4), ("b", 5)):
        rate = sum(k.startswith(prefix) for k in keys) / GROUPS
        p = sel.keep_probability(n)
        se = math.sqrt(p * (1 - p) / GROUPS)  # ≈ 0.015 (n = 4), 0.014 (n = 5)
        assert abs(rate - p) < 4 * se, (n, rate, p)


def test_threshold_release_rate_is_its_noise_tail(sized):
    conn = _connect(sized, seed=12)
    conn.cursor().execute("SET partition_selection = 'threshold'")
    # the query's plan is _plan's (no bias share): the fitted p(τ − 1) depends on the ε
    conn.cursor().execute("SET bias_estimate = off")
    keys = _released(conn, "SELECT name, COUNT(*) FROM t GROUP BY name")
    plan = _plan(conn, "SELECT name, COUNT(*) FROM t GROUP BY name", "threshold")
    units = plan.measure(plan.threshold.measure)
    supp = threshold_suppression(units.mechanism, plan.threshold.tau, plan.threshold.below)
    for prefix, n in (("a", 4), ("b", 5)):
        rate = sum(k.startswith(prefix) for k in keys) / GROUPS
        p = 1 - supp(n)
        se = math.sqrt(max(p * (1 - p), 1e-4) / GROUPS)
        assert abs(rate - p) < 4 * se + 1e-3, (n, rate, p)


def test_auto_keeps_keys_at_a_smaller_count_than_the_threshold(sized):
    conn = _connect(sized)
    sql = "SELECT name FROM t GROUP BY name"
    auto = _plan(conn, sql)
    assert auto.selection.mode == "optimal"  # nothing to reuse: optimal at the whole ε
    compared = dict(auto.selection.n_half)
    assert compared["optimal"] <= compared["threshold"]
    # a COUNT(*) that the noisy unit count serves (R = 1): the threshold keeps it cheaper
    counted = _plan(conn, "SELECT name, COUNT(*) FROM t GROUP BY name", epsilon=1.0, delta=1e-6)
    assert counted.selection.mode == "threshold"
    assert [m.kind for m in counted.measures] == ["units"]  # COUNT(*) = unit count = selection
    assert counted.outputs[0].measures == (counted.threshold.measure,)


@pytest.mark.filterwarnings("ignore::dpsql.errors.BudgetWarning")
def test_neighbouring_datasets_empirical_privacy_loss(tmp_path):
    """D has a key held by 6 units, D' the same key with a 7th unit. Over REPS fresh runs
    each, P(released) must satisfy both (ε, δ) inequalities, within 4 standard errors."""
    reps, delta = 800, 0.001  # 800 runs of δ = 0.001 fit the δ budget; π(6) ≈ 0.23, π(7) ≈ 0.64
    base = {"x": 6} | {f"f{i}": 30 for i in range(3)}
    d = write_csv(tmp_path / "d.csv", ["uid", "name"], _rows(base))
    d2 = write_csv(tmp_path / "d2.csv", ["uid", "name"], [*_rows(base), (10_000, "x")])
    rates = []
    for path, seed in ((d, 100), (d2, 200)):
        conn = _connect(path, seed=seed, delta=delta)
        cur = conn.cursor()
        cur.execute("SET partition_selection = 'optimal'")
        hits = 0
        for _ in range(reps):
            cur.execute("SELECT name FROM t GROUP BY name")
            hits += any(r[0] == "x" for r in cur.fetchall())
        rates.append(hits / reps)
    p, q = rates
    se_p, se_q = (math.sqrt(r * (1 - r) / reps) for r in rates)  # ≈ 0.014, 0.016
    sel = OptimalSelection(EPS, delta)
    assert abs(p - sel.keep_probability(6)) < 4 * se_p
    assert abs(q - sel.keep_probability(7)) < 4 * se_q

    def holds(eps: float) -> bool:
        """Both outcomes, both directions: P(S) <= e^eps P'(S) + δ, within 4 standard errors
        of P(S) − e^eps P'(S) (≈ 0.19 at eps = 1)."""
        pairs = ((p, q, se_p, se_q), (q, p, se_q, se_p))
        pairs += tuple((1 - a, 1 - b, sa, sb) for a, b, sa, sb in pairs)
        return all(
            a <= math.exp(eps) * b + delta + 4 * math.sqrt(sa**2 + math.exp(2 * eps) * sb**2)
            for a, b, sa, sb in pairs
        )

    assert holds(EPS)
    assert not holds(EPS / 4)  # the check has power: a quarter of the ε would be caught


def test_a_single_unit_key_is_released_with_probability_at_most_delta(tmp_path):
    keys = {f"s{i:04d}": 1 for i in range(4000)}
    path = write_csv(tmp_path / "t.csv", ["uid", "name"], _rows(keys))
    conn = _connect(path, seed=5, delta=0.05)
    rate = len(_released(conn, "SELECT name FROM t GROUP BY name")) / 4000
    assert rate < 0.05 + 4 * math.sqrt(0.05 * 0.95 / 4000)  # π(1) = δ: 0.05 ± 0.014


def test_engine_row_order_does_not_change_the_answer(tmp_path):
    rows = _rows({f"k{i}": 3 + i % 5 for i in range(200)})
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    answers = []
    for name, data in (("a.csv", rows), ("b.csv", shuffled)):
        conn = _connect(write_csv(tmp_path / name, ["uid", "name"], data), seed=9)
        answers.append(_released(conn, "SELECT name FROM t GROUP BY name"))
    assert answers[0] == answers[1] == sorted(answers[0])


def test_budget_charged_equals_the_plan_cost(sized):
    conn = _connect(sized)
    sql = "SELECT name, COUNT(DISTINCT uid) FROM t GROUP BY name"
    for mode in ("optimal", "threshold"):
        for mechanism in ("laplace", "gaussian"):
            ledger = MemoryLedger()
            conn = dpsql.connect(
                policy=conn._service.policy, ledger=ledger, noise=SeededNoise(3), cache=False
            )
            cur = conn.cursor()
            cur.execute(f"SET partition_selection = '{mode}'")
            cur.execute(f"SET mechanism = '{mechanism}'")
            service = conn._service
            settings = Settings(EPS, DELTA, mechanism, partition_selection=mode)
            plan = service.plan(parse_statement(sql, service.policy), settings)
            assert plan.selection.mode == mode
            cur.execute(sql)
            assert ledger.spent(conn.analyst, service.policy.dataset) == plan.cost
            if mechanism == "laplace":
                assert plan.cost.epsilon == EPS and plan.cost.delta == pytest.approx(DELTA)
            else:  # δ/2 to the selection, δ/2 to the Gaussian count; ρ for the count
                assert plan.cost.delta == pytest.approx(DELTA / 2) and plan.cost.rho > 0


def test_optimal_plan_reads_the_exact_count_only_in_the_selection(sized):
    conn = _connect(sized)
    plan = _plan(conn, "SELECT name, COUNT(*) FROM t GROUP BY name", "optimal")
    exact = [m for m in plan.measures if isinstance(m.mechanism, Unreleased)]
    assert [m.name for m in exact] == [plan.selection.measure]
    assert all(plan.selection.measure not in o.measures for o in plan.outputs)
    # the selection's cost plus the noisy count's is the query's (ε, δ)
    noisy = [m for m in plan.measures if not isinstance(m.mechanism, Unreleased)]
    assert sum(m.epsilon for m in noisy) + plan.selection.epsilon == pytest.approx(EPS)
    # a plan whose output read the exact count is refused by the IR check
    from dataclasses import replace

    bad = plan.with_(outputs=(replace(plan.outputs[0], measures=(plan.selection.measure,)),))
    with pytest.raises(InternalError):
        check_plan(bad)


def test_suppression_probability_per_released_group(sized):
    conn = _connect(sized, seed=4)
    cur = conn.cursor()
    cur.execute("SET partition_selection = 'optimal'")
    cur.execute("SET bias_estimate = off")  # _plan's split (the selection's share of ε)
    cur.execute("SELECT name, COUNT(*), dp_suppression_probability() FROM t GROUP BY name")
    rows = cur.fetchall()
    plan = _plan(conn, "SELECT name, COUNT(*) FROM t GROUP BY name", "optimal")
    sel = plan.selection.mechanism
    for _, count, supp in rows[:50]:
        assert supp == pytest.approx(sel.suppression_probability(max(1, round(count))))
    # without a released unit count there is no per-group figure (NULL), EXPLAIN has π(n)
    cur.execute("SELECT name, dp_suppression_probability() FROM t GROUP BY name")
    assert all(r[1] is None for r in cur.fetchall())


def test_explain_text_shows_the_selection(sized):
    conn = _connect(sized)
    cur = conn.cursor()
    cur.execute("EXPLAIN (FORMAT TEXT) SELECT name FROM t GROUP BY name")
    text = "\n".join(r[0] for r in cur.fetchall())
    assert "name: not public, released by optimal partition selection" in text
    assert "P(a group of n units is suppressed): n = 1: 0.99" in text
    assert "partition_selection = 'auto': optimal (a group is kept with probability" in text
    assert "Selection: optimal partition selection on exact m0, eps 1, delta 0.01" in text
    cur.execute("SET partition_selection = 'threshold'")
    cur.execute("EXPLAIN (FORMAT TEXT) SELECT name, COUNT(*) FROM t GROUP BY name")
    text = "\n".join(r[0] for r in cur.fetchall())
    assert "released by thresholding" in text
    assert "its noisy unit count is reused by: COUNT(*)" in text
    assert "Threshold: release a group when noisy m0 >=" in text
    cur.execute("RESET partition_selection")
    cur.execute("EXPLAIN SELECT name FROM t GROUP BY name")  # tabular: the selection row
    rows = cur.fetchall()
    assert any(str(r[1]).startswith("optimal partition selection, kept always") for r in rows)


def test_refusals_unchanged(sized):
    conn = _connect(sized, delta=0.0)
    cur = conn.cursor()
    with pytest.raises(DatabaseError, match="releasing them needs delta > 0"):
        cur.execute("SELECT name FROM t GROUP BY name")
    with pytest.raises(DatabaseError, match="unknown partition_selection") as info:
        cur.execute("SET partition_selection = 'best'")
    assert info.value.sqlstate == "22023"
    cur.execute("SHOW partition_selection")
    assert cur.fetchall() == [("auto",)]


def test_an_optimal_table_too_long_is_refused_free(sized, monkeypatch):
    """π tables longer than MAX_TABLE raise ValueError: 'optimal' is refused before anything
    is read (free); 'auto' falls back to the τ-threshold."""

    def too_long(*args, **kwargs):
        raise ValueError("too long")

    monkeypatch.setattr("dpsql.plan.planner.OptimalSelection", too_long)
    conn = _connect(sized)
    cur = conn.cursor()
    cur.execute("SET partition_selection = 'optimal'")
    with pytest.raises(DatabaseError, match="needs too many units per group"):
        cur.execute("SELECT name FROM t GROUP BY name")
    assert conn._service.ledger.spent(conn.analyst, conn._service.policy.dataset).epsilon == 0
    assert _plan(conn, "SELECT name FROM t GROUP BY name").selection.mode == "threshold"


def test_auto_breaks_a_tie_by_the_released_values_error(sized):
    conn = _connect(sized)
    for epsilon in (0.3, 1.0, 10.0, 30.0):  # ties at 10 (keys only) and 30 (COUNT)
        for sql in (
            "SELECT name FROM t GROUP BY name",
            "SELECT name, COUNT(*) FROM t GROUP BY name",
        ):
            plan = _plan(conn, sql, epsilon=epsilon, delta=1e-6)
            compared = dict(plan.selection.n_half)
            assert compared[plan.selection.mode] == min(compared.values())
            if len(set(compared.values())) == 1:  # a tie: a reused count decides
                reused = bool(plan.outputs)
                assert plan.selection.mode == ("threshold" if reused else "optimal")
