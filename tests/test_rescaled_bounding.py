"""bounding = "scale": a (unit, group) pair over R rows counts R/n of every row.

The claims (dpsql.plan.values's docstring, docs/mechanisms.md "Rescaled bounding"), each a test:

- the engine computes exactly Σ over pairs of trunc(v · M · min(n, R) / n), M the measure's
  fine grid (a Python reference over the raw rows);
- one unit moves each group's exact measure by at most per_group_bound and all groups by at most
  l1 / l2 (removing a unit from the data), and a worst-case unit reaches the bound exactly;
- a rescaling that keeps more than R rows' worth is caught by the same neighbour check;
- its expectation is sampling's (the mean of the sampled sum over many secrets), with no
  sampling variance;
- the released values and intervals are in the answer's units (the fine grid divided out).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import exact_connect, rows_of, table_policy, write_csv

from dpsql.frontend.bind import parse_statement
from dpsql.lower import bounding
from dpsql.lower import compile as compile_module
from dpsql.lower.compile import compile_plan
from dpsql.pipeline import Settings
from dpsql.plan.values import ROUNDING_MULTIPLIER

R = 3
DEPTS = ["a", "b", "c"]
COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "dept": {"type": "text", "values": DEPTS, "nullable": False},
    "age": {"type": "int", "lower": 0, "upper": 90},  # nullable: COUNT(age) < COUNT(*)
    "day": {"type": "int", "lower": 1, "upper": 28, "nullable": False},
}


def _rows(seed: int = 5) -> list[tuple]:
    rnd = random.Random(seed)
    rows = []
    for uid in range(1, 121):
        for _ in range(rnd.choice([1, 2, 3, 4, 7, 12, 25])):
            age = None if rnd.random() < 0.1 else rnd.randint(-10, 120)  # beyond the bounds too
            rows.append((uid, rnd.choice(DEPTS), age, rnd.randint(1, 28)))
    return rows


def _policy(
    path: Path, groups: int = 3, bounding: str = "scale", small_tables: str = "columns"
) -> dict:
    """``small_tables``: "columns" runs the plans this table allows as column programs
    (dpsql.engine.columnar), "sql" always as the compiled SQL."""
    policy = table_policy(path, COLUMNS, unit="uid", rows=R, groups=groups)
    policy["tables"]["t"]["bounding"] = bounding
    policy["engine"] = {"small_tables": small_tables}
    return policy


def _exact(conn, sql: str, secret: int = 7) -> tuple:
    """(plan, {key: [exact measures]}) of sql, run by the engine with this secret."""
    service = conn.service
    settings = Settings.from_policy(service.policy)
    settings.bias_estimate = "off"  # the answer's measures alone (bias ones: test_bias.py)
    plan = service.plan(parse_statement(sql, service.policy), settings)
    result = service.engine.execute(compile_plan(plan, secret))
    by_key = {
        tuple(k): [int(m[i] or 0) for m in result.measures] for i, k in enumerate(result.key_rows)
    }
    return plan, by_key


def _trunc_div(a: int, b: int) -> int:
    """a / b truncated toward zero, in exact integers (as DuckDB's // on integers)."""
    q = abs(a) // b
    return q if a >= 0 else -q


def _reference(rows: list[tuple], plan, where=lambda r: True) -> dict[tuple, list[int]]:
    """Per dept: Σ_pairs min(n, R) and Σ_pairs trunc(v·M·min(n, R)/n) per value measure; with
    plan.group_scaling (G below the 3 depts) each of a unit's k > G pairs times min(k, G)/k,
    truncated again (counts: trunc(min(n, R)·M·min(k, G)/k)). A count on a fine grid F
    (m.fine > 1) has each unit's shares w rounded by systematic rounding over its depts in
    order: c = (A + U) // F - (A - w + U) // F, A the running sum, U = ((uid mod F) ·
    ROUNDING_MULTIPLIER) mod F (dpsql.plan.values)."""
    pairs: dict[tuple, list[tuple]] = defaultdict(list)
    for r in rows:
        if where(r):
            pairs[(r[0], r[1])].append(r)
    k_of: dict[int, int] = defaultdict(int)
    for uid, _ in pairs:
        k_of[uid] += 1
    G = plan.max_groups
    out: dict[tuple, list[int]] = defaultdict(lambda: [0] * len(plan.measures))
    running: dict[tuple[int, int], int] = defaultdict(int)  # (uid, measure) -> A so far
    for (uid, dept), members in sorted(pairs.items()):  # each unit's depts in key order
        n, k = len(members), k_of[uid]
        for j, m in enumerate(plan.measures):
            grid = m.fine if m.fine > 1 else m.scale
            if m.kind == "rows":
                value = min(n, R)
                if plan.group_scaling:
                    value = _trunc_div(value * grid * min(k, G), k)
            else:
                ages = [min(max(r[2], 0), 90) for r in members if r[2] is not None]
                v = len(ages) if m.kind == "values" else sum(a - m.center for a in ages)
                value = _trunc_div(v * grid * min(n, R), n)
                if plan.group_scaling:
                    value = _trunc_div(value * min(k, G), k)
            if m.fine > 1:
                offset = (uid % m.fine) * ROUNDING_MULTIPLIER % m.fine
                running[(uid, j)] += value
                a = running[(uid, j)]
                value = (a + offset) // m.fine - (a - value + offset) // m.fine
            out[(dept,)][j] += value
    return dict(out)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, list[tuple]]:
    rows = _rows()
    return write_csv(tmp_path_factory.mktemp("scaled") / "t.csv", list(COLUMNS), rows), rows


