"""Fixed point that matches its sensitivity (issue 10, item 3).

A real-valued SUM, AVG or VARIANCE is computed on integers: each row's round(x / g), within the
integer range [lo, hi] the planner derived its sensitivities from. The planner used to round
lower / g and upper / g half to even while the engine clamped x and rounded half away from zero,
so a unit at a tie (5000 / 400 = 12.5) moved the exact SUM past its declared L1.

Neighbours here: D = the base units (w = 0), D' = D plus one unit (w = k) whose rows all hold one
adversarial value — a bound, a tie (k + 1/2)·g, a value past the bounds, NaN or ±inf — in more
than R rows and more than G groups, so both bounds bind. The exact engine aggregates (no noise:
the compiled plan run on the engine directly, with one secret for both runs) must move by no more
than each measure's declared L1 and L2, and the worst such unit moves them by exactly that.
"""

from __future__ import annotations

import math
import os
import shutil
from fractions import Fraction
from pathlib import Path

import duckdb
import pytest
import sqlglot
from conftest import local_spark, table_policy, write_csv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dpsql
from dpsql.frontend.bind import parse_statement
from dpsql.lower.compile import compile_plan, fixed_point_value, render
from dpsql.pipeline import Settings
from dpsql.plan.annotated import Plan
from dpsql.plan.fixed_point import fixed_point_bounds
from dpsql.plan.values import Measure
from dpsql.policy import ColumnPolicy
from dpsql.privacy.ledger import MemoryLedger

R, G = 3, 2
GROUPS = ["a", "b", "c"]  # 3 public bins > G: a unit's groups are capped at G
SECRET = 12345  # one keyed-hash secret for D and D': the base units keep the same rows
QUERIES = [
    "SELECT SUM(x) FROM t WHERE {w}",  # uncentred sum
    "SELECT SUM(x), AVG(x), VAR_POP(x) FROM t WHERE {w}",  # centred sum, count, sum of squares
    "SELECT grp, SUM(x), AVG(x), STDDEV(x) FROM t WHERE {w} GROUP BY grp",  # G groups: L2 < L1
]

# (lower, upper, granularity): ties at the bounds, non-multiples, g past the range, negative
# bounds, tiny g, decimal ties, a one-point range on a tie.
CASES = [
    (0.0, 5000.0, 400.0),  # the issue's: 12.5 (DuckDB: 13, plan: 12)
    (0.0, 5000.0, 2000.0),  # 2.5
    (0.0, 5000.0, 20000.0),  # g > range: lo = hi = 0
    (0.0, 5000.0, 8000.0),  # g > range, 0.625
    (-5000.0, 5000.0, 400.0),  # ties at both ends, -12.5 rounds away from zero too
    (-5000.0, -100.0, 400.0),  # all negative
    (-7.0, 7.0, 2.0),  # -3.5 .. 3.5: odd ties, where half-to-even goes outward
    (0.0, 1.0, 0.3),
    (0.0, 1.0, 0.7),
    (-0.35, 0.35, 0.1),  # ties in decimal, not in binary
    (0.15, 0.45, 0.1),
    (2.5, 2.5, 1.0),  # one point, on a tie
    (0.0, 10.0, 4.0),
]


def _ids(case: tuple[float, float, float]) -> str:
    return "[{:g},{:g}]/{:g}".format(*case)


def adversarial_values(lower: float, upper: float, g: float) -> list[float | None]:
    """One unit's value: bounds, ties around lo, hi and the centre, past the bounds, NaN, inf."""
    lo, hi = fixed_point_bounds(lower, upper, g)
    centre = (lo + hi) // 2
    ties = [(k + 0.5) * g for n in (lo, hi, centre) for k in (n - 1, n)]
    steps = [n * g for n in (lo, hi, centre, lo - 1, hi + 1)]
    beyond = [lower - 3 * g, upper + 3 * g, lower - 1e300, upper + 1e300]
    nudged = [math.nextafter(v, d) for v in (lower, upper) for d in (-math.inf, math.inf)]
    special = [math.nan, math.inf, -math.inf, None]
    return [lower, upper, *ties, *steps, *beyond, *nudged, *special]


def _cell(v: float | None) -> str | None:
    return None if v is None else repr(v)


