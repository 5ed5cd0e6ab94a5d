"""The default contribution bounds and what the default bias estimate costs (issue 31 item 7).

- a table with a privacy unit that states no max_rows_per_unit / max_groups_per_unit gets
  "auto" (chosen privately, charged as its own ledger entry); no unit, or a unit declared
  primary_key / unique (one row per unit), gets R = G = 1; explicit values stay;
- a bias measure is planned only where a bound can cut something for it: none for a COUNT
  where a unit is one row (the whole ε on the count), none on the statement whose overhead
  share bought the bounds' histogram (its note is the histogram's estimate);
- private-key suppression through SQL with the defaults is at the exact expectation of the
  threshold spending the whole ε and δ (the bias estimate does not raise τ).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from conftest import exact_connect, write_csv

import dpsql
from dpsql.frontend.bind import parse_statement
from dpsql.plan import bias
from dpsql.plan.sharing import threshold_suppression
from dpsql.policy import AUTO_CAP, load_policy
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.mechanisms import Laplace, threshold_below
from dpsql.privacy.samplers import SeededNoise, ZeroNoise
from dpsql.privacy.sqlite_ledger import SQLiteLedger

COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "grp": {"type": "text", "values": ["a", "b"], "nullable": False},
    # clip "declared": these tests count the contribution bounds' choices (unstated, a SUM of
    # val buys its clamp range's histogram too: tests/test_default_clamp.py)
    "val": {"type": "int", "lower": 0, "upper": 10, "nullable": False, "clip": "declared"},
}


def _policy(path: Path, epsilon: float = 10.0, **table: object) -> dict:
    spec = {"source": str(path), "privacy_unit": "uid", "columns": COLUMNS, **table}
    privacy = {"epsilon": epsilon, "delta": 1e-6, "budget_epsilon": 1e9, "budget_delta": 0.5}
    return {"privacy": {**privacy, "dataset": "d"}, "tables": {"t": spec}}


def _several(tmp_path: Path) -> Path:
    """60 units of 1, 2 or 3 rows (unit i has i % 3 + 1), alternating groups a and b."""
    rows = [(u, "ab"[j % 2], u % 7) for u in range(1, 61) for j in range(u % 3 + 1)]
    return write_csv(tmp_path / "t.csv", ["uid", "grp", "val"], rows)


def _one_each(tmp_path: Path) -> Path:
    rows = [(u, "ab"[u % 2], u % 11) for u in range(1, 101)]
    return write_csv(tmp_path / "one.csv", ["uid", "grp", "val"], rows)


def _plan(conn: dpsql.Connection, sql: str):
    service = conn._service
    return service.plan(parse_statement(sql, service.policy), conn._settings, conn.analyst)


def _bias_measures(plan) -> list[str]:
    return [m.kind for m in plan.measures if m.kind in bias.KINDS]


# -- the defaults ------------------------------------------------------------------------------


def test_an_unstated_bound_of_a_unit_is_auto(tmp_path: Path) -> None:
    path = _several(tmp_path)
    table = load_policy(_policy(path)).table("t")
    assert table.auto_bounds == ("rows", "groups")
    assert (table.max_rows_per_unit, table.max_groups_per_unit) == (AUTO_CAP, AUTO_CAP)
    # where no choice is made (a join on the unit, a per-unit relation): the former default
    assert table.unchosen_bounds() == (1, 1) and not table.unit_is_row
    # an explicit value stays the curator's; a declared "auto" falls back to the cap
    mixed = load_policy(_policy(path, max_rows_per_unit=2, max_groups_per_unit="auto")).table("t")
    assert mixed.auto_bounds == ("groups",) and mixed.max_rows_per_unit == 2
    assert mixed.unchosen_bounds() == (2, AUTO_CAP)
    fixed = load_policy(_policy(path, max_rows_per_unit=1, max_groups_per_unit=1)).table("t")
    assert fixed.auto_bounds == () and not fixed.unit_is_row


@pytest.mark.parametrize("declared", [{"primary_key": "uid"}, {"unique": ["uid"]}, None])
def test_one_row_per_unit_keeps_r_and_g_at_1(tmp_path: Path, declared: dict | None) -> None:
    """A unit declared primary_key or unique has one row: R = G = 1 cut nothing. Without a
    privacy unit a row is its own unit."""
    path = _one_each(tmp_path)
    spec = _policy(path, **(declared or {}))
    if declared is None:
        del spec["tables"]["t"]["privacy_unit"]
    table = load_policy(spec).table("t")
    assert table.auto_bounds == ()
    assert (table.max_rows_per_unit, table.max_groups_per_unit) == (1, 1)
    assert table.unit_is_row


def test_a_default_policy_chooses_r_and_charges_the_choice(tmp_path: Path) -> None:
    """Noise off: the histogram is exact, so R = 3 keeps every row (the former default R = 1
    kept 60 of 120); the choice is its own ledger entry of bounds_share · ε."""
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    service = dpsql.Service(_policy(_several(tmp_path)), ledger=ledger, noise=ZeroNoise())
    cur = service.connect("alice").cursor()
    cur.execute("SELECT COUNT(*) FROM t")
    assert cur.fetchall() == [(120,)]
    charges = [e for e in ledger.entries("d", analyst="alice") if e.kind == "charge"]
    assert [c.query_text.startswith("choose contribution bounds") for c in charges] == [
        True,
        False,
    ]
    assert math.isclose(float(charges[0].cost.epsilon), 1.0)
    assert math.isclose(float(charges[0].cost.epsilon + charges[1].cost.epsilon), 10.0)
    service.close()


# -- no bias charge where nothing can cut ------------------------------------------------------


def test_no_bias_measure_where_a_unit_is_one_row(tmp_path: Path) -> None:
    """A COUNT over a unit declared primary key (or a row-level table): R and G cut nothing and
    a COUNT has no clamp, so the default bias estimate plans no measure and the whole ε is the
    count's; EXPLAIN says so. A SUM still measures its clamp, never R's cut."""
    path = _one_each(tmp_path)
    row_level = _policy(path, epsilon=1.0)
    del row_level["tables"]["t"]["privacy_unit"]
    for pol in (_policy(path, epsilon=1.0, primary_key="uid"), row_level):
        conn = exact_connect(pol)
        for sql in ("SELECT COUNT(*) FROM t", "SELECT grp, COUNT(*) FROM t GROUP BY grp"):
            plan = _plan(conn, sql)
            assert plan.extra["bias_estimate"] and _bias_measures(plan) == []
            assert sum(m.epsilon for m in plan.measures) == pytest.approx(1.0)
        assert _bias_measures(_plan(conn, "SELECT SUM(val) FROM t")) == ["clamped"]
        conn.close()
    conn = exact_connect(_policy(path, epsilon=1.0, primary_key="uid"))
    cur = conn.cursor()
    cur.execute("EXPLAIN (FORMAT TEXT) SELECT grp, COUNT(*) FROM t GROUP BY grp")
    text = "\n".join(str(r[0]) for r in cur.fetchall())
    assert "nothing to measure" in text and "is one row (declared unique)" in text
    conn.close()


def test_the_statement_buying_the_histogram_plans_no_bias_measure(tmp_path: Path) -> None:
    """Under the default "auto" bounds the first statement spends its overhead share on the
    histogram (its note is the histogram's estimate) and plans no bias measure; a later query
    choosing from the kept histogram measures what R cuts from its own share."""
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    service = dpsql.Service(_policy(_several(tmp_path)), ledger=ledger, noise=ZeroNoise())
    conn = service.connect("alice")
    cur = conn.cursor()
    cur.execute("SELECT COUNT(*) FROM t")
    cur.fetchall()
    notes = [text for _, text in cur.messages]
    assert any("bought the contribution histogram" in n for n in notes), notes
    assert _bias_measures(_plan(conn, "SELECT COUNT(*) FROM t")) == []  # the payer, replanned
    later = _plan(conn, "SELECT SUM(val) FROM t")
    assert later.query.table.max_rows_per_unit == 3
    assert set(_bias_measures(later)) == {"cut", "clamped"}
    assert "dropped" in _bias_measures(_plan(conn, "SELECT COUNT(*) AS n FROM t"))
    service.close()


# -- private-key suppression through SQL -------------------------------------------------------


def test_sql_suppression_is_at_the_whole_epsilon_thresholds_expectation(tmp_path: Path) -> None:
    """280 private keys of 10..16 units each (one row per unit, declared primary key) at ε = 1,
    δ = 1e-5 with every default on: the share of keys not released over 5 seeded queries is
    within 4 standard errors (0.05) of the exact expectation of the threshold spending the
    whole ε and δ (τ = 13, a key at 12 kept with probability 0.714: 0.333). A bias share
    taken from the count (ε 0.9: 0.503) or the integer threshold (0.430) would fail it."""
    counts = np.repeat(np.arange(10, 17), 40)
    rows, uid = [], 0
    for k, n in enumerate(counts):
        for _ in range(int(n)):
            uid += 1
            rows.append((uid, f"k{k:03d}", 1))
    path = write_csv(tmp_path / "keys.csv", ["uid", "name", "val"], rows)
    columns = {"uid": COLUMNS["uid"], "name": {"type": "text", "nullable": False}}
    spec = {"source": str(path), "privacy_unit": "uid", "primary_key": "uid", "columns": columns}
    privacy = {"epsilon": 1.0, "delta": 1e-5, "budget_epsilon": 1e9, "budget_delta": 0.5}
    mech = Laplace(l1=1.0, epsilon=1.0)
    tau = mech.threshold(1e-5, 1)
    expected = float(
        np.mean(
            [
                threshold_suppression(mech, tau, threshold_below(mech, tau, 1e-5, 1))(int(n))
                for n in counts
            ]
        )
    )
    assert expected == pytest.approx(0.333, abs=1e-3)
    reps = 5
    with dpsql.connect(
        policy={"privacy": privacy, "tables": {"t": spec}},
        ledger=MemoryLedger(),
        noise=SeededNoise(5),
        cache=False,
    ) as conn:
        cur = conn.cursor()
        released = 0
        for _ in range(reps):
            cur.execute("SELECT name, COUNT(*) FROM t GROUP BY name")
            released += len(cur.fetchall())
    trials = reps * len(counts)
    suppressed = 1 - released / trials
    se = math.sqrt(expected * (1 - expected) / trials)
    assert abs(suppressed - expected) < 4 * se, (suppressed, expected, se)