def test_the_engine_computes_the_rescaled_sums_exactly(data):
    path, rows = data
    conn = exact_connect(_policy(path))
    try:
        sql = "SELECT dept, COUNT(*), SUM(age), COUNT(age) FROM t GROUP BY dept"
        plan, got = _exact(conn, sql)
        assert plan.bounding == "scale" and plan.max_groups == 3  # G covers every bin: no rank
        # rows, sum(age), values: COUNT(age)'s R/n shares on 2^20, rounded per unit to rows
        assert [m.scale for m in plan.measures] == [1, 2**15, 1]
        assert [m.fine for m in plan.measures] == [1, 1, 2**20]
        assert got == _reference(rows, plan)
        plan, got = _exact(conn, sql.replace("GROUP BY", "WHERE day <= 10 GROUP BY"))
        # n is the pair's rows after the WHERE: a pair the filter leaves within R is whole
        assert got == _reference(rows, plan, where=lambda r: r[3] <= 10)
    finally:
        conn.close()


@pytest.mark.parametrize("where", [None, "day <= 10"])
def test_units_over_g_groups_keep_all_of_them_at_g_over_k(data, where):
    """G = 2 below the 3 public depts: every pair counts, times min(k, G)/k (k = the unit's
    pairs after the WHERE); row counts in a fine grid too (a Python reference)."""
    path, rows = data
    conn = exact_connect(_policy(path, groups=2))
    try:
        sql = "SELECT dept, COUNT(*), SUM(age), COUNT(age) FROM t GROUP BY dept"
        if where:
            sql = sql.replace("GROUP BY", f"WHERE {where} GROUP BY")
        plan, got = _exact(conn, sql)
        assert plan.group_scaling and [m.scale for m in plan.measures] == [1, 2**15, 1]
        assert [m.fine for m in plan.measures] == [2**20, 1, 2**20]  # counts: rounded
        keep = (lambda r: r[3] <= 10) if where else (lambda r: True)
        assert got == _reference(rows, plan, where=keep)
    finally:
        conn.close()