def write_neighbours(path: Path, lower: float, upper: float, g: float, values: list) -> Path:
    """Base units (w = 0, within R and G) and one extra unit per value (w = 1, 2, ...)."""
    rows: list[tuple] = []
    span = upper - lower
    for uid in range(1, 7):  # base: ordinary values, ties and a NULL, 1..R rows in <= G groups
        for j in range(1 + uid % R):
            x = lower + span * ((uid * 7 + j * 3) % 10) / 9
            rows.append((uid, 0, GROUPS[(uid + j % 2) % 3], _cell(x if uid != 3 else None)))
        rows.append((uid, 0, GROUPS[uid % 3], _cell((round(lower / g) + 0.5) * g)))
    for k, v in enumerate(values, start=1):  # R + 1 rows in each of G + 1 groups
        rows += [(1000 + k, k, grp, _cell(v)) for grp in GROUPS for _ in range(R + 1)]
    return write_csv(path, ["uid", "w", "grp", "x"], rows)


def neighbour_policy(path: Path, lower: float, upper: float, g: float, k: int) -> dict:
    cols = {
        "uid": {"type": "int", "nullable": False},
        "w": {"type": "int", "lower": 0, "upper": k, "nullable": False},
        "grp": {"type": "text", "values": GROUPS, "nullable": False},
        "x": {"type": "float", "lower": lower, "upper": upper, "granularity": g},
    }
    return table_policy(path, cols, unit="uid", rows=R, groups=G)


def plan_of(service: dpsql.Service, sql: str) -> Plan:
    return service.plan(parse_statement(sql, service.policy), Settings(1.0, 1e-6, "laplace"))


def exact(service: dpsql.Service, plan: Plan) -> dict[tuple, list[int]]:
    """The engine's exact measures per group (the compiled plan, before any noise)."""
    result = service.engine.execute(compile_plan(plan, SECRET))
    return {
        tuple(key): [int(m[i]) for m in result.measures]
        for i, key in enumerate(result.key_rows or [()])
    }


def change(before: dict, after: dict, index: int) -> tuple[int, float]:
    """L1 and L2 norms of one measure's change across groups (a missing group is 0)."""
    deltas = [
        after.get(key, [0] * (index + 1))[index] - before.get(key, [0] * (index + 1))[index]
        for key in set(before) | set(after)
    ]
    return sum(map(abs, deltas)), math.sqrt(sum(d * d for d in deltas))


def value_measures(plan: Plan) -> list[tuple[int, Measure]]:
    return [(i, m) for i, m in enumerate(plan.measures) if m.kind in ("sum", "values", "sumsq")]


def check_neighbours(
    service: dpsql.Service, values: list, *, tight: bool, queries: list[str] = QUERIES
) -> None:
    """Every extra unit moves each measure by at most its declared L1 / L2 (the worst: exactly)."""
    for sql in queries:
        plan = plan_of(service, sql.format(w="w = 0"))
        before = exact(service, plan)
        worst = [(0, 0.0)] * len(plan.measures)
        for k, v in enumerate(values, start=1):
            neighbour = plan_of(service, sql.format(w=f"(w = 0 OR w = {k})"))
            assert [m.l1 for m in neighbour.measures] == [m.l1 for m in plan.measures]
            after = exact(service, neighbour)
            for i, m in value_measures(plan):
                l1, l2 = change(before, after, i)
                assert l1 <= m.l1, (sql, v, m.kind, l1, m.l1)
                assert l2 <= m.l2 * (1 + 1e-12), (sql, v, m.kind, l2, m.l2)
                worst[i] = max(worst[i], (l1, l2))
        if tight:
            for i, m in value_measures(plan):
                assert worst[i][0] == m.l1, (sql, m.kind, worst[i], m.l1)
                if plan.group_scaling:  # L2 = G/sqrt(k)·R·b: reached only by a unit in k = G
                    continue
                assert math.isclose(worst[i][1], m.l2, rel_tol=1e-12), (sql, m.kind, worst[i])


def _service(tmp_path: Path, case: tuple[float, float, float], values: list, **options):
    path = write_neighbours(tmp_path / "t.csv", *case, values)
    policy = neighbour_policy(path, *case, len(values))
    return dpsql.Service(policy, ledger=MemoryLedger(), cache=False, **options)


GRANULARITIES = st.sampled_from([0.3, 0.7, 0.1, 400.0, 2000.0, 1.0, 2.0]) | st.floats(1e-2, 1e4)


@st.composite
def random_cases(draw, span: int = 10**4) -> tuple[float, float, float]:
    """(lower, upper, g) with the bounds often on a multiple of g or a tie (k + 1/2)·g."""
    g = draw(GRANULARITIES)
    offset = st.sampled_from([0.0, 0.5, -0.5]) | st.floats(-1, 1)
    a, n = draw(st.integers(-span, span)), draw(st.integers(0, span))
    lower = (a + draw(offset)) * g
    return lower, max(lower, (a + n + draw(offset)) * g), g


