"""Exactness: with noise switched off, released aggregates equal hand-written reference SQL.

The reference runs directly in DuckDB on the same CSV. Where no unit exceeds its bounds the
choice of kept rows cannot matter, so the bounded aggregate must equal the plain one (with
values clamped to the declared bounds). Separate tests give units more rows and groups than
allowed and check that each then contributes exactly R rows to each of at most G groups.
"""

from __future__ import annotations

import datetime as dt
import random
from pathlib import Path

import duckdb
import pytest
from conftest import (
    CLAMP_MACRO,
    GRP5,
    EngineSpy,
    assert_same_rows,
    exact_connect,
    fixture_policy,
    heavy_policy,
    rows_of,
    table_policy,
    write_csv,
)

import dpsql

GROUPS = ["a", "b", "c", "d"]
NAMES = ["alpha", "beta"]

COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "grp": {"type": "text", "values": GROUPS, "nullable": True},  # NULL: a released bin
    "age": {"type": "int", "lower": 0, "upper": 90, "nullable": False},  # data goes to 99
    "score": {"type": "float", "lower": -10.0, "upper": 10.0, "granularity": 0.01},
    "flag": {"type": "bool", "nullable": False},
    "name": {"type": "text"},  # no public domain: thresholded
    "day": {"type": "date", "nullable": False},
}
HEADER = list(COLUMNS)


def _clean_rows(seed: int = 7) -> list[tuple]:
    """400 units with 1-3 rows each: with R = G = 3 no bound ever binds."""
    rnd = random.Random(seed)
    rows = []
    for uid in range(1, 401):
        for _ in range(rnd.randint(1, 3)):
            rows.append(
                (
                    uid,
                    None if rnd.random() < 0.1 else rnd.choice(GROUPS),
                    rnd.randint(0, 99),
                    None if rnd.random() < 0.1 else round(rnd.uniform(-12, 12), 2),
                    rnd.random() < 0.4,
                    rnd.choice(NAMES),
                    (dt.date(2024, 1, 1) + dt.timedelta(days=rnd.randint(0, 365))).isoformat(),
                )
            )
    rows.append((401, "a", 50, 1.0, True, "zeta", "2024-03-03"))  # a name held by one unit
    return rows


def clean_pair(directory: Path) -> tuple[dpsql.Connection, duckdb.DuckDBPyConnection]:
    """The clean data (no unit exceeds R = G = 3) behind a noise-off connection, and the same
    CSV as a plain DuckDB table ``t`` with the clamp macro, for hand-written references."""
    path = write_csv(directory / "t.csv", HEADER, _clean_rows())
    conn = exact_connect(table_policy(path, COLUMNS, unit="uid", rows=3, groups=3))
    ref = duckdb.connect()
    ref.execute(
        "CREATE TABLE t AS SELECT CAST(uid AS BIGINT) uid, grp, CAST(age AS BIGINT) age, "
        'CAST(score AS DOUBLE) score, CAST(flag AS BOOLEAN) flag, name, CAST(day AS DATE) AS "day" '
        f"FROM read_csv('{path}', header = true, all_varchar = true)"
    )
    ref.execute(CLAMP_MACRO)
    return conn, ref


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    conn, ref = clean_pair(tmp_path_factory.mktemp("clean"))
    yield conn, ref
    conn.close()
    ref.close()


S = "cl(score, -10.0, 10.0)"
A = "cl(age, 0, 90)"

