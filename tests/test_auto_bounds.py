"""Contribution bounds chosen privately (issue 31, item 2): ``max_rows_per_unit = "auto"`` and
``max_groups_per_unit = "auto"`` (dpsql.privacy.contribution, dpsql.service.bounds).

- the policy accepts "auto" and refuses anything else by key, problem and fix;
- answers use the bound chosen from the noisy histogram (noise off: the exact one);
- the choice is charged exactly once per analyst and data version, as its own ledger entry of
  bounds_share · ε, and the statement that paid never costs more than its ε;
- a refusal before the choice spends nothing and reads nothing;
- a neighbouring-dataset audit of the released histogram (and the bound chosen from it) shows
  no violation of its ε, and the same audit catches a histogram with half the noise.
"""

from __future__ import annotations

import math
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from conftest import table_policy, write_csv

import dpsql
from dpsql.errors import PolicyError
from dpsql.lower.compile import contribution_query
from dpsql.policy import AUTO_CAP, load_policy
from dpsql.privacy.audit import BufferedNoise, audit, indicator_event, threshold_events
from dpsql.privacy.contribution import (
    CANDIDATES,
    ContributionHistogram,
    bin_of,
    choose,
    passing,
)
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise, ZeroNoise
from dpsql.privacy.sqlite_ledger import SQLiteLedger

EPS = 10.0  # large enough that the exact histogram's bins pass τ (ε_c = 1)


def _data(tmp_path: Path, units: int = 60, name: str = "t.csv") -> Path:
    """Unit i has (i % 3) + 1 rows, spread over groups a and b: 1, 2 or 3 rows, 1 or 2 groups."""
    rows = []
    for uid in range(1, units + 1):
        for j in range(uid % 3 + 1):
            rows.append((uid, "ab"[j % 2], uid % 7))
    return write_csv(tmp_path / name, ["uid", "grp", "val"], rows)


COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "grp": {"type": "text", "values": ["a", "b"], "nullable": False},
    # clip "declared": these tests count the contribution bounds' choices (unstated, a SUM of
    # val buys its clamp range's histogram too: tests/test_default_clamp.py)
    "val": {"type": "int", "lower": 0, "upper": 10, "nullable": False, "clip": "declared"},
}


def _policy(path: Path, **table: object) -> dict:
    policy = table_policy(path, COLUMNS, unit="uid", privacy={"epsilon": EPS, "dataset": "d"})
    policy["tables"]["t"].update({"max_rows_per_unit": "auto", "max_groups_per_unit": "auto"})
    policy["tables"]["t"].update(table)
    return policy


def _charges(ledger: SQLiteLedger, analyst: str = "alice") -> list:
    return [e for e in ledger.entries("d", analyst=analyst) if e.kind == "charge"]


def _ask(cur, sql: str) -> list:
    cur.execute(sql)
    return cur.fetchall()


# --- the policy ---------------------------------------------------------------------------------


def test_auto_is_accepted_and_plans_with_the_cap_until_chosen(tmp_path: Path):
    table = load_policy(_policy(_data(tmp_path))).tables["t"]
    assert table.auto_bounds == ("rows", "groups")
    assert table.max_rows_per_unit == table.max_groups_per_unit == AUTO_CAP == CANDIDATES[-1]
    assert table.bounds_share == 0.1
    only_rows = _policy(_data(tmp_path), max_groups_per_unit=2)
    table = load_policy(only_rows).tables["t"]
    assert table.auto_bounds == ("rows",) and table.max_groups_per_unit == 2


@pytest.mark.parametrize(
    ("table", "key", "problem", "fix"),
    [
        (
            {"max_rows_per_unit": "many"},
            "tables.t.max_rows_per_unit",
            "must be an integer >= 1 or \"auto\", got 'many'",
            'write e.g. 5, or "auto" to let dpsql choose it privately',
        ),
        (
            {"max_groups_per_unit": 0},
            "tables.t.max_groups_per_unit",
            'must be an integer >= 1 or "auto", got 0',
            'write e.g. 5, or "auto" to let dpsql choose it privately',
        ),
        (
            {"max_rows_per_unit": 2.5},
            "tables.t.max_rows_per_unit",
            'must be an integer >= 1 or "auto", got 2.5',
            'write e.g. 5, or "auto" to let dpsql choose it privately',
        ),
        (
            {"bounds_share": 1.5},
            "tables.t.bounds_share",
            "must be a number in (0, 1)",
            "e.g. bounds_share = 0.1",
        ),
    ],
)
def test_bad_values_are_refused_by_key_problem_and_fix(tmp_path, table, key, problem, fix):
    with pytest.raises(PolicyError) as info:
        load_policy(_policy(_data(tmp_path), **table))
    err = info.value
    assert err.construct == key and problem in err.message and err.hint == fix


def test_auto_without_a_privacy_unit_is_refused(tmp_path: Path):
    policy = table_policy(_data(tmp_path), COLUMNS)
    policy["tables"]["t"]["max_rows_per_unit"] = "auto"
    with pytest.raises(PolicyError, match="every row is its own unit, so the bounds must be 1"):
        load_policy(policy)


