"""Public time domains: a date column with declared days (``lower`` / ``upper``) makes its
time buckets public GROUP BY domains.

The days of the declared range are a public relation (dpsql.plan.domains.column_relation), so
any key over the column (the bare day, DATE_TRUNC, EXTRACT / date_part, CAST, strftime, a
shifted week) has the domain its own values over those days take: every bucket is released,
empty ones too, with no threshold and no delta. A row whose date lies outside the declared
days is kept out of every bucket, as a row of an int column outside its declared bounds is.
"""

from __future__ import annotations

import datetime as dt
import random
from pathlib import Path
from typing import Any

import duckdb
import fuzz_grammar as g
import pytest
from conftest import (
    FIXTURE_CSV,
    assert_same_rows,
    budget,
    exact_connect,
    fixture_policy,
    rows_of,
    table_policy,
    write_csv,
)
from hypothesis import given, settings
from test_differential_fuzz import FUZZ, Pair, _closing, _pair, pair_violations, side_violations

import dpsql
from dpsql.errors import PolicyError
from dpsql.policy import load_policy
from dpsql.privacy.ledger import MemoryLedger

FIRST, LAST = dt.date(2024, 1, 1), dt.date(2025, 12, 31)  # fixtures/visits.toml's study period
DAYS = (LAST - FIRST).days + 1

# (key as the analyst writes it, the same key for plain DuckDB)
KEYS = [
    ("visit_date", "visit_date"),
    ("DATE_TRUNC('day', visit_date)", "DATE_TRUNC('day', visit_date)"),
    ("DATE_TRUNC('week', visit_date)", "DATE_TRUNC('week', visit_date)"),
    ("DATE_TRUNC('month', visit_date)", "DATE_TRUNC('month', visit_date)"),
    ("DATE_TRUNC('quarter', visit_date)", "DATE_TRUNC('quarter', visit_date)"),
    ("DATE_TRUNC('year', visit_date)", "DATE_TRUNC('year', visit_date)"),
    ("EXTRACT(year FROM visit_date)", "EXTRACT(year FROM visit_date)"),
    ("EXTRACT(month FROM visit_date)", "EXTRACT(month FROM visit_date)"),
    ("EXTRACT(quarter FROM visit_date)", "EXTRACT(quarter FROM visit_date)"),
    ("EXTRACT(dow FROM visit_date)", "EXTRACT(dow FROM visit_date)"),
    ("EXTRACT(doy FROM visit_date)", "EXTRACT(doy FROM visit_date)"),
    ("EXTRACT(day FROM visit_date)", "EXTRACT(day FROM visit_date)"),
    ("date_part('dow', visit_date)", "date_part('dow', visit_date)"),
    ("date_part('year', visit_date)", "date_part('year', visit_date)"),
    ("CAST(visit_date AS DATE)", "CAST(visit_date AS DATE)"),
    ("strftime(visit_date, '%Y-%m')", "strftime(visit_date, '%Y-%m')"),
    # Grafana's epoch buckets (weeks of seconds since 1970)
    (
        "FLOOR(EXTRACT(epoch FROM visit_date) / 604800)",
        "FLOOR(EXTRACT(epoch FROM visit_date) / 604800)",
    ),
    # Metabase's weeks starting on Sunday
    (
        "DATE_TRUNC('week', visit_date + INTERVAL 1 DAY) - INTERVAL 1 DAY",
        "DATE_TRUNC('week', visit_date + INTERVAL 1 DAY) - INTERVAL 1 DAY",
    ),
    (
        "DATE_TRUNC('week', visit_date + INTERVAL '1 day') - INTERVAL '1 day'",
        "DATE_TRUNC('week', visit_date + INTERVAL 1 DAY) - INTERVAL 1 DAY",
    ),
]


def _policy(**visit_date: Any) -> dict:
    """The fixture's policy with bounds that never bind (at most 59 visits per patient)."""
    policy = fixture_policy(
        privacy={"budget_epsilon": 1e9},
        table={"max_rows_per_unit": 100, "max_groups_per_unit": 100},
    )
    policy["tables"]["visits"]["columns"]["visit_date"].update(visit_date)
    return policy


@pytest.fixture(scope="module")
def loose():
    conn = exact_connect(_policy())
    yield conn
    conn.close()


@pytest.fixture(scope="module")
def wide():
    """The same data under a declared range a month wider on each side: empty buckets."""
    conn = exact_connect(_policy(lower="2023-12-01", upper="2026-01-31"))
    yield conn
    conn.close()