CASES = [
    ("SELECT COUNT(*) FROM t", "SELECT COUNT(*) FROM t"),
    ("SELECT COUNT(score) FROM t", "SELECT COUNT(score) FROM t"),
    ("SELECT COUNT(grp) FROM t", "SELECT COUNT(grp) FROM t"),
    ("SELECT COUNT(DISTINCT uid) FROM t", "SELECT COUNT(DISTINCT uid) FROM t"),
    ("SELECT SUM(age) FROM t", f"SELECT SUM({A}) FROM t"),
    ("SELECT SUM(score) FROM t", f"SELECT SUM({S}) FROM t"),
    ("SELECT AVG(score) FROM t", f"SELECT AVG({S}) FROM t"),
    ("SELECT AVG(age) FROM t", f"SELECT AVG({A}) FROM t"),
    ("SELECT VAR_SAMP(score) FROM t", f"SELECT VAR_SAMP({S}) FROM t"),
    ("SELECT VAR_POP(score) FROM t", f"SELECT VAR_POP({S}) FROM t"),
    ("SELECT STDDEV(score) FROM t", f"SELECT STDDEV_SAMP({S}) FROM t"),
    ("SELECT STDDEV_POP(age) FROM t", f"SELECT STDDEV_POP({A}) FROM t"),
    ("SELECT VARIANCE(age) FROM t", f"SELECT VAR_SAMP({A}) FROM t"),
    # WHERE: comparisons, IN, BETWEEN, LIKE, IS NULL, AND/OR/NOT (on raw, unclamped values)
    ("SELECT COUNT(*) FROM t WHERE age > 30", "SELECT COUNT(*) FROM t WHERE age > 30"),
    ("SELECT COUNT(*) FROM t WHERE age <> 30", "SELECT COUNT(*) FROM t WHERE age <> 30"),
    (
        "SELECT COUNT(*), SUM(score) FROM t WHERE age IN (1, 2, 3, 50, 95)",
        f"SELECT COUNT(*), SUM({S}) FROM t WHERE age IN (1, 2, 3, 50, 95)",
    ),
    (
        "SELECT COUNT(*) FROM t WHERE age BETWEEN 20 AND 40",
        "SELECT COUNT(*) FROM t WHERE age BETWEEN 20 AND 40",
    ),
    (
        "SELECT COUNT(*) FROM t WHERE name LIKE 'al%'",
        "SELECT COUNT(*) FROM t WHERE name LIKE 'al%'",
    ),
    ("SELECT COUNT(*) FROM t WHERE score IS NULL", "SELECT COUNT(*) FROM t WHERE score IS NULL"),
    (
        "SELECT COUNT(*) FROM t WHERE score IS NOT NULL AND flag",
        "SELECT COUNT(*) FROM t WHERE score IS NOT NULL AND flag",
    ),
    (
        "SELECT COUNT(*) FROM t WHERE age < 10 OR age > 80",
        "SELECT COUNT(*) FROM t WHERE age < 10 OR age > 80",
    ),
    ("SELECT COUNT(*) FROM t WHERE NOT flag", "SELECT COUNT(*) FROM t WHERE NOT flag"),
    (
        "SELECT AVG(score) FROM t WHERE grp = 'a' AND NOT (age < 50)",
        f"SELECT AVG({S}) FROM t WHERE grp = 'a' AND NOT (age < 50)",
    ),
    (
        "SELECT COUNT(*) FROM t WHERE day >= DATE '2024-07-01'",
        "SELECT COUNT(*) FROM t WHERE day >= DATE '2024-07-01'",
    ),
    (
        "SELECT COUNT(*) FROM t WHERE grp IS NULL OR grp IN ('b', 'c')",
        "SELECT COUNT(*) FROM t WHERE grp IS NULL OR grp IN ('b', 'c')",
    ),
    # GROUP BY a public column (nullable: the NULL group is released)
    (
        "SELECT grp, COUNT(*), SUM(score), AVG(age) FROM t GROUP BY grp",
        f"SELECT grp, COUNT(*), SUM({S}), AVG({A}) FROM t GROUP BY grp",
    ),
    (
        "SELECT grp, COUNT(DISTINCT uid), COUNT(score) FROM t GROUP BY grp",
        "SELECT grp, COUNT(DISTINCT uid), COUNT(score) FROM t GROUP BY grp",
    ),
    ("SELECT flag, COUNT(*) FROM t GROUP BY flag", "SELECT flag, COUNT(*) FROM t GROUP BY flag"),
    (
        "SELECT grp, flag, COUNT(*) FROM t GROUP BY grp, flag",
        "SELECT grp, flag, COUNT(*) FROM t GROUP BY grp, flag",
    ),
    # public binning: rows with age outside [0, 90] are outside the domain and dropped
    (
        "SELECT FLOOR(age / 10) * 10 AS decade, COUNT(*), AVG(score) FROM t GROUP BY decade",
        f"SELECT FLOOR(age / 10) * 10, COUNT(*), AVG({S}) FROM t "
        "WHERE age BETWEEN 0 AND 90 GROUP BY 1",
    ),
    (
        "SELECT FLOOR(age / 10) * 10, COUNT(*) FROM t GROUP BY FLOOR(age / 10) * 10",
        "SELECT FLOOR(age / 10) * 10, COUNT(*) FROM t WHERE age <= 90 GROUP BY 1",
    ),
    (
        "SELECT CASE WHEN age < 30 THEN 'young' WHEN age < 60 THEN 'mid' ELSE 'old' END AS band, "
        "COUNT(*) FROM t GROUP BY 1",
        "SELECT CASE WHEN age < 30 THEN 'young' WHEN age < 60 THEN 'mid' ELSE 'old' END, "
        "COUNT(*) FROM t GROUP BY 1",
    ),
    # post-processing: HAVING, ORDER BY, LIMIT, arithmetic, aliases, ordinals
    (
        "SELECT grp, COUNT(*) AS n FROM t GROUP BY grp HAVING COUNT(*) > 150",
        "SELECT grp, COUNT(*) FROM t GROUP BY grp HAVING COUNT(*) > 150",
    ),
    (
        "SELECT grp AS g, SUM(score) / COUNT(*) AS ratio FROM t GROUP BY g",
        f"SELECT grp, SUM({S}) / COUNT(*) FROM t GROUP BY grp",
    ),
    (
        "SELECT COUNT(*) * 2 + 1 AS x, SUM(age) - COUNT(age) FROM t",
        f"SELECT COUNT(*) * 2 + 1, SUM({A}) - COUNT(age) FROM t",
    ),
    (
        "SELECT UPPER(grp), COUNT(*) FROM t WHERE grp IS NOT NULL GROUP BY grp",
        # the WHERE on the key's own column removes the NULL bin from its public domain
        "SELECT UPPER(grp), COUNT(*) FROM t WHERE grp IS NOT NULL GROUP BY grp",
    ),
]


