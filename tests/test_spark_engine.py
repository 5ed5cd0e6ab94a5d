"""The same private plan on Spark: identical exact bounded aggregates to DuckDB.

Noise is off (``ZeroNoise``), so each engine's answer is its exact contribution-bounded
aggregate. DuckDB's answers are themselves checked against hand-written reference SQL in
test_exactness.py, whose queries this file reuses: every accepted query shape runs on both
engines over the same CSV and must agree.

The keyed hash differs between engines (DuckDB HASH vs Spark xxhash64), so *which* rows and
groups a unit keeps when it exceeds R or G can differ. Exact comparisons therefore use data on
which no bound binds; on over-bound data the tests check the invariants instead (each unit
keeps exactly min(n, R) rows per group, in at most G groups) and exact equality where the
choice cannot matter.

One Spark session (local[2]) is shared by the whole module, and by the worker's other Spark
modules (conftest.local_spark: never stopped before the worker ends), to keep the run to minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import (
    GRP5,
    assert_same_rows,
    exact_connect,
    fixture_policy,
    heavy_policy,
    local_spark,
    require_spark,
    rows_of,
    table_policy,
    write_csv,
)
from test_exactness import CASES, COLUMNS, HEADER, ORDERED, _clean_rows

import dpsql
from dpsql.errors import OperationalError, PolicyError
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise

pytestmark = pytest.mark.spark
require_spark()


@pytest.fixture(scope="module")
def spark():
    session = local_spark()
    # the code the engine runs by default (conftest.local_spark turns it off for the others)
    session.conf.set("spark.sql.codegen.wholeStage", "true")
    # not stopped: the next Spark module of this worker joins it (a new context costs seconds)
    yield session
    session.conf.set("spark.sql.codegen.wholeStage", "false")


def _pair(policy, spark, **options):
    """(DuckDB connection, Spark connection) over the same policy, noise off."""
    duck = exact_connect(policy, **options)
    on_spark = exact_connect(policy, engine="spark", spark_session=spark, **options)
    return duck, on_spark


def _same(pair, sql, *, ordered=False):
    duck, on_spark = pair
    expected = rows_of(duck, sql)
    got = rows_of(on_spark, sql)
    assert_same_rows(got, expected, ordered=ordered, rel=1e-12, abs_tol=1e-9)
    return got


# -- bounds that never bind: exact equality ----------------------------------------------------


@pytest.fixture(scope="module")
def clean(tmp_path_factory, spark):
    path = write_csv(tmp_path_factory.mktemp("clean") / "t.csv", HEADER, _clean_rows())
    pair = _pair(table_policy(path, COLUMNS, unit="uid", rows=3, groups=3), spark)
    yield pair
    for conn in pair:
        conn.close()


def test_spark_connection_runs_on_spark(clean):
    duck, on_spark = clean
    assert duck.service.engine.name == "duckdb"
    assert on_spark.service.engine.name == "spark"
    cur = on_spark.cursor()
    # a non-public key: each unit's groups are chosen by keyed hash (XXHASH64 on Spark)
    cur.execute("EXPLAIN SELECT name, COUNT(*) FROM t GROUP BY name")
    engine_sql = next(r[1] for r in cur.fetchall() if r[0] == "engine_sql")
    assert "XXHASH64(" in engine_sql.upper() and "rand" not in engine_sql.lower()
    assert "QUALIFY" not in engine_sql.upper()


@pytest.mark.parametrize("sql", [c[0] for c in CASES], ids=[c[0][:70] for c in CASES])
def test_every_query_shape_matches_duckdb(clean, sql):
    _same(clean, sql)


@pytest.mark.parametrize("sql", [c[0] for c in ORDERED], ids=[c[0][:70] for c in ORDERED])
def test_post_processing_matches_duckdb(clean, sql):
    _same(clean, sql, ordered=True)


#: Per-unit relations (dpsql.frontend.per_unit): the same bounded per-unit rows on both
#: engines (no bound binds on the clean data), so the same exact aggregates over them.
PER_UNIT = [
    "SELECT COUNT(*), AVG(s), SUM(s) FROM (SELECT uid, SUM(score) AS s FROM t GROUP BY uid) u",
    "SELECT FLOOR(s / 5) * 5 AS b, COUNT(*) FROM (SELECT uid, SUM(score) AS s FROM t "
    "GROUP BY uid) u GROUP BY 1",
    "WITH f AS (SELECT uid, MIN(DATE_TRUNC('month', day)) AS m FROM t GROUP BY uid) "
    "SELECT m, COUNT(*) FROM f GROUP BY m",
    "SELECT grp, AVG(n), COUNT(*) FROM (SELECT uid, grp, COUNT(*) AS n, MAX(age) AS a "
    "FROM t WHERE flag GROUP BY uid, grp HAVING COUNT(*) >= 1) u GROUP BY grp",
    "SELECT COUNT(DISTINCT top) FROM (SELECT uid, LEAST(GREATEST(MAX(age), 0), 50) AS top "
    "FROM t GROUP BY uid) u",
]


@pytest.mark.parametrize("sql", PER_UNIT, ids=[s[:70] for s in PER_UNIT])
def test_per_unit_relations_match_duckdb(clean, sql):
    _same(clean, sql)


def test_thresholded_keys_match_duckdb(clean):
    """GROUP BY a non-public key: the same groups pass tau (zero noise), with the same values."""
    for conn in clean:
        conn.cursor().execute("SET epsilon = 10")
        conn.cursor().execute("SET partition_selection = 'threshold'")  # τ, not π(n)
    got = _same(clean, "SELECT name, COUNT(*), AVG(score) FROM t GROUP BY name")
    assert {r[0] for r in got} == {"alpha", "beta"}  # 'zeta' (one unit) stays below tau


def test_public_histogram_releases_empty_bins_on_spark(clean):
    got = _same(clean, "SELECT age, COUNT(*) FROM t WHERE flag AND score > 100 GROUP BY age")
    assert [a for a, _ in got] == list(range(91))
    # a WHERE on the key's own column restricts its bins on Spark as on DuckDB
    got = _same(clean, "SELECT age, COUNT(*) FROM t WHERE age < 5 GROUP BY age")
    assert [a for a, _ in got] == list(range(5))


def test_fixture_matches_when_bounds_do_not_bind(spark):
    policy = fixture_policy(
        privacy={"budget_epsilon": 1e9},
        table={"max_rows_per_unit": 100, "max_groups_per_unit": 100},
    )
    pair = _pair(policy, spark)
    try:
        _same(pair, "SELECT COUNT(*), COUNT(cost), SUM(cost), AVG(cost) FROM visits")
        _same(
            pair,
            "SELECT department, COUNT(*), AVG(cost), STDDEV(cost), VAR_POP(age) FROM visits "
            "WHERE visit_date >= DATE '2024-03-01' AND NOT smoker GROUP BY department",
        )
        _same(pair, "SELECT smoker, COUNT(DISTINCT patient_id), SUM(age) FROM visits GROUP BY 1")
    finally:
        for conn in pair:
            conn.close()


# -- bounds that bind: invariants, and equality where the choice cannot matter -----------------


@pytest.fixture(scope="module")
def heavy(tmp_path_factory, spark):
    """Sampled bounding (R rows, G groups by keyed hash) on both engines; the rescaled default
    is compared across engines by the cases above."""
    policy, groups_of = heavy_policy(tmp_path_factory.mktemp("heavy"))
    policy["tables"]["t"]["bounding"] = "sample"
    pair = _pair(policy, spark)
    yield pair, groups_of
    for conn in pair:
        conn.close()


def test_r_binding_totals_equal_across_engines(heavy):
    """Without GROUP BY each unit keeps exactly R = 2 of its 20 rows on either engine."""
    pair, _ = heavy
    assert _same(pair, "SELECT COUNT(*), COUNT(DISTINCT uid) FROM t") == [(100, 50)]
    expected_sum = sum(2 * min(uid % 11, 8) for uid in range(1, 51))
    assert _same(pair, "SELECT SUM(val), AVG(val) FROM t")[0][0] == expected_sum


@pytest.mark.parametrize("engine", ["duckdb", "spark"])
def test_each_unit_keeps_r_rows_in_at_most_g_groups(heavy, engine):
    pair, groups_of = heavy
    conn = pair[0] if engine == "duckdb" else pair[1]
    result = rows_of(conn, "SELECT grp, COUNT(*), COUNT(DISTINCT uid), SUM(val) FROM t GROUP BY 1")
    counts = {g: n for g, n, _, _ in result}
    units = {g: u for g, _, u, _ in result}
    assert sum(counts.values()) == 50 * 3 * 2  # every unit: G = 3 groups x R = 2 rows
    assert sum(units.values()) == 50 * 3
    for g in GRP5:
        assert units[g] <= sum(g in gs for gs in groups_of.values())
        assert counts[g] == 2 * units[g]
    assert sum(r[3] for r in result) == sum(3 * 2 * min(uid % 11, 8) for uid in range(1, 51))


def test_fixture_with_its_own_bounds(spark):
    """visits (R = 5, G = 3): COUNT is sum of min(n, 5) on both; a per-patient-constant key
    never makes G bind, so that GROUP BY is identical too."""
    pair = _pair(fixture_policy(privacy={"budget_epsilon": 1e9}), spark)
    try:
        for where in ("", "WHERE department = 'cardiology'"):
            _same(pair, f"SELECT COUNT(*) FROM visits {where}")
        _same(pair, "SELECT smoker, FLOOR(age / 10) AS d, COUNT(*) FROM visits GROUP BY 1, 2")
    finally:
        for conn in pair:
            conn.close()


def test_folded_row_level_plans_agree(spark):
    """Row-level keys over small public domains fold (dpsql.lower.fold): both engines run the
    two-level plan and release the same exact measures."""
    policy = fixture_policy(privacy={"budget_epsilon": 1e9})
    for key in ("privacy_unit", "max_rows_per_unit", "max_groups_per_unit"):
        policy["tables"]["visits"].pop(key)
    pair = _pair(policy, spark)
    try:
        _same(
            pair,
            "SELECT smoker, FLOOR(age / 10) * 10 AS d, COUNT(*), SUM(cost), VARIANCE(age) "
            "FROM visits WHERE visit_date >= DATE '2024-03-01' GROUP BY 1, 2",
        )
        _same(pair, "SELECT age % 4 AS r, AVG(cost) FROM visits GROUP BY 1")
    finally:
        for conn in pair:
            conn.close()


# -- the rule-list table function on Spark-resident data ---------------------------------------


def test_rule_list_on_spark_matches_duckdb(spark):
    """dp_rule_list reads its bounded rows through the engine; with bounds that do not bind
    and the same seeded noise both engines learn the same list."""
    policy = fixture_policy(table={"max_rows_per_unit": 100})
    query = (
        "SELECT position, rule, prediction, noisy_negative, noisy_positive FROM dp_rule_list("
        "'visits', label => 'smoker', epsilon => 1.0, max_length => 3, "
        "mechanism => 'monotone_em') ORDER BY position"
    )
    results = []
    for options in ({}, {"engine": "spark", "spark_session": spark}):
        with dpsql.connect(
            policy=policy, ledger=MemoryLedger(), noise=SeededNoise(7), cache=False, **options
        ) as conn:
            results.append(rows_of(conn, query))
    assert results[0] == results[1]
    assert len(results[1]) >= 1


# -- bad input at connect or first query: clear errors, nothing charged ------------------------


def _spend(conn):
    return conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset)


def test_missing_catalog_table_is_a_policy_error(spark):
    policy = fixture_policy()
    policy["tables"]["visits"]["source"] = "analytics.no_such_visits"
    with pytest.raises(PolicyError) as err:
        exact_connect(policy, engine="spark", spark_session=spark)
    assert "not found in the Spark catalog" in str(err.value)
    assert err.value.construct == "tables.visits.source"


def test_catalog_table_source(spark, tmp_path):
    """A table of the Spark catalog (here a temp view of the caller's session) as the source;
    dpsql's own views live in an isolated session and do not leak into the caller's."""
    rows = [(u, "a" if u % 2 else "b", u % 7) for u in range(1, 41)]
    spark.createDataFrame(rows, "uid long, grp string, val long").createOrReplaceGlobalTempView(
        "dpsql_catalog_src"
    )
    cols = {
        "uid": {"type": "int"},
        "grp": {"type": "text", "values": ["a", "b"], "nullable": False},
        "val": {"type": "int", "lower": 0, "upper": 5},
    }
    policy = table_policy(tmp_path / "unused.csv", cols, unit="uid", rows=1, groups=1)
    policy["tables"]["t"]["source"] = "global_temp.dpsql_catalog_src"
    policy["engine"] = {"name": "spark"}
    with exact_connect(policy, spark_session=spark) as conn:
        got = rows_of(conn, "SELECT grp, COUNT(*), SUM(val) FROM t GROUP BY grp")
    expected = [
        ("a", 20, sum(min(u % 7, 5) for u in range(1, 41, 2))),
        ("b", 20, sum(min(u % 7, 5) for u in range(2, 41, 2))),
    ]
    assert_same_rows(got, expected)
    assert not spark.catalog.tableExists("t")


def test_schema_missing_column_is_a_policy_error(spark, tmp_path):
    path = write_csv(tmp_path / "s.csv", ["uid", "grp"], [(1, "a"), (2, "b")])
    cols = {"uid": {"type": "int"}, "grp": {"type": "text"}, "age": {"type": "int"}}
    with pytest.raises(PolicyError) as err:
        exact_connect(table_policy(path, cols), engine="spark", spark_session=spark)
    message = str(err.value)
    assert "age" in message and "uid, grp" in message


def test_schema_wrong_type_in_csv_is_a_policy_error(spark, tmp_path):
    path = write_csv(tmp_path / "s.csv", ["uid", "age"], [(1, "12"), (2, "secret-value")])
    cols = {"uid": {"type": "int"}, "age": {"type": "int", "lower": 0, "upper": 99}}
    with pytest.raises(PolicyError) as err:
        exact_connect(table_policy(path, cols), engine="spark", spark_session=spark)
    assert err.value.construct == "tables.t.columns.age.type"
    assert "secret-value" not in str(err.value)  # never echo data values


def test_schema_wrong_type_in_parquet_is_a_policy_error(spark, tmp_path):
    target = str(tmp_path / "p.parquet")
    spark.createDataFrame([(1, "x"), (2, "y")], "uid long, age string").write.parquet(target)
    cols = {"uid": {"type": "int"}, "age": {"type": "int", "lower": 0, "upper": 99}}
    policy = table_policy(Path(target), cols)
    policy["engine"] = {"name": "spark"}  # a Parquet *directory*: Spark-only source
    with pytest.raises(PolicyError) as err:
        exact_connect(policy, spark_session=spark)
    assert "declared 'int'" in str(err.value) and "string" in str(err.value)


def test_parquet_directory_source_matches_csv(spark, tmp_path):
    rows = _clean_rows()
    csv_path = write_csv(tmp_path / "t.csv", HEADER, rows)
    target = str(tmp_path / "t.parquet")
    spark.read.option("header", True).csv(str(csv_path)).selectExpr(
        "CAST(uid AS BIGINT) uid",
        "grp",
        "CAST(age AS INT) age",
        "CAST(score AS DOUBLE) score",
        "CAST(flag AS BOOLEAN) flag",
        "name",
        "CAST(day AS DATE) day",
    ).write.parquet(target)
    from_csv = table_policy(csv_path, COLUMNS, unit="uid", rows=3, groups=3)
    from_parquet = table_policy(Path(target), COLUMNS, unit="uid", rows=3, groups=3)
    from_parquet["engine"] = {"name": "spark"}
    sql = (
        "SELECT grp, COUNT(*), AVG(score), SUM(age) FROM t WHERE day < DATE '2024-09-01' GROUP BY 1"
    )
    with exact_connect(from_csv) as duck, exact_connect(from_parquet, spark_session=spark) as pq:
        assert_same_rows(rows_of(pq, sql), rows_of(duck, sql), rel=1e-12)
        assert pq.service.engine.versions["t"].startswith("dir:")


def test_engine_failure_mid_query_is_uniform_and_charged(clean, monkeypatch):
    """A Spark failure mid-query is the one uniform OperationalError (58000) whose cost
    stands: the cost was reserved before Spark read a row (pay before reading)."""
    from dpsql.boundary import FAILED_AFTER_READ

    _, on_spark = clean
    engine = on_spark.service.engine
    before = _spend(on_spark)

    def broken_sql(sql):
        raise RuntimeError("executor lost")

    monkeypatch.setattr(engine._spark, "sql", broken_sql)
    cur = on_spark.cursor()
    with pytest.raises(OperationalError) as err:
        cur.execute("SELECT COUNT(*) FROM t")
    assert err.value.sqlstate == "58000" and err.value.message == FAILED_AFTER_READ
    assert "executor lost" not in str(err.value)
    assert _spend(on_spark).epsilon == before.epsilon + on_spark._settings.epsilon
    with pytest.raises(dpsql.Error):
        cur.fetchall()


def test_division_by_zero_in_where_is_null_not_an_error(clean):
    """ANSI mode is off in dpsql's Spark session: a data-dependent runtime error would be an
    uncharged side channel. On Spark x / 0 is NULL (the row is filtered out); DuckDB gives
    +inf, so the engines differ exactly on the rows with a zero divisor."""
    duck, on_spark = clean
    got = rows_of(on_spark, "SELECT COUNT(*) FROM t WHERE 100 / (age - 37) > 1")
    assert got == rows_of(duck, "SELECT COUNT(*) FROM t WHERE age <> 37 AND 100 / (age - 37) > 1")


def test_cli_query_on_spark_from_the_policy(spark, tmp_path, capsys):
    """`dpsql query --engine spark` runs and charges like on DuckDB; it joins the test's
    running session (getOrCreate) and must not stop it when done. The answer cache is keyed
    by data version, not engine."""
    from conftest import FIXTURE_CSV, FIXTURE_TOML

    from dpsql.cli import main

    text = FIXTURE_TOML.read_text().replace('source = "visits.csv"', f'source = "{FIXTURE_CSV}"')
    policy = tmp_path / "visits.toml"
    policy.write_text(text + '\n[engine]\nname = "spark"\nmaster = "local[2]"\n')
    outputs = []
    for engine in ("spark", "duckdb"):
        sql = "SELECT COUNT(*) AS n FROM visits WHERE age > 50"
        assert main(["query", sql, "--policy", str(policy), "--engine", engine]) == 0
        outputs.append(capsys.readouterr())
    assert "charged epsilon=1" in outputs[0].err
    # Same analyst, same data version, same plan: DuckDB serves Spark's cached answer.
    assert "cached" in outputs[1].err and outputs[1].out == outputs[0].out
    assert spark.sparkContext._jsc is not None  # the shared session is still running
    assert spark.range(3).count() == 3


def test_cancelled_query_is_not_run_or_charged(clean, monkeypatch):
    """A connection interrupted before its query runs raises 57014; nothing is charged."""
    from dpsql.engine.base import QueryHandle

    _, on_spark = clean
    engine = on_spark.service.engine
    handle = QueryHandle()
    handle.interrupt()
    compiled_sql: list[str] = []
    before = _spend(on_spark)
    monkeypatch.setattr(engine._spark, "sql", compiled_sql.append)
    with pytest.raises(OperationalError) as err:
        on_spark.service.execute(
            "SELECT COUNT(*) FROM t", None, on_spark._settings, on_spark.analyst, handle
        )
    assert err.value.sqlstate == "57014"
    assert compiled_sql == [] and _spend(on_spark) == before


def test_wire_server_on_spark(clean, tmp_path):
    """The PostgreSQL wire server over a Spark-backed Service answers like the DuckDB one."""
    from dpsql.server.server import Server, ServerThread
    from dpsql.server.testing import RawClient
    from dpsql.server.users import UserStore

    duck, on_spark = clean
    users = UserStore(tmp_path / "t.users.json")
    users.add("alice", "pw-alice")
    thread = ServerThread(lambda: Server(on_spark.service, users))
    thread.start()
    try:
        client = RawClient("127.0.0.1", thread.port, timeout=300)
        assert client.login("alice", "pw-alice", database="t").status == "I"
        reply = client.query("SELECT grp, COUNT(*) FROM t GROUP BY grp ORDER BY grp NULLS LAST")
        client.close()
    finally:
        thread.stop()
    expected = rows_of(duck, "SELECT grp, COUNT(*) FROM t GROUP BY grp ORDER BY grp NULLS LAST")
    assert reply.text_rows() == [[g, str(n)] for g, n in expected]


QUANTILE_SHAPES = [
    "SELECT grp, MIN(age), MAX(age), MEDIAN(age) FROM t GROUP BY grp",
    "SELECT PERCENTILE_CONT(0.9) WITHIN GROUP (ORDER BY score), QUANTILE_DISC(age, 0.25) FROM t",
    "SELECT grp, COUNT(DISTINCT age), COUNT(DISTINCT name) FROM t GROUP BY grp",
]


@pytest.mark.parametrize("sql", QUANTILE_SHAPES)
def test_quantiles_and_distinct_counts_match_duckdb(clean, sql):
    """Noise off, the EM releases its best bin: the same bin counts on both engines."""
    _same(clean, sql)


def test_binding_quantiles_and_distinct_counts_match_duckdb(heavy):
    pair, _ = heavy
    _same(pair, "SELECT COUNT(DISTINCT i), COUNT(i), MAX(val), MIN(i) FROM t")