def _explain(conn: dpsql.Connection, sql: str) -> list[tuple]:
    return rows_of(conn, "EXPLAIN " + sql)


def _assert_public(conn: dpsql.Connection, sql: str, bins: int | None = None) -> None:
    """EXPLAIN: the key is a public domain (of ``bins`` bins), no selection, delta 0."""
    rows = _explain(conn, sql)
    plan = "\n".join(str(r[1]) for r in rows if r[0] == "plan")
    assert "(public: " in plan, plan
    if bins is not None:
        assert f"(public: {bins} bins)" in plan, plan
    assert not [r for r in rows if str(r[0]).startswith("GROUP BY")], rows  # no selection
    assert "threshold" not in plan and "selection" not in plan.lower(), plan
    (total,) = [r for r in rows if r[0] == "total"]
    assert total[7] == 0.0  # delta


# -- the policy -----------------------------------------------------------------------------


def test_fixture_declares_the_study_period():
    col = load_policy(fixture_policy()).tables["visits"].columns["visit_date"]
    assert col.date_range == (FIRST, LAST)
    assert (col.lower, col.upper, col.bounded) == (None, None, False)  # no numeric bounds


def test_toml_dates_and_iso_strings_declare_the_same_days(tmp_path: Path):
    write_csv(tmp_path / "t.csv", ["d"], [("2024-01-02",)])
    text = '[tables.t]\nsource = "t.csv"\n[tables.t.columns.d]\ntype = "date"\n'
    (tmp_path / "a.toml").write_text(text + "lower = 2024-01-01\nupper = 2024-12-31\n")
    (tmp_path / "b.toml").write_text(text + 'lower = "2024-01-01"\nupper = "2024-12-31"\n')
    a = load_policy(tmp_path / "a.toml").tables["t"].columns["d"]
    b = load_policy(tmp_path / "b.toml").tables["t"].columns["d"]
    assert a == b and a.date_range == (dt.date(2024, 1, 1), dt.date(2024, 12, 31))


@pytest.mark.parametrize(
    ("lower", "upper", "key", "problem"),
    [
        ("2024-01-01", "2024-1-31", "upper", "ISO date"),
        ("2024-01-01", "20240131", "upper", "ISO date"),
        ("2024-W01-1", "2024-12-31", "lower", "ISO date"),
        (dt.datetime(2024, 1, 1, 8), "2024-12-31", "lower", "ISO date"),
        ("2025-01-01", "2024-12-31", "lower", "> upper"),
    ],
)
def test_bad_date_bounds_fail_at_connect_naming_the_key(tmp_path, lower, upper, key, problem):
    path = write_csv(tmp_path / "t.csv", ["d"], [("2024-01-02",)])
    policy = table_policy(path, {"d": {"type": "date", "lower": lower, "upper": upper}})
    with pytest.raises(PolicyError) as info:
        dpsql.connect(policy=policy)
    err = info.value
    assert err.sqlstate == "F0000"
    assert err.construct == f"tables.t.columns.d.{key}" and problem in err.message
    assert err.hint


# -- exact answers --------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "ref_key"), KEYS, ids=[k[0] for k in KEYS])
def test_every_grain_equals_the_reference(loose, visits_ref, key, ref_key):
    sql = f"SELECT {key} AS k, COUNT(*), SUM(cost) FROM visits GROUP BY 1"
    got = rows_of(loose, sql)
    expected = visits_ref.execute(
        f"SELECT {ref_key} AS k, COUNT(*), SUM(cl(cost, 0.0, 5000.0)) FROM visits "
        "GROUP BY 1 ORDER BY 1"
    ).fetchall()
    # every bucket, in the release's order (by key), with the exact bounded aggregates
    assert_same_rows(got, expected, ordered=True, rel=1e-7)
    _assert_public(loose, sql, len(expected))


def test_shifted_weeks_start_on_sunday(loose):
    got = rows_of(
        loose,
        "SELECT DATE_TRUNC('week', visit_date + INTERVAL 1 DAY) - INTERVAL 1 DAY AS w, "
        "COUNT(*) FROM visits GROUP BY 1",
    )
    assert got[0][0] == dt.datetime(2023, 12, 31)  # the Sunday before the first day
    assert {r[0].weekday() for r in got} == {6}
    assert len(got) == 105