@pytest.mark.parametrize(("dp_sql", "ref_sql"), CASES, ids=[c[0][:70] for c in CASES])
def test_matches_reference(clean, dp_sql, ref_sql):
    conn, ref = clean
    assert_same_rows(rows_of(conn, dp_sql), ref.execute(ref_sql).fetchall(), rel=1e-7)


ORDERED = [
    (
        "SELECT grp, COUNT(*) FROM t GROUP BY grp ORDER BY grp LIMIT 3",
        "SELECT grp, COUNT(*) FROM t GROUP BY grp ORDER BY grp LIMIT 3",
    ),
    (
        "SELECT grp, COUNT(*) AS n FROM t GROUP BY 1 ORDER BY n DESC, grp",
        "SELECT grp, COUNT(*) AS n FROM t GROUP BY 1 ORDER BY n DESC, grp",
    ),
    (
        "SELECT FLOOR(age / 10) * 10 AS d, COUNT(*) FROM t GROUP BY d ORDER BY d DESC LIMIT 4",
        "SELECT FLOOR(age / 10) * 10 AS d, COUNT(*) FROM t WHERE age <= 90 GROUP BY d "
        "ORDER BY d DESC LIMIT 4",
    ),
    (
        "SELECT grp, COUNT(*) FROM t GROUP BY grp ORDER BY grp LIMIT 2 OFFSET 1",
        "SELECT grp, COUNT(*) FROM t GROUP BY grp ORDER BY grp LIMIT 2 OFFSET 1",
    ),
]