def test_released_values_are_in_the_answers_units(data):
    """ZeroNoise: SUM and COUNT(age) come back divided by their fine grid, AVG is their ratio,
    and COUNT(age)'s interval is its fine noise half-width over its scale."""
    path, _ = data
    conn = exact_connect(_policy(path))
    try:
        sql = "SELECT dept, COUNT(age), SUM(age), AVG(age) FROM t GROUP BY dept"
        plan, exact = _exact(conn, sql)
        cur = conn.cursor()
        cur.execute("SET bias_estimate = off")  # _exact's plan (the bias measures: test_bias)
        cur.execute(sql)
        released = {r[0]: r[1:] for r in cur.fetchall()}
        count, total = plan.measure("m0"), plan.measure("m1")
        for (dept,), (c, s) in exact.items():
            n_released, s_released, avg = released[dept]
            assert n_released == round(c / count.scale)
            assert s_released == round(
                (s + total.center * c * total.scale / count.scale) / total.scale
            )
            assert avg == pytest.approx(total.center + (s / total.scale) / (c / count.scale))
        # COUNT(age)'s interval is its noise half-width in fine units over the fine grid:
        # the sampled plan's half-width in rows (to within a fine unit)
        cur.execute(sql)
        rows = cur.fetchall()
        half = count.mechanism.interval_halfwidth() / count.scale
        for row, ivs in zip(rows, cur.intervals, strict=True):
            # COUNT: the value rounded, its interval rounded outward to whole rows
            assert ivs[1][1] == float(int(ivs[1][1])) and abs(ivs[1][1] - row[1] - half) <= 1.5
        sampled = exact_connect(_policy(path, bounding="sample"))
        try:
            plan_s, _ = _exact(sampled, sql)
            assert plan_s.measure("m0").mechanism.interval_halfwidth() == pytest.approx(half, abs=1)
        finally:
            sampled.close()
    finally:
        conn.close()


# -- neighbouring datasets -----------------------------------------------------------------


def _moves(full: dict, less: dict, j: int) -> list[int]:
    return [abs(full.get(k, [0] * (j + 1))[j] - less.get(k, [0] * (j + 1))[j]) for k in full]


def _check_neighbours(
    tmp_path: Path, rows: list[tuple], sql: str, groups: int, small_tables: str = "columns"
) -> list[tuple]:
    """Remove each unit in turn (the heavy ones): every exact measure moves by at most its
    declared per-group bound, and by at most l1 (L1) and l2 (L2) over all groups. Returns the
    largest moves seen per measure (per group, L1)."""
    full_conn = exact_connect(
        _policy(
            write_csv(tmp_path / "full.csv", list(COLUMNS), rows), groups, "scale", small_tables
        )
    )
    seen = []
    try:
        plan, full = _exact(full_conn, sql)
        worst = [(0, 0)] * len(plan.measures)
        over_r = sorted({r[0] for r in rows if sum(x[0] == r[0] for x in rows) > R})
        heavy = [999, *over_r[:5]] if 999 in over_r else over_r[:6]
        for uid in heavy:
            less_rows = [r for r in rows if r[0] != uid]
            path = write_csv(tmp_path / f"less{uid}.csv", list(COLUMNS), less_rows)
            conn = exact_connect(_policy(path, groups, "scale", small_tables))
            try:
                _, less = _exact(conn, sql)
            finally:
                conn.close()
            for j, m in enumerate(plan.measures):
                moves = _moves(full, less, j)
                assert max(moves) <= m.per_group_bound, (uid, m.kind, max(moves))
                assert sum(moves) <= m.l1 + 1e-9, (uid, m.kind, sum(moves))
                assert math.sqrt(sum(x * x for x in moves)) <= m.l2 + 1e-6, (uid, m.kind)
                worst[j] = (max(worst[j][0], max(moves)), max(worst[j][1], sum(moves)))
        seen = worst
    finally:
        full_conn.close()
    return seen


def _worst_rows() -> list[tuple]:
    """Background units, and unit 999: 20 rows at age 90 in each of the three depts (n > R,
    the top of the range: its rescaled share is exactly R rows at the bound)."""
    rows = [r for r in _rows(9) if r[0] <= 40]
    rows += [(999, d, 90, 1) for d in DEPTS for _ in range(20)]
    return rows


@pytest.mark.parametrize("small_tables", ["columns", "sql"])
@pytest.mark.parametrize(
    "sql",
    [
        "SELECT dept, COUNT(*), SUM(age), COUNT(age) FROM t GROUP BY dept",
        "SELECT COUNT(*), SUM(age), AVG(age), VAR_POP(age) FROM t",
        "SELECT dept, SUM(age) FROM t WHERE day > 3 GROUP BY dept",
    ],
)
def test_one_unit_moves_each_measure_within_its_sensitivity(tmp_path, sql, small_tables):
    _check_neighbours(tmp_path, _worst_rows(), sql, groups=2, small_tables=small_tables)