def test_postgres_spellings_are_public_time_keys(visits_ref):
    """Over the wire's dialect: TO_CHAR (strftime underneath), date_part, INTERVAL '1 day'."""
    with exact_connect(_policy(), dialect="postgres") as conn:
        for key, ref_key in [
            ("TO_CHAR(visit_date, 'YYYY-MM')", "strftime(visit_date, '%Y-%m')"),
            ("date_part('quarter', visit_date)", "EXTRACT(quarter FROM visit_date)"),
            (
                "DATE_TRUNC('week', visit_date + INTERVAL '1 day') - INTERVAL '1 day'",
                "DATE_TRUNC('week', visit_date + INTERVAL 1 DAY) - INTERVAL 1 DAY",
            ),
        ]:
            sql = f"SELECT {key} AS k, COUNT(*) FROM visits GROUP BY 1"
            expected = visits_ref.execute(
                f"SELECT {ref_key} AS k, COUNT(*) FROM visits GROUP BY 1 ORDER BY 1"
            ).fetchall()
            assert_same_rows(rows_of(conn, sql), expected, ordered=True)
            _assert_public(conn, sql, len(expected))


def test_empty_buckets_are_released(wide, visits_ref):
    got = rows_of(
        wide, "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) FROM visits GROUP BY 1"
    )
    assert len(got) == 26  # 2023-12 .. 2026-01
    assert got[0] == (dt.datetime(2023, 12, 1), 0) and got[-1] == (dt.datetime(2026, 1, 1), 0)
    days = rows_of(wide, "SELECT visit_date, COUNT(*) FROM visits GROUP BY visit_date")
    assert [d for d, _ in days] == [
        dt.date(2023, 12, 1) + dt.timedelta(days=i) for i in range(31 + DAYS + 31)
    ]
    expected = dict(
        visits_ref.execute("SELECT visit_date, COUNT(*) FROM visits GROUP BY 1").fetchall()
    )
    assert days == [(d, expected.get(d, 0)) for d, _ in days]
    _assert_public(wide, "SELECT visit_date, COUNT(*) FROM visits GROUP BY visit_date", len(days))


def test_time_keys_answer_with_delta_zero(tmp_path: Path):
    """No threshold: a policy without delta answers every time grain (and charges no delta)."""
    policy = _policy()
    policy["privacy"]["delta"] = 0.0
    with exact_connect(policy) as conn:
        for key, _ in KEYS:
            rows_of(conn, f"SELECT {key} AS k, COUNT(*) FROM visits GROUP BY 1")
        assert budget(conn)["charged_delta"] == 0.0
        # an undeclared date column stays private: thresholded, so refused at delta = 0
        policy["tables"]["visits"]["columns"]["visit_date"] = {"type": "date", "nullable": False}
    with exact_connect(policy) as conn, pytest.raises(dpsql.Error):
        rows_of(conn, "SELECT DATE_TRUNC('week', visit_date) AS w, COUNT(*) FROM visits GROUP BY 1")


def test_time_keys_with_other_keys(loose, visits_ref):
    sql = (
        "SELECT department, DATE_TRUNC('quarter', visit_date) AS q, smoker, COUNT(*) "
        "FROM visits GROUP BY 1, 2, 3"
    )
    got = rows_of(loose, sql)
    expected = visits_ref.execute(sql + " ORDER BY 1, 2, 3").fetchall()
    assert len(got) == 6 * 8 * 2
    assert_same_rows(got, expected, ordered=True)
    _assert_public(loose, sql)


# -- a WHERE on the date restricts the released buckets --------------------------------------

WHERES = [
    ("visit_date BETWEEN '2025-03-01' AND '2025-06-30'", "DATE_TRUNC('month', visit_date)", 4),
    ("visit_date >= DATE '2025-12-15'", "visit_date", 17),
    ("visit_date < DATE '2024-01-08' AND department = 'oncology'", "visit_date", 7),
    ("visit_date IN ('2024-02-29', '2025-07-04')", "visit_date", 2),
    ("visit_date = DATE '2024-02-29'", "EXTRACT(dow FROM visit_date)", 1),
    ("EXTRACT(year FROM visit_date) = 2025", "DATE_TRUNC('quarter', visit_date)", 4),
    ("visit_date > DATE '2030-01-01'", "DATE_TRUNC('month', visit_date)", 0),
]


@pytest.mark.parametrize(("where", "key", "bins"), WHERES, ids=[w[0] for w in WHERES])
def test_a_where_on_the_date_restricts_the_buckets(loose, visits_ref, where, key, bins):
    sql = f"SELECT {key} AS k, COUNT(*) FROM visits WHERE {where} GROUP BY 1"
    got = rows_of(loose, sql)
    assert len(got) == bins
    expected = visits_ref.execute(sql + " ORDER BY 1").fetchall()
    assert_same_rows(got, expected, ordered=True)