@pytest.mark.parametrize(("dp_sql", "ref_sql"), ORDERED, ids=[c[0][:70] for c in ORDERED])
def test_ordered_post_processing(clean, dp_sql, ref_sql):
    conn, ref = clean
    assert_same_rows(rows_of(conn, dp_sql), ref.execute(ref_sql).fetchall(), ordered=True)


def test_public_bins_include_empty_ones(clean):
    """Every declared value is released, including values no row has (count 0)."""
    conn, _ = clean
    sql = "SELECT grp, COUNT(*) FROM t WHERE age < 3 GROUP BY grp"
    got = dict(rows_of(conn, sql))
    assert set(got) == {"a", "b", "c", "d", None}
    # integer range domain: age 0..90 is 91 bins, all released
    ages = rows_of(conn, "SELECT age, COUNT(*) FROM t WHERE flag AND score > 100 GROUP BY age")
    assert [a for a, _ in ages] == list(range(91))
    assert all(n == 0 for _, n in ages)
    # a WHERE over the key's own column filters its bins as it filters rows (query text only)
    ages = rows_of(conn, "SELECT age, COUNT(*) FROM t WHERE age < 5 GROUP BY age")
    assert [a for a, _ in ages] == list(range(5))
    got = dict(
        rows_of(conn, "SELECT grp, COUNT(*) FROM t WHERE grp = 'a' OR grp = 'b' GROUP BY grp")
    )
    assert set(got) == {"a", "b"}


def test_thresholded_group_by_releases_groups_above_tau(clean):
    """GROUP BY a non-public key: with zero noise, exactly the groups with >= tau units."""
    conn, ref = clean
    cur = conn.cursor()
    cur.execute("SET epsilon = 10")
    cur.execute("SET partition_selection = 'threshold'")  # this test is about the τ-threshold
    cur.execute("EXPLAIN SELECT name, COUNT(*) FROM t GROUP BY name")
    tau_row = next(r for r in cur.fetchall() if str(r[1]).startswith("units >= tau"))
    tau = float(tau_row[1].split("=")[-1])
    cur.execute("SELECT name, COUNT(*) FROM t GROUP BY name")
    got = cur.fetchall()
    cur.execute("RESET epsilon")
    units = dict(ref.execute("SELECT name, COUNT(DISTINCT uid) FROM t GROUP BY name").fetchall())
    expected = ref.execute("SELECT name, COUNT(*) FROM t GROUP BY name").fetchall()
    expected = [r for r in expected if units[r[0]] >= tau]
    assert {r[0] for r in expected} == set(NAMES)  # common names pass, 'zeta' does not
    assert_same_rows(got, expected)


# -- the shipped fixture --------------------------------------------------------------------


@pytest.fixture(scope="module")
def loose():
    """The fixture with bounds that never bind (at most 59 visits and 6 departments each)."""
    conn = exact_connect(
        fixture_policy(
            privacy={"budget_epsilon": 1e9},
            table={"max_rows_per_unit": 100, "max_groups_per_unit": 100},
        )
    )
    yield conn
    conn.close()