# -- the integer bounds ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lower", "upper", "g", "expected"),
    [
        (0.0, 5000.0, 400.0, (0, 12)),  # 12.5: the tie goes inward
        (0.0, 5000.0, 2000.0, (0, 2)),
        (-5000.0, 5000.0, 400.0, (-12, 12)),
        (-7.0, 7.0, 2.0, (-3, 3)),  # half to even would give (-4, 4)
        (0.0, 5000.0, 20000.0, (0, 0)),
        (0.0, 5000.0, 8000.0, (0, 1)),
        (0.0, 1.0, 0.3, (0, 3)),
        (0.0, 1.0, 0.7, (0, 1)),
        (-0.35, 0.35, 0.1, (-3, 3)),  # exact decimal ties (0.35 / 0.1 is 3.4999... in floats)
        (0.15, 0.45, 0.1, (2, 4)),
        (2.5, 2.5, 1.0, (2, 2)),  # a one-point range on a tie: one integer, g/2 away
        (0.0, 1000.0, 0.01, (0, 100000)),  # multiples: the plain quotient
    ],
)
def test_integer_bounds(lower, upper, g, expected):
    assert fixed_point_bounds(lower, upper, g) == expected


@settings(max_examples=300, deadline=None)
@given(case=random_cases() | st.tuples(st.floats(-1e6, 0), st.floats(0, 1e6), GRANULARITIES))
def test_integer_bounds_are_nearest_and_ordered(case):
    lower, upper, g = case
    lo, hi = fixed_point_bounds(lower, upper, g)
    assert lo <= hi
    step = Fraction(repr(g))
    assert abs(lo * step - Fraction(repr(lower))) <= step / 2
    assert abs(hi * step - Fraction(repr(upper))) <= step / 2


# -- each row's value, straight from the engine SQL --------------------------------------------


def _row_values_duckdb(col: ColumnPolicy, lo: int, hi: int, xs: list) -> list:
    con = duckdb.connect()
    con.execute("CREATE TABLE t (x DOUBLE)")
    con.executemany("INSERT INTO t VALUES (?)", [(x,) for x in xs])
    got = con.execute(f"SELECT x, {fixed_point_value(col, lo, hi)} FROM t").fetchall()
    con.close()
    return got


def assert_row_values(col: ColumnPolicy, rows: list) -> None:
    """Each value in [lo, hi], and within g/2 (plus the quotient's float error) of clamp(x)."""
    lo, hi = fixed_point_bounds(col.lower, col.upper, col.granularity)
    for x, v in rows:
        if x is None:
            assert v is None
            continue
        assert lo <= v <= hi, (col, x, v)
        if math.isnan(x):
            continue
        clamped = min(max(x, col.lower), col.upper)
        q = Fraction(clamped) / Fraction(col.granularity)
        assert abs(v - q) <= Fraction(1, 2) + Fraction(1 + abs(q)) * Fraction(1, 2**50)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_row_values_stay_within_the_plan_bounds(case):
    lower, upper, g = case
    col = ColumnPolicy("x", "float", lower, upper, granularity=g)
    lo, hi = fixed_point_bounds(lower, upper, g)
    rows = _row_values_duckdb(col, lo, hi, adversarial_values(*case))
    assert_row_values(col, rows)


def test_int_column_values_clamp_to_its_bounds():
    col = ColumnPolicy("x", "int", -5.0, 10.0)
    con = duckdb.connect()
    got = con.execute(
        f"SELECT x, {fixed_point_value(col, -5, 10)} FROM (SELECT UNNEST([-9, -5, 0, 10, 11, "
        f"NULL, 9223372036854775807]) AS x)"
    ).fetchall()
    assert [v for _, v in got] == [-5, -5, 0, 10, 10, None, 10]


def test_bounds_past_2_53_clamp_the_integer_too():
    """A bound past 2^53 is not exact as a DOUBLE: the BIGINT itself is clamped as well."""
    hi = 2**62 - 1
    col = ColumnPolicy("x", "float", 0.0, float(hi), granularity=1.0)
    sql = fixed_point_value(col, 0, hi)
    con = duckdb.connect()
    assert con.execute(f"SELECT {sql} FROM (SELECT 1e300 AS x)").fetchone() == (hi,)  # not 2^62
    small = fixed_point_value(ColumnPolicy("x", "float", 0.0, 5000.0, granularity=400.0), 0, 12)
    assert small.count("CASE") == 1  # one clamp where bounds are exact doubles


xs_strategy = st.lists(
    st.floats(allow_nan=True, allow_infinity=True) | st.integers(-40, 40).map(lambda k: k / 2),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=random_cases(), units=xs_strategy, ties=st.lists(st.integers(-3, 3), max_size=8))