def test_a_where_inside_the_range_releases_its_empty_buckets(wide):
    got = rows_of(
        wide,
        "SELECT visit_date, COUNT(*) FROM visits WHERE visit_date < DATE '2024-01-03' GROUP BY 1",
    )
    expected_days = [dt.date(2023, 12, 1) + dt.timedelta(days=i) for i in range(33)]
    assert [d for d, _ in got] == expected_days
    assert all(n == 0 for _, n in got[:31]) and all(n > 0 for _, n in got[31:])


# -- max_bins --------------------------------------------------------------------------------


def test_a_day_range_over_max_bins_is_not_a_public_day_key():
    policy = _policy()
    policy["privacy"]["max_bins"] = 100
    with exact_connect(policy) as conn:
        # 731 days: the bare day is thresholded (costs delta); months are still public
        rows = _explain(conn, "SELECT visit_date, COUNT(*) FROM visits GROUP BY 1")
        assert [r for r in rows if str(r[0]).startswith("GROUP BY")]
        assert next(r for r in rows if r[0] == "total")[7] > 0
        _assert_public(
            conn, "SELECT DATE_TRUNC('month', visit_date), COUNT(*) FROM visits GROUP BY 1", 24
        )
        # a WHERE narrowing the days below max_bins makes them public again
        _assert_public(
            conn,
            "SELECT visit_date, COUNT(*) FROM visits "
            "WHERE visit_date BETWEEN '2025-01-01' AND '2025-01-31' GROUP BY 1",
            31,
        )


# -- rows outside the declared days: where an int's land ------------------------------------


def _mirror_rows(seed: int = 5) -> list[tuple]:
    """Units with a date and the same date as a day number; some outside [lo, hi], some NULL."""
    rnd = random.Random(seed)
    rows = []
    for uid in range(1, 61):
        for _ in range(rnd.randint(1, 4)):
            day = None if rnd.random() < 0.08 else rnd.randint(-40, 100)  # range: 0..59
            date = None if day is None else (FIRST + dt.timedelta(days=day)).isoformat()
            rows.append((uid, date, day))
    return rows


def _mirror_policy(path: Path, unit: bool) -> dict:
    cols = {
        "uid": {"type": "int", "nullable": False},
        "d": {"type": "date", "lower": FIRST.isoformat(), "upper": "2024-02-29", "nullable": True},
        "n": {"type": "int", "lower": 0, "upper": 59, "nullable": True},
    }
    return table_policy(
        path,
        cols,
        unit="uid" if unit else None,
        rows=100 if unit else 1,
        groups=100 if unit else 1,
        privacy={"budget_epsilon": 1e9},
    )


@pytest.mark.parametrize("unit", [True, False], ids=["per unit", "row level"])
def test_out_of_range_dates_land_where_out_of_range_ints_land(tmp_path: Path, unit: bool):
    rows = _mirror_rows()
    path = write_csv(tmp_path / "m.csv", ["uid", "d", "n"], rows)
    with exact_connect(_mirror_policy(path, unit)) as conn:
        days = rows_of(conn, "SELECT d, COUNT(*) FROM t GROUP BY d")
        ints = rows_of(conn, "SELECT n, COUNT(*) FROM t GROUP BY n")
        # the same bins, NULL included, and the same counts: outside rows are in none
        assert [(FIRST + dt.timedelta(days=n) if n is not None else None, c) for n, c in ints] == (
            days
        )
        assert len(days) == 61
        inside = sum(1 for r in rows if r[2] is None or 0 <= r[2] <= 59)
        assert sum(c for _, c in days) == inside < len(rows)
        weeks = rows_of(conn, "SELECT DATE_TRUNC('week', d) AS w, COUNT(*) FROM t GROUP BY 1")
        int_weeks = rows_of(conn, "SELECT n // 7 AS w, COUNT(*) FROM t GROUP BY 1")
        # a derived key keeps outside rows out too (2024-01-01 is a Monday: weeks are n // 7)
        assert [c for _, c in weeks] == [c for _, c in int_weeks]
        assert weeks[-1][0] is None and weeks[0][0] == dt.datetime(2024, 1, 1)


# -- neighbouring datasets ------------------------------------------------------------------