C = "cl(cost, 0.0, 5000.0)"
FIXTURE_CASES = [
    ("SELECT COUNT(*), COUNT(cost) FROM visits", "SELECT COUNT(*), COUNT(cost) FROM visits"),
    ("SELECT SUM(cost), AVG(cost) FROM visits", f"SELECT SUM({C}), AVG({C}) FROM visits"),
    (
        "SELECT department, COUNT(*), AVG(cost), STDDEV(cost) FROM visits GROUP BY department",
        f"SELECT department, COUNT(*), AVG({C}), STDDEV_SAMP({C}) FROM visits GROUP BY 1",
    ),
    (
        "SELECT smoker, COUNT(DISTINCT patient_id), SUM(age) FROM visits GROUP BY smoker",
        "SELECT smoker, COUNT(DISTINCT patient_id), SUM(age) FROM visits GROUP BY smoker",
    ),
    (
        "SELECT COUNT(*) FROM visits WHERE visit_date BETWEEN DATE '2024-01-01' AND "
        "DATE '2024-06-30' AND department <> 'oncology'",
        "SELECT COUNT(*) FROM visits WHERE visit_date BETWEEN DATE '2024-01-01' AND "
        "DATE '2024-06-30' AND department <> 'oncology'",
    ),
]


@pytest.mark.parametrize(
    ("dp_sql", "ref_sql"), FIXTURE_CASES, ids=[c[0][:60] for c in FIXTURE_CASES]
)
def test_fixture_matches_reference_when_bounds_do_not_bind(loose, visits_ref, dp_sql, ref_sql):
    assert_same_rows(rows_of(loose, dp_sql), visits_ref.execute(ref_sql).fetchall(), rel=1e-7)


def test_fixture_count_keeps_at_most_r_rows_per_patient(visits, visits_ref):
    """R = 5: COUNT(*) = sum over patients of min(visits, 5), also under a WHERE filter."""
    for where in ("", "WHERE department = 'cardiology'", "WHERE cost > 300"):
        (expected,) = visits_ref.execute(
            f"SELECT SUM(LEAST(n, 5)) FROM (SELECT patient_id, COUNT(*) n FROM visits {where} "
            "GROUP BY 1)"
        ).fetchone()
        assert rows_of(visits, f"SELECT COUNT(*) FROM visits {where}") == [(expected,)]


def test_fixture_group_by_patient_constant_key(visits, visits_ref):
    """Age and smoker are constant per patient, so G never binds: min(n, R) per bin."""
    got = rows_of(
        visits, "SELECT smoker, FLOOR(age / 10) AS d, COUNT(*) FROM visits GROUP BY smoker, d"
    )
    expected = visits_ref.execute(
        "SELECT smoker, d, SUM(LEAST(n, 5)) FROM (SELECT patient_id, smoker, FLOOR(age / 10) d, "
        "COUNT(*) n FROM visits GROUP BY ALL) GROUP BY ALL"
    ).fetchall()
    got = [r for r in got if r[2] != 0 or (r[0], r[1]) in {(e[0], e[1]) for e in expected}]
    assert_same_rows(got, expected)


# -- bounds that bind -----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["sample", "scale"])
def heavy(request, tmp_path_factory):
    """Both boundings: every figure below holds for R sampled rows and for R/n of n rows."""
    policy, groups_of = heavy_policy(tmp_path_factory.mktemp("heavy"))
    policy["tables"]["t"]["bounding"] = request.param
    conn = exact_connect(policy)
    yield conn, groups_of
    conn.close()


def test_each_unit_contributes_exactly_r_rows(heavy):
    conn, _ = heavy
    assert rows_of(conn, "SELECT COUNT(*), COUNT(DISTINCT uid) FROM t") == [(100, 50)]
    expected_sum = sum(2 * min(uid % 11, 8) for uid in range(1, 51))
    assert rows_of(conn, "SELECT SUM(val) FROM t") == [(expected_sum,)]