# --- the mechanism ------------------------------------------------------------------------------


def test_the_service_layer_reads_the_summed_kinds_from_the_kind_objects():
    """dpsql.service.bounds keeps no copy of the summed kinds: a call asks its kind's object."""
    from dpsql.aggregates import KINDS, SUMMED_KINDS
    from dpsql.frontend.statements import AggregateCall
    from dpsql.service import bounds

    assert not hasattr(bounds, "SUMMED_KINDS")
    assert SUMMED_KINDS == ("sum", "avg", "var_samp", "var_pop", "stddev_samp", "stddev_pop")
    assert [k for k in KINDS if AggregateCall(k, "x").summed] == list(SUMMED_KINDS)


def test_bins_and_the_contiguous_choice():
    assert [bin_of(n) for n in (1, 6, 7, 8, 9, 64, 65, 10**6)] == [0, 5, 6, 6, 7, 14, 15, 15]
    hist = ContributionHistogram(1.0)
    counts = hist.counts({1: 500, 2: 300, 3: 100})
    assert counts.tolist()[:4] == [500, 300, 100, 0] and counts.sum() == 900
    assert choose(counts, hist.threshold, 0.1) == 3
    # a count far above the data after an empty bin (a false pass) cannot extend the bound
    spiked = counts.copy()
    spiked[13] = 10_000
    assert passing(spiked, hist.threshold)[13] == 0 and choose(spiked, hist.threshold, 0.1) == 3
    # the noise price per unit of the bound decides: a costly bound stops lower
    assert choose(counts, hist.threshold, 150.0) == 2
    assert choose(np.zeros(hist.bins), hist.threshold, 0.1) == 1


# --- answers and charges ------------------------------------------------------------------------


def test_answers_use_the_chosen_bounds(tmp_path: Path):
    """Noise off: the histogram is exact, R = 3 and G = 2 are chosen (every unit's rows and
    groups kept), so COUNT(*) and the per-group counts are the true ones — the hand-set R = 1
    loses every unit's second and third row."""
    path = _data(tmp_path)
    conn = dpsql.connect(policy=_policy(path), ledger=MemoryLedger(), noise=ZeroNoise())
    cur = conn.cursor()
    assert _ask(cur, "SELECT COUNT(*) FROM t") == [(120,)]
    notes = [text for _, text in cur.messages]
    assert any("max_rows_per_unit = 3 chosen privately" in n for n in notes)
    assert sorted(_ask(cur, "SELECT grp, COUNT(*) FROM t GROUP BY grp")) == [("a", 80), ("b", 40)]
    assert any("max_groups_per_unit = 2 chosen privately" in t for _, t in cur.messages)
    conn.close()
    fixed = table_policy(path, COLUMNS, unit="uid", privacy={"epsilon": EPS})
    conn = dpsql.connect(policy=fixed, ledger=MemoryLedger(), noise=ZeroNoise())
    assert _ask(conn.cursor(), "SELECT COUNT(*) FROM t") == [(60,)]
    conn.close()


def test_the_choice_is_charged_once_per_analyst_and_data_version(tmp_path: Path):
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    path = _data(tmp_path)
    service = dpsql.Service(_policy(path, version="v1"), ledger=ledger, noise=ZeroNoise())
    cur = service.connect("alice").cursor()
    _ask(cur, "SELECT COUNT(*) FROM t")
    first = _charges(ledger)
    assert len(first) == 2
    choice, query = first
    assert choice.query_text.startswith("choose contribution bounds: rows per unit of t")
    assert "data version v1" in choice.query_text
    assert math.isclose(float(choice.cost.epsilon), 0.1 * EPS)
    assert math.isclose(float(choice.cost.epsilon + query.cost.epsilon), EPS)
    _ask(cur, "SELECT COUNT(*) FROM t")  # the same statement: its cached answer, free
    _ask(cur, "SELECT SUM(val) FROM t")  # chooses from the kept histogram: its whole ε
    charges = _charges(ledger)
    assert len(charges) == 3 and math.isclose(float(charges[-1].cost.epsilon), EPS)
    # a GROUP BY needs the groups histogram of its key set: one more choice, then free
    _ask(cur, "SELECT grp, COUNT(*) FROM t GROUP BY grp")
    _ask(cur, "SELECT grp, SUM(val) FROM t GROUP BY grp")
    kinds = [c.query_text.startswith("choose") for c in _charges(ledger)]
    assert kinds == [True, False, False, True, False, False]
    # another analyst pays for their own histogram, once
    bob = service.connect("bob").cursor()
    _ask(bob, "SELECT COUNT(*) FROM t")
    _ask(bob, "SELECT AVG(val) FROM t")
    assert [c.query_text.startswith("choose") for c in _charges(ledger, "bob")] == [
        True,
        False,
        False,
    ]
    service.close()  # closes the ledger too: open it again for the next start
    # a new data version: chosen (and charged) again
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    service = dpsql.Service(_policy(path, version="v2"), ledger=ledger, noise=ZeroNoise())
    _ask(service.connect("alice").cursor(), "SELECT COUNT(*) FROM t")
    last = _charges(ledger)[-2:]
    assert last[0].query_text.startswith("choose") and "data version v2" in last[0].query_text
    service.close()