# (query, how many of its leading columns are keys)
NEIGHBOUR_QUERIES = [
    ("SELECT visit_date, COUNT(*) FROM visits GROUP BY visit_date", 1),
    ("SELECT DATE_TRUNC('week', visit_date) AS w, COUNT(*), SUM(cost) FROM visits GROUP BY 1", 1),
    (
        "SELECT DATE_TRUNC('month', visit_date) AS m, department, COUNT(*) FROM visits "
        "GROUP BY 1, 2",
        2,
    ),
    ("SELECT EXTRACT(dow FROM visit_date) AS d, AVG(cost) FROM visits GROUP BY 1", 1),
    (
        "SELECT strftime(visit_date, '%Y-%m') AS m, COUNT(DISTINCT patient_id) FROM visits "
        "GROUP BY 1",
        1,
    ),
    (
        "SELECT DATE_TRUNC('week', visit_date + INTERVAL 1 DAY) - INTERVAL 1 DAY AS w, COUNT(*) "
        "FROM visits WHERE visit_date >= DATE '2025-06-01' GROUP BY 1",
        1,
    ),
]

OUTSIDE = ["2023-12-31", "1999-01-01", "9999-12-31", "0001-01-01", "2026-01-01"]
EDGES = ["2024-01-01", "2025-12-31"]


def _neighbour_csv(directory: Path, dates: list[str]) -> Path:
    """fixtures/visits.csv plus one new patient with a visit on each of ``dates``."""
    text = FIXTURE_CSV.read_text()
    extra = "".join(
        f"999999,40,oncology,Z99,{100 + i}.25,{d},false,false\n" for i, d in enumerate(dates)
    )
    path = directory / "visits.csv"
    path.write_text(text if text.endswith("\n") else text + "\n")
    with path.open("a") as fh:
        fh.write(extra)
    return path


def _answers(path: Path) -> list[tuple[list[tuple], list[tuple]]]:
    """Each query's rows and its EXPLAIN total (epsilon, delta, rho) on the data at ``path``."""
    policy = fixture_policy(privacy={"budget_epsilon": 1e9})
    policy["tables"]["visits"]["source"] = str(path)
    with exact_connect(policy) as conn:
        out = []
        for sql, _ in NEIGHBOUR_QUERIES:
            cost = [r[6:9] for r in _explain(conn, sql) if r[0] == "total"]
            out.append((rows_of(conn, sql), cost))
        return out


@pytest.fixture(scope="module")
def base_answers(tmp_path_factory) -> list:
    return _answers(_neighbour_csv(tmp_path_factory.mktemp("d"), []))


def test_a_neighbour_outside_the_range_changes_nothing(base_answers, tmp_path):
    """D' = D + a patient whose every visit is outside the declared days: the same answer."""
    got = _answers(_neighbour_csv(tmp_path, OUTSIDE))
    for (rows, cost), (base_rows, base_cost), (sql, _) in zip(
        got, base_answers, NEIGHBOUR_QUERIES, strict=True
    ):
        assert cost == base_cost, sql
        assert rows == base_rows, sql  # same keys, same order, same values


def test_a_neighbour_at_the_edges_changes_values_only(base_answers, tmp_path):
    """D' = D + a patient with visits outside and on the first and last declared days: the
    same keys in the same order at the same cost; only the edge buckets' values move."""
    got = _answers(_neighbour_csv(tmp_path, OUTSIDE + EDGES))
    for (rows, cost), (base_rows, base_cost), (sql, keys) in zip(
        got, base_answers, NEIGHBOUR_QUERIES, strict=True
    ):
        assert cost == base_cost, sql
        assert [r[:keys] for r in rows] == [r[:keys] for r in base_rows], sql
        changed = [i for i, (a, b) in enumerate(zip(rows, base_rows, strict=True)) if a != b]
        assert 1 <= len(changed) <= 2, (sql, changed)


def test_the_neighbour_holds_its_rows(tmp_path):
    """Sanity: DuckDB reads the new patient's rows (so the tests above are not vacuous)."""
    path = _neighbour_csv(tmp_path, OUTSIDE + EDGES)
    (n,) = (
        duckdb.connect()
        .execute(
            f"SELECT COUNT(*) FROM read_csv('{path}', header = true, all_varchar = true) "
            "WHERE patient_id = '999999'"
        )
        .fetchone()
    )
    assert n == len(OUTSIDE) + len(EDGES)


# -- the differential fuzz test's neighbours (tests/test_differential_fuzz.py) ----------------