def test_each_unit_contributes_r_rows_to_at_most_g_groups(heavy):
    conn, groups_of = heavy
    if conn.service.policy.tables["t"].bounding == "scale":
        pytest.skip("rescaled, a unit keeps all its groups at G/k: tests/test_rescaled_bounding.py")
    # one query, so counts and units come from the same kept rows and groups
    result = rows_of(conn, "SELECT grp, COUNT(*), COUNT(DISTINCT uid) FROM t GROUP BY grp")
    counts = {g: n for g, n, _ in result}
    units = {g: u for g, _, u in result}
    assert sum(counts.values()) == 50 * 3 * 2  # every unit: 3 groups x 2 rows
    assert sum(units.values()) == 50 * 3
    for g in GRP5:
        holders = sum(g in gs for gs in groups_of.values())
        assert units[g] <= holders
        assert counts[g] == 2 * units[g]  # each kept (unit, group) keeps exactly R rows
    total = sum(v for _, v in rows_of(conn, "SELECT grp, SUM(val) FROM t GROUP BY grp"))
    assert total == sum(3 * 2 * min(uid % 11, 8) for uid in range(1, 51))


def test_kept_rows_change_with_a_fresh_secret_per_query(heavy):
    """Which R rows a unit keeps is a keyed hash with a new secret each query (not fixed);
    rescaled, every row counts R/n: the same exact sum every time."""
    conn, _ = heavy
    spy = EngineSpy(conn.service)
    sums = {rows_of(conn, "SELECT SUM(i) FROM t")[0][0] for _ in range(12)}
    assert len(sums) == 1 if conn.service.policy.tables["t"].bounding == "scale" else len(sums) > 1
    assert all("random" not in sql.lower() for sql in spy.sql)
    if conn.service.policy.tables["t"].bounding == "sample":
        assert len({sql for sql in spy.sql}) == len(spy.sql)  # the secret differs every time


def test_row_level_table_needs_no_bounding(tmp_path: Path):
    rows = [(i % 7, float(i) / 4) for i in range(200)]
    path = write_csv(tmp_path / "r.csv", ["k", "x"], rows)
    cols = {
        "k": {"type": "int", "lower": 0, "upper": 6, "nullable": False},
        "x": {"type": "float", "lower": 0, "upper": 40},
    }
    with exact_connect(table_policy(path, cols)) as conn:
        got = rows_of(conn, "SELECT k, COUNT(*), SUM(x), AVG(x) FROM t GROUP BY k")
    ref = duckdb.connect()
    expected = ref.execute(
        f"SELECT k::BIGINT, COUNT(*), SUM(LEAST(x::DOUBLE, 40)), AVG(LEAST(x::DOUBLE, 40)) "
        f"FROM read_csv('{path}') GROUP BY 1"
    ).fetchall()
    assert_same_rows(got, expected)


def test_thresholded_keys_of_other_types(tmp_path: Path):
    """Non-public keys of DECIMAL, DATE and BOOLEAN type round-trip through the answer cache."""
    rows = [(i % 3, f"2024-0{1 + i % 3}-01") for i in range(300)]
    path = write_csv(tmp_path / "k.csv", ["x", "d"], rows)
    cols = {"x": {"type": "int"}, "d": {"type": "date"}}
    with exact_connect(table_policy(path, cols, privacy={"epsilon": 50.0})) as conn:
        got = rows_of(conn, "SELECT x * 1.5 AS k, COUNT(*) FROM t GROUP BY k ORDER BY k")
        assert got == [(0.0, 100), (1.5, 100), (3.0, 100)]
        got = rows_of(conn, "SELECT d, COUNT(*) FROM t GROUP BY d ORDER BY d")
        assert got == [(dt.date(2024, m, 1), 100) for m in (1, 2, 3)]
        got = rows_of(conn, "SELECT x > 0 AS k, COUNT(*) FROM t GROUP BY k ORDER BY k")
        assert got == [(False, 100), (True, 200)]