def test_without_the_answer_cache_every_query_pays_its_share(tmp_path: Path):
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    conn = dpsql.connect(
        policy=_policy(_data(tmp_path)), ledger=ledger, noise=ZeroNoise(), cache=False
    )
    cur = conn.cursor()
    _ask(cur, "SELECT COUNT(*) FROM t")
    _ask(cur, "SELECT COUNT(*) FROM t")
    charges = _charges(ledger, "default")
    assert [c.query_text.startswith("choose") for c in charges] == [True, False, True, False]
    conn.close()


def test_a_refusal_before_the_choice_spends_and_reads_nothing(tmp_path: Path):
    policy = _policy(_data(tmp_path))
    policy["privacy"]["budget_epsilon"] = 5.0  # less than the query's ε = 10
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    service = dpsql.Service(policy, ledger=ledger, noise=ZeroNoise())
    cur = service.connect("alice").cursor()
    with mock.patch.object(service.engine, "execute", wraps=service.engine.execute) as run:
        with pytest.raises(dpsql.Error, match="budget"):
            _ask(cur, "SELECT COUNT(*) FROM t")
        cur.execute("EXPLAIN SELECT COUNT(*) FROM t")  # planning with a pending choice: free
        assert run.call_count == 0
    assert _charges(ledger) == []
    service.close()


# --- neighbouring datasets ----------------------------------------------------------------------

AUDIT_EPS = 1.0
OVERFLOW_COUNT = CANDIDATES[-1] + 1
AUDIT_RUNS = 20_000


def _exact_counts(tmp_path: Path, units: list[int], name: str) -> dict[int, int]:
    """Run the engine's contribution query on a dataset of units with the given row counts."""
    rows = [(uid, "a", 1) for uid, n in enumerate(units, start=1) for _ in range(n)]
    path = write_csv(tmp_path / name, ["uid", "grp", "val"], rows)
    service = dpsql.Service(_policy(path), ledger=MemoryLedger(), noise=ZeroNoise())
    try:
        table = service.policy.tables["t"]
        result = service.engine.execute(contribution_query(table, (), "rows", OVERFLOW_COUNT))
        return {int(k[0]): int(c) for k, c in zip(result.key_rows, result.measures[0], strict=True)}
    finally:
        service.close()


def _releases(hist: ContributionHistogram, per_count: dict[int, int], seed: int) -> np.ndarray:
    noise = BufferedNoise(SeededNoise(seed))
    return np.array([hist.release(per_count, noise) for _ in range(AUDIT_RUNS)])


@pytest.fixture(scope="module")
def neighbours(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """D: 40 units of 1 to 3 rows; D′ = D + one unit of 200 rows (the overflow bin, where a
    unit's presence moves the chosen bound the most)."""
    tmp = tmp_path_factory.mktemp("auto_bounds_audit")
    base = [1] * 20 + [2] * 12 + [3] * 8
    return _exact_counts(tmp, base, "d.csv"), _exact_counts(tmp, [*base, 200], "d2.csv")


def test_the_engine_counts_units_by_contribution(neighbours):
    d, d2 = neighbours
    assert d == {1: 20, 2: 12, 3: 8}
    assert d2 == {1: 20, 2: 12, 3: 8, CANDIDATES[-1] + 1: 1}


def _events(hist: ContributionHistogram, out_d: np.ndarray, out_d2: np.ndarray) -> list:
    last = hist.bins - 1
    events = threshold_events("overflow bin", out_d[:, last], out_d2[:, last], [-1, 0, 1, 2])
    bound_d = np.array([choose(r, hist.threshold, 0.05) for r in out_d])
    bound_d2 = np.array([choose(r, hist.threshold, 0.05) for r in out_d2])
    for c in (2, 3, 4):
        events.append(indicator_event(f"R >= {c}", bound_d >= c, bound_d2 >= c))
    return events


def test_audit_of_the_choice_on_neighbouring_datasets(neighbours):
    d, d2 = neighbours
    hist = ContributionHistogram(AUDIT_EPS)
    out_d, out_d2 = _releases(hist, d, 11), _releases(hist, d2, 12)
    report = audit(_events(hist, out_d, out_d2), AUDIT_RUNS, AUDIT_RUNS, epsilon=AUDIT_EPS)
    print(report)
    assert not report.violated
    # power: the same histogram with half the noise (ε 2 sold as ε 1) is caught
    broken = ContributionHistogram(2 * AUDIT_EPS)
    out_d, out_d2 = _releases(broken, d, 13), _releases(broken, d2, 14)
    report = audit(_events(broken, out_d, out_d2), AUDIT_RUNS, AUDIT_RUNS, epsilon=AUDIT_EPS)
    assert report.violated