def test_row_values_random(case, units, ties):
    """Random bounds and granularity; values anywhere, many on ties (k + 1/2)·g near the bounds."""
    lower, upper, g = case
    lo, hi = fixed_point_bounds(lower, upper, g)
    xs = [u * g for u in units] + [(n + t + 0.5) * g for t in ties for n in (lo, hi)]
    col = ColumnPolicy("x", "float", lower, upper, granularity=g)
    assert_row_values(col, _row_values_duckdb(col, lo, hi, xs))


# -- neighbouring datasets through the whole plan (DuckDB) -------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_neighbours_move_no_more_than_declared(tmp_path, case):
    values = adversarial_values(*case)
    service = _service(tmp_path, case, values)
    try:
        check_neighbours(service, values, tight=True)
    finally:
        service.close()


def test_the_issue_figures(tmp_path):
    """[0, 5000] at g = 400 and 2000, five rows at 5000: SUM moves by exactly its L1."""
    for g, moved in ((400.0, 60), (2000.0, 10)):  # 5 rows x hi (12 or 2) units
        case = (0.0, 5000.0, g)
        path = write_neighbours(tmp_path / f"{g}.csv", *case, [5000.0])
        policy = neighbour_policy(path, *case, 1)
        policy["tables"]["t"]["max_rows_per_unit"] = 5
        service = dpsql.Service(policy, ledger=MemoryLedger(), cache=False)
        try:
            plan = plan_of(service, "SELECT SUM(x) FROM t WHERE w = 0")
            (m,) = plan.measures
            neighbour = plan_of(service, "SELECT SUM(x) FROM t WHERE w = 0 OR w = 1")
            l1, _ = change(exact(service, plan), exact(service, neighbour), 0)
            # the issue's engine moved it by 65 and 15 units (in a rescaled plan's fine grid)
            assert l1 == m.l1 == moved * m.scale
        finally:
            service.close()


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    case=random_cases(span=100),
    picked=st.lists(st.integers(0, 30), max_size=3),
    anywhere=st.lists(st.floats(-2, 2), max_size=2),
)
def test_neighbours_random(tmp_path_factory, case, picked, anywhere):
    """Random bounds and granularity; units at both bounds, from the pool above, and anywhere
    in and around [lower, upper]."""
    lower, upper, _ = case
    pool = adversarial_values(*case)
    values = [lower, upper] + [pool[i % len(pool)] for i in picked]
    values += [lower + (upper - lower) * (1 + t) / 2 for t in anywhere]
    service = _service(tmp_path_factory.mktemp("rand"), case, values)
    try:
        check_neighbours(service, values, tight=False)
    finally:
        service.close()


# -- the same plans on Spark --------------------------------------------------------------------

_SPARK = pytest.mark.skipif(
    not (os.environ.get("JAVA_HOME") or shutil.which("java")), reason="Spark needs Java 17+"
)
SPARK_CASES = [CASES[0], CASES[4], CASES[7]]  # ~1 s a query: the issue's, negative, tiny g


@pytest.fixture(scope="module")
def spark():
    pytest.importorskip("pyspark", reason="pyspark is not installed")
    session = local_spark()
    yield session


@_SPARK
@pytest.mark.spark
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_spark_row_values_stay_within_the_plan_bounds(spark, case):
    """Spark's ROUND (HALF_UP) on the rendered expression: each value in [lo, hi]."""
    lower, upper, g = case
    col = ColumnPolicy("x", "float", lower, upper, granularity=g)
    lo, hi = fixed_point_bounds(lower, upper, g)
    xs = adversarial_values(*case)
    frame = spark.createDataFrame(list(enumerate(xs)), "i int, x double")
    frame.createOrReplaceTempView("fp_values")
    select = f"SELECT i, x, {fixed_point_value(col, lo, hi)} AS v FROM fp_values"
    rows = spark.sql(render(sqlglot.parse_one(select, read="duckdb"), "spark")).collect()
    assert_row_values(col, [(r[1], r[2]) for r in sorted(rows, key=lambda r: r[0])])


@_SPARK
@pytest.mark.spark
@pytest.mark.parametrize("case", SPARK_CASES, ids=_ids)
def test_spark_neighbours_move_no_more_than_declared(tmp_path, spark, case):
    lower, upper, g = case
    lo, _ = fixed_point_bounds(lower, upper, g)
    values = [upper, (lo - 0.5) * g, math.nan]  # hi is the far bound here: upper reaches L1
    service = _service(tmp_path, case, values, engine="spark", spark_session=spark)
    try:
        # the issue's uncentred SUM, and the grouped centred sum, count and sum of squares
        check_neighbours(service, values, tight=True, queries=[QUERIES[0], QUERIES[2]])
    finally:
        service.close()