@pytest.fixture(scope="module")
def fuzz_pair(tmp_path_factory: pytest.TempPathFactory):
    """D, the fixture, and D′ = D + a patient dated 9999-12-31, 0001-01-01 and NULL."""
    yield from _closing(_pair(tmp_path_factory.mktemp("time"), lambda _: MemoryLedger()))


@settings(FUZZ, max_examples=40)
@given(query=g.time_key_queries())
def test_time_keys_hold_the_boundary_on_neighbours(fuzz_pair: Pair, query: g.Query) -> None:
    """Every generated time key is answered from its public domain on both datasets: the same
    keys in the same order, the same cost, no delta; each side charged the plan's cost."""
    a = fuzz_pair.d.run(query.sql, query.setup)
    b = fuzz_pair.d_prime.run(query.sql, query.setup)
    found = (
        side_violations(query, a, fuzz_pair, "D")
        + side_violations(query, b, fuzz_pair, "D′")
        + pair_violations(query, a, b)
    )
    assert not found, f"{query.sql!r}:\n  " + "\n  ".join(found)
    assert a.kind == b.kind == "answered", (query.sql, a.error)
    assert a.plan_cost is not None and a.plan_cost[1] == 0.0, query.sql  # public: no delta


# -- the public clock: NOW() / CURRENT_TIMESTAMP read once per statement -------------------------
class _Clock(dt.datetime):
    """A datetime whose now() is the instant the test sets."""

    current = dt.datetime(2025, 6, 30, 12, 0, tzinfo=dt.UTC)

    @classmethod
    def now(cls, tz: Any = None) -> dt.datetime:  # type: ignore[override]
        return cls.current


@pytest.fixture
def clock(monkeypatch):
    import types

    import dpsql.frontend.rewrite as rewrite

    shim = types.SimpleNamespace(**{k: getattr(dt, k) for k in dir(dt) if not k.startswith("_")})
    shim.datetime = _Clock
    monkeypatch.setattr(rewrite, "dt", shim)
    yield _Clock
    _Clock.current = dt.datetime(2025, 6, 30, 12, 0, tzinfo=dt.UTC)


def test_now_is_a_public_clock_read_once_per_statement(clock):
    """NOW(), CURRENT_TIMESTAMP, LOCALTIMESTAMP and PostgreSQL's now() are one instant per
    statement (a literal from then on), CURRENT_DATE its date; a relative filter answers as
    the same filter with the instant written out."""
    import sqlglot

    from dpsql.frontend.rewrite import normalise

    tree = normalise(
        sqlglot.parse_one(
            "SELECT NOW(), CURRENT_TIMESTAMP, LOCALTIMESTAMP, transaction_timestamp(), "
            "CURRENT_DATE",
            read="duckdb",
        )
    )
    literals = [e.sql() for e in tree.expressions]
    assert len(set(literals[:4])) == 1 and "2025-06-30 12:00:00" in literals[0]
    assert "'2025-06-30'" in literals[4]
    pg = normalise(sqlglot.parse_one("SELECT now()", read="postgres"))
    assert pg.expressions[0].sql() == literals[0]

    conn = exact_connect(fixture_policy())
    relative = rows_of(
        conn,
        "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) FROM visits "
        "WHERE visit_date >= NOW() - INTERVAL '90 days' GROUP BY 1 ORDER BY 1",
    )
    written = rows_of(
        conn,
        "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) FROM visits "
        "WHERE visit_date >= TIMESTAMP '2025-04-01 12:00:00' GROUP BY 1 ORDER BY 1",
    )
    assert relative == written and len(relative) == 9  # April .. December 2025, empty too
    conn.close()


def test_a_relative_filter_is_not_replayed_on_another_day(clock):
    """The instant is in the plan, so the answer cache (which replays a paid answer free)
    replays a NOW() query within the same instant only: tomorrow it is a new query, charged."""
    conn = dpsql.connect(policy=fixture_policy(), ledger=MemoryLedger(), analyst="clock")
    sql = "SELECT COUNT(*) FROM visits WHERE visit_date >= NOW() - INTERVAL 30 DAY"
    cur = conn.cursor()
    cur.execute(sql)
    first = cur.fetchall()
    assert cur.cost is not None
    cur.execute(sql)
    assert cur.cached and cur.fetchall() == first  # the same instant: the same query
    clock.current = clock.current + dt.timedelta(days=1)
    cur.execute(sql)
    assert not cur.cached and cur.cost is not None  # another day: charged again
    conn.close()