@pytest.mark.parametrize("bounding", ["scale", "sample"])
def test_the_worst_case_unit_reaches_the_bound(tmp_path, bounding):
    """Unit 999 has 20 rows at the bound in each of its 3 depts (uncentred SUM: its bound is
    90), G = 2. Sampled, removing it moves SUM(age) by exactly R · 90 in the 2 groups it keeps;
    rescaled, by 2/3 of that in each of its 3 groups: the same L1, G · R · 90 (fine units)."""
    rows = _worst_rows()
    less_rows = [r for r in rows if r[0] != 999]
    full = exact_connect(
        _policy(write_csv(tmp_path / "f.csv", list(COLUMNS), rows), 2, bounding=bounding)
    )
    less = exact_connect(
        _policy(write_csv(tmp_path / "l.csv", list(COLUMNS), less_rows), 2, bounding=bounding)
    )
    try:
        sql = "SELECT dept, SUM(age) FROM t GROUP BY dept"
        plan, a = _exact(full, sql)
        _, b = _exact(less, sql)
        (m,) = plan.measures
        moves = sorted(abs(a[k][0] - b.get(k, [0])[0]) for k in a)
        bound = m.per_group_bound
        assert bound == R * 90 * m.scale and sum(moves) == m.l1
        if bounding == "sample":
            assert moves == [0, bound, bound]  # G = 2 of its 3 groups, chosen by keyed hash
        else:
            assert plan.group_scaling and moves == [bound * 2 // 3] * 3  # all 3, at G/k = 2/3
    finally:
        full.close()
        less.close()


def test_a_rescaling_that_keeps_more_than_r_rows_is_caught(tmp_path, monkeypatch):
    """The deliberately broken mechanism: R + 1 rows' worth per pair. The neighbour check
    above must fail on it (else it could not catch a real mistake)."""
    original = bounding.scaled_partial

    def broken(m, r, n):
        return original(m, r + 1, n)

    monkeypatch.setattr(bounding, "scaled_partial", broken)
    with pytest.raises(AssertionError):
        _check_neighbours(tmp_path, _worst_rows(), "SELECT SUM(age) FROM t", 2, "sql")


def test_a_column_program_that_keeps_more_than_r_rows_is_caught(tmp_path, monkeypatch):
    """The same broken mechanism in a column program (dpsql.engine.columnar): R + 1 rows'
    worth per pair; the neighbour check must fail on it too."""
    original = compile_module.column_program

    def broken(plan):
        program = original(plan)
        return None if program is None else dataclasses.replace(program, max_rows=R + 1)

    monkeypatch.setattr(compile_module, "column_program", broken)
    with pytest.raises(AssertionError):
        _check_neighbours(tmp_path, _worst_rows(), "SELECT SUM(age) FROM t", 2, "columns")


# -- utility: sampling's expectation, no sampling variance ---------------------------------


def test_expectation_is_samplings_without_its_variance(data):
    """Over 300 secrets the sampled SUM(age) averages to the rescaled one (within 4 standard
    errors of the mean, plus 1 for the truncation), and varies; the rescaled one does not."""
    path, _ = data
    sampled = exact_connect(_policy(path, bounding="sample"))
    scaled = exact_connect(_policy(path, bounding="scale"))
    try:
        sql = "SELECT SUM(age) FROM t"
        plan, got = _exact(scaled, sql)
        (m,) = plan.measures
        target = got[()][0] / m.scale
        assert len({_exact(scaled, sql, s)[1][()][0] for s in range(5)}) == 1
        draws = [_exact(sampled, sql, s)[1][()][0] for s in range(300)]
        mean = sum(draws) / len(draws)
        sd = math.sqrt(sum((d - mean) ** 2 for d in draws) / (len(draws) - 1))
        assert sd > 0
        assert abs(mean - target) <= 4 * sd / math.sqrt(len(draws)) + 1, (mean, target, sd)
    finally:
        sampled.close()
        scaled.close()


def test_explain_says_how_pairs_over_r_are_bounded(data):
    path, _ = data
    conn = exact_connect(_policy(path))
    try:
        text = "\n".join(
            r[0]
            for r in rows_of(
                conn, "EXPLAIN (FORMAT TEXT) SELECT dept, SUM(age) FROM t GROUP BY dept"
            )
        )
        assert "R/n" in text and "over-R groups rescaled to R rows" in text
    finally:
        conn.close()