def test_fixture_thresholded_diagnosis(loose, visits_ref):
    """GROUP BY the non-public diagnosis: exactly the codes held by >= tau patients, exact."""
    cur = loose.cursor()
    cur.execute("SET epsilon = 100")  # tau ~ 37 units: among the rare codes (30-45 units)
    cur.execute("SET partition_selection = 'threshold'")  # this test is about the τ-threshold
    try:
        cur.execute("EXPLAIN SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis")
        tau_row = next(r for r in cur.fetchall() if str(r[1]).startswith("units >= tau"))
        tau = float(tau_row[1].split("=")[-1])
        got = rows_of(loose, "SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis")
    finally:
        cur.execute("RESET epsilon")
        cur.execute("RESET partition_selection")
    units = dict(
        visits_ref.execute(
            "SELECT diagnosis, COUNT(DISTINCT patient_id) FROM visits GROUP BY 1"
        ).fetchall()
    )
    expected = visits_ref.execute("SELECT diagnosis, COUNT(*) FROM visits GROUP BY 1").fetchall()
    expected = [r for r in expected if units[r[0]] >= tau]
    assert 10 < len(expected) < len(units)  # common codes released, some rare ones not
    assert_same_rows(got, expected)


def test_thresholded_groups_are_released_in_a_canonical_order(clean):
    """Without ORDER BY, rows come out sorted by key (NULL last), not in the engine's hash
    order, which depends on every key present, suppressed ones included."""
    conn, _ = clean
    cur = conn.cursor()
    cur.execute("SET epsilon = 10")
    try:
        for sql in (
            "SELECT name, COUNT(*) FROM t GROUP BY name",
            "SELECT grp, name, COUNT(*) FROM t GROUP BY grp, name",
        ):
            keys = [r[:-1] for r in rows_of(conn, sql)]
            assert len(keys) > 1
            assert keys == sorted(keys, key=lambda k: [(v is None, v or "") for v in k])
    finally:
        cur.execute("RESET epsilon")


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_bounding_per_unit_and_group_decoded_from_sums(tmp_path: Path, seed):
    """Each unit u carries v = 4**u, so SUM(v) per group spells out, in base 4, how many rows
    every unit kept there (< 4 since R <= 3). Check, unit by unit: a unit keeps min(n, R) rows
    in each kept group, and keeps min(#groups, G) of its groups, NULL group included."""
    rnd = random.Random(seed)
    R, G = rnd.randint(1, 3), rnd.randint(1, 3)
    rows, n = [], {}
    for uid in range(15):
        for g in rnd.sample(["a", "b", "c", None], rnd.randint(1, 4)):
            n[uid, g] = rnd.randint(1, 6)
            rows += [(uid, g, 4**uid)] * n[uid, g]
    rnd.shuffle(rows)
    path = write_csv(tmp_path / "b.csv", ["uid", "grp", "v"], rows)
    cols = {
        "uid": {"type": "int", "nullable": False},
        "grp": {"type": "text", "values": ["a", "b", "c"], "nullable": True},
        "v": {"type": "int", "lower": 0, "upper": 4**14},
    }
    policy = table_policy(path, cols, unit="uid", rows=R, groups=G)
    policy["tables"]["t"]["bounding"] = "sample"  # rescaled: tests/test_rescaled_bounding.py
    with exact_connect(policy) as conn:
        result = rows_of(conn, "SELECT grp, SUM(v), COUNT(*) FROM t GROUP BY grp")
        (total,) = rows_of(conn, "SELECT SUM(v) FROM t")[0]
    kept = {}
    for g, s, count in result:
        digits = [(s // 4**u) % 4 for u in range(15)]
        assert sum(digits) == count
        kept.update({(u, g): d for u, d in enumerate(digits) if d})
    for uid in range(15):
        mine = {g for (u, g) in n if u == uid}
        chosen = {g for (u, g) in kept if u == uid}
        assert chosen <= mine and len(chosen) == min(len(mine), G)
        assert all(kept[uid, g] == min(n[uid, g], R) for g in chosen)
    # without GROUP BY a unit is one group: min(its rows, R)
    by_unit = {u: sum(c for (w, _), c in n.items() if w == u) for u in range(15)}
    assert total == sum(min(c, R) * 4**u for u, c in by_unit.items())
