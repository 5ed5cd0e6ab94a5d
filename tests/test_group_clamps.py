"""A grouped AVG's clamp chosen per group (dpsql.service.group_clamps; issue 31 items 2, 7).

Each AVG's count is released first; each group's clamp is chosen from its released count and
the kept DP histogram of the column; each group's sum is noised at its own clamp's scale.

- noise off: the clamps differ by group size (a big group keeps its tail, a small one is
  clamped low), the answer is each group's mean clamped to its own range, the note lists
  them, and the query is charged its ε once;
- the noise each group's sum is drawn with is scaled to that group's clamp (the test fails
  if one scale served every group, or a smaller one), and the count is drawn once per group;
- EXPLAIN says so for a grouped AVG with a default clamp, and nothing for an ungrouped AVG, a
  grouped SUM or a declared clamp;
- the error model's classes: at most MAX_CLASSES distinct clamps.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from conftest import table_policy, write_csv

import dpsql
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise, ZeroNoise
from dpsql.service import group_clamps

EPS = 1.0
COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "g": {"type": "int", "values": [0, 1], "nullable": False},
    "x": {"type": "int", "lower": 0, "upper": 1000, "nullable": False},
}
BIG, SMALL = 3000, 12


def _values() -> tuple[np.ndarray, np.ndarray]:
    """Group 0: 3,000 values, mostly below 50 with a tail of 1 in 15 at 900 (its mean, ~83,
    lies above the table's 0.9 quantile); group 1: 12 values from 5 to 16."""
    big = np.array([900 if i % 15 == 0 else i % 50 for i in range(BIG)])
    small = np.array([5 + i for i in range(SMALL)])
    return big, small


def _setup(tmp_path: Path, clip: str | None = None) -> dict:
    big, small = _values()
    rows = [(i + 1, 0, int(x)) for i, x in enumerate(big)]
    rows += [(BIG + i + 1, 1, int(x)) for i, x in enumerate(small)]
    path = write_csv(tmp_path / "t.csv", ["uid", "g", "x"], rows)
    columns = {k: dict(v) for k, v in COLUMNS.items()}
    if clip is not None:
        columns["x"]["clip"] = clip
    policy = table_policy(path, columns, unit="uid", privacy={"epsilon": EPS, "dataset": "d"})
    policy["tables"]["t"].pop("max_rows_per_unit")
    policy["tables"]["t"].pop("max_groups_per_unit")
    policy["tables"]["t"]["primary_key"] = "uid"
    return policy


SQL = "SELECT g, AVG(x) FROM t GROUP BY g"
LATER = "SELECT g, AVG(x) FROM t WHERE uid >= 0 GROUP BY g"


def _clamps(messages: list) -> dict[int, float]:
    (note,) = [m for _, m in messages if "clamped per group" in m]
    return {int(g): float(hi) for g, hi in re.findall(r"(\d+) \[0, ([0-9.e+]+)\]", note)}


def test_noise_off_each_group_is_clamped_to_its_own_range(tmp_path: Path):
    big, small = _values()
    ledger = MemoryLedger()
    service = dpsql.Service(_setup(tmp_path), ledger=ledger, noise=ZeroNoise())
    cur = service.connect("alice").cursor()
    for sql in (SQL, LATER):  # the paying query, then one choosing from the kept histogram
        spent = ledger.spent("alice", "d").epsilon
        cur.execute(sql)
        got = dict(cur.fetchall())
        clamps = _clamps(cur.messages)
        # the big group keeps its tail (its bias would dominate), the small one does not
        assert clamps[0] >= 600 > clamps[1] >= 16
        for g, xs in ((0, big), (1, small)):
            assert got[g] == pytest.approx(float(np.minimum(xs, clamps[g]).mean()))
        # charged once: the query's ε (the first also its histogram's share), nothing more
        assert ledger.spent("alice", "d").epsilon - spent == pytest.approx(EPS)
    service.close()


class _Recording(SeededNoise):
    """Seeded noise that records the scale and size of every discrete Laplace draw and of every
    staircase draw (its scale: period / ε, the mechanism's Δ/ε), not the empty ones of the
    drawability check before the charge."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.draws: list[tuple[float, int]] = []

    def discrete_laplace(self, scale: float, size: int) -> np.ndarray:
        if size:
            self.draws.append((float(scale), int(size)))
        return super().discrete_laplace(scale, size)

    def discrete_staircase(self, epsilon: float, period: int, step: int, size: int) -> np.ndarray:
        if size:
            self.draws.append((period / epsilon, int(size)))
        return super().discrete_staircase(epsilon, period, step, size)


def test_each_groups_sum_is_noised_at_its_own_clamps_scale(tmp_path: Path):
    """Laplace scale of a group's centred SUM, in the answer's units: G·R·h/ε_s with
    h = hi − ⌊hi/2⌋ (the half-width of [0, hi] on integers, R = G = 1 here) and ε_s the plan's
    SUM share, the same ε for every group; each class's draw is of that scale. A run noising
    every group at one clamp's scale (or at a smaller one) fails."""
    noise = _Recording(7)
    service = dpsql.Service(_setup(tmp_path), ledger=MemoryLedger(), noise=noise)
    cur = service.connect("alice").cursor()
    cur.execute(SQL)
    cur.fetchall()
    cur.execute(f"EXPLAIN {LATER}")
    rows = cur.fetchall()
    (eps_sum,) = [r[6] for r in rows if r[1] == "sum(x)"]
    (eps_count,) = [r[6] for r in rows if r[0] == "AVG(x)" and r[1] != "sum(x)"]
    noise.draws.clear()
    with mock.patch.object(group_clamps, "release", wraps=group_clamps.release) as spy:
        cur.execute(LATER)
        cur.fetchall()
    clamps = _clamps(cur.messages)
    assert clamps[0] != clamps[1]
    released = {}
    for call in spy.call_args_list:
        plan = call.args[0]
        (m,) = [m for m in plan.measures if m.kind == "sum"]
        released[float(plan.query.table.columns["x"].upper)] = m
    assert set(released) == set(clamps.values())  # one release per clamp, at that clamp
    for hi, m in released.items():
        h = int(hi) - int(hi) // 2
        assert m.mechanism.scale * m.unit == pytest.approx(h / eps_sum, rel=1e-9)
        assert (m.mechanism.scale, 2) in noise.draws  # drawn at that scale
    # the count: drawn once, for both groups, before any sum
    counts = [(s, n) for s, n in noise.draws if math.isclose(s, 1 / eps_count, rel_tol=1e-9)]
    assert len(counts) == 1 and counts[0][1] == 2 and noise.draws[0] == counts[0]
    service.close()


def test_explain_says_which_clamps_are_chosen_per_group(tmp_path: Path):
    service = dpsql.Service(_setup(tmp_path), ledger=MemoryLedger(), noise=ZeroNoise())
    cur = service.connect("alice").cursor()

    def clamp_rows(sql: str) -> list[str]:
        cur.execute(f"EXPLAIN {sql}")
        return [r[1] for r in cur.fetchall() if r[0] == "clamp"]

    (before,) = clamp_rows(SQL)  # the histogram not bought yet: what the run will do
    assert "x is chosen per g group at run time" in before and "count" in before
    cur.execute(SQL)
    cur.fetchall()
    assert clamp_rows(LATER) == [before]
    assert clamp_rows("SELECT AVG(x) FROM t") == []
    assert clamp_rows("SELECT g, SUM(x) FROM t GROUP BY g") == []
    declared = dpsql.Service(_setup(tmp_path, "declared"), ledger=MemoryLedger())
    cur = declared.connect("alice").cursor()
    cur.execute(f"EXPLAIN {SQL}")
    assert [r for r in cur.fetchall() if r[0] == "clamp"] == []
    declared.close()
    service.close()


def test_at_most_max_classes_distinct_clamps():
    rng = np.random.default_rng(3)
    err = rng.random((40, 30))
    chosen = group_clamps.classes(err, group_clamps.MAX_CLASSES)
    assert len(set(chosen.tolist())) <= group_clamps.MAX_CLASSES
    few = err[:3]
    assert group_clamps.classes(few, 4).tolist() == np.argmin(few, axis=1).tolist()


def test_intervals_at_another_level_hold_each_groups_value(tmp_path: Path):
    """At 99% the intervals are widened from the 95% ones and cut to the declared range, not
    to the table-wide clamp the plan states (the big group's clamp lies above it)."""
    service = dpsql.Service(_setup(tmp_path), ledger=MemoryLedger(), noise=SeededNoise(11))
    cur = service.connect("alice").cursor()
    cur.execute(SQL)
    cur.fetchall()
    cur.execute(f"EXPLAIN {LATER}")
    (planned_hi,) = {
        float(m.group(1))
        for r in cur.fetchall()
        if (m := re.search(r"clamp of x to \[0, ([0-9.e+]+)\]", str(r[1])))
    }
    cur.execute("SET confidence = 0.99")
    cur.execute(LATER)
    rows = cur.fetchall()
    spans = [span for _, span in cur.intervals]
    assert _clamps(cur.messages)[0] > planned_hi  # the case the test is for
    assert rows[0][1] > planned_hi
    for (_, value), (lo, hi) in zip(rows, spans, strict=True):
        assert lo <= value <= hi <= 1000
    service.close()


def test_keys_released_by_thresholding_keep_one_clamp(tmp_path: Path):
    """Without a public domain the groups are not known before the release: one clamp, and
    the notes and EXPLAIN say that one (none says "per group")."""
    policy = _setup(tmp_path)
    policy["tables"]["t"]["columns"]["g"].pop("values")
    policy["privacy"]["delta"] = 1e-5
    service = dpsql.Service(policy, ledger=MemoryLedger(), noise=ZeroNoise())
    cur = service.connect("alice").cursor()
    for sql in (SQL, LATER):
        cur.execute(f"EXPLAIN {sql}")
        assert [r for r in cur.fetchall() if r[0] == "clamp"] == []
        cur.execute(sql)
        cur.fetchall()
        notes = [m for _, m in cur.messages]
        assert not any("per group" in m for m in notes)
    assert any(re.search(r"x clamped to \[0, [0-9.e+]+\]", m) for m in notes)
    service.close()


def test_a_class_plan_that_would_charge_otherwise_keeps_the_planned_range(tmp_path: Path):
    """Defence in depth (never seen: the split does not read the bounds): a class whose plan
    differs from the charged one in anything but its clamp is released at the planned
    table-wide range, and the note says that range."""
    big, small = _values()
    service = dpsql.Service(_setup(tmp_path), ledger=MemoryLedger(), noise=ZeroNoise())
    cur = service.connect("alice").cursor()
    cur.execute(SQL)
    cur.fetchall()
    cur.execute(f"EXPLAIN {LATER}")
    (planned_hi,) = {
        float(m.group(1))
        for r in cur.fetchall()
        if (m := re.search(r"clamp of x to \[0, ([0-9.e+]+)\]", str(r[1])))
    }
    with mock.patch.object(group_clamps, "_same_charge", return_value=False):
        cur.execute(LATER)
        got = dict(cur.fetchall())
    assert _clamps(cur.messages) == {0: planned_hi, 1: planned_hi}
    for g, xs in ((0, big), (1, small)):
        assert got[g] == pytest.approx(float(np.minimum(xs, planned_hi).mean()))
    service.close()
