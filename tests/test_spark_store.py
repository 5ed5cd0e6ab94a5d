"""The prepared store on Spark (dpsql.engine.spark_store): the same plans, the same measures.

For the same secret, every exact measure of the store-backed plan on Spark equals the Spark
plan without a store (fixture queries, row-level and privacy unit, and generated data where R
and G bind for half the units); where no bound binds it equals DuckDB's. A disk store is reused
by a later engine with the same key and rebuilt on a new data version. One local Spark session
is shared by the module and the worker's other Spark modules (Spark tests are slow: few, small).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import fixture_policy, local_spark, require_spark, table_policy, write_csv
from test_prepared_store import (
    FIXTURE_QUERIES,
    GEN_COLUMNS,
    GEN_QUERIES,
    _gen_rows,
    prepare_policy,
    unrouted,  # noqa: F401 (a fixture, used by name: the two-phase plan for every shape)
)

from dpsql.engine import prepared, spark_store
from dpsql.frontend.bind import parse_statement
from dpsql.lower.compile import compile_plan
from dpsql.pipeline import Service, Settings
from dpsql.policy import load_policy
from dpsql.privacy.ledger import MemoryLedger

pytestmark = pytest.mark.spark
require_spark()

SECRETS = (0, 2**62 - 1)


@pytest.fixture(scope="module")
def spark():
    session = local_spark()
    # not stopped: the next Spark module of this worker joins it (a new context costs seconds)
    yield session


def _with_store(policy, mode: str = "memory", **extra):
    policy = policy if not isinstance(policy, dict) else load_policy(policy)
    engine = dataclasses.replace(policy.engine, prepared=mode, **extra)
    return dataclasses.replace(policy, engine=engine)


def _service(policy, spark=None) -> Service:
    engine = "spark" if spark is not None else "duckdb"
    return Service(policy, ledger=MemoryLedger(), cache=False, engine=engine, spark_session=spark)


def _rows(svc: Service, compiled) -> list[tuple]:
    got = svc.engine.execute(compiled)
    return sorted(zip(got.key_rows, *got.measures, strict=True), key=repr)


def _compare(svc: Service, queries: list[str], secrets=SECRETS) -> int:
    """Spark plan without a store vs with it, same secret, exact measures; how many used it."""
    settings = Settings.from_policy(svc.policy)
    # its subject is the store plan; bias measures are not in these plans: docs/bias.md
    # (a plan with them falls back to the generic bounded SQL, without the store)
    settings.bias_estimate = "off"
    settings.delta = 1e-6
    used = 0
    for q in queries:
        plan = svc.plan(parse_statement(q, svc.policy), settings)
        old = compile_plan(plan, 0, store=False)
        new = compile_plan(plan, 0)
        used += "__dp_store_" in new.render("spark")
        for secret in secrets:
            want = _rows(svc, old.with_secret(secret))
            assert _rows(svc, new.with_secret(secret)) == want, (q, secret)
    return used


@pytest.mark.usefixtures("unrouted")
def test_fixture_store_plans_are_exact_on_spark(spark):
    svc = _service(_with_store(fixture_policy()), spark)
    try:
        (info,) = svc.engine.stores
        assert info.hash_mix is None and info.unit_rows == "__dp_un" and info.rows > 0
        assert prepared.lookup(svc.policy.tables["visits"], info.version) is info
        assert _compare(svc, FIXTURE_QUERIES[:1]) == 1  # two secrets
        assert _compare(svc, [FIXTURE_QUERIES[i] for i in (1, 2)], secrets=(4242,)) == 2
        settings = Settings.from_policy(svc.policy)
        settings.bias_estimate = "off"  # the store plan (bias: docs/bias.md)
        thresholded = svc.plan(parse_statement(FIXTURE_QUERIES[-1], svc.policy), settings)
        assert "__dp_store_" not in compile_plan(thresholded, 1).render("spark")
    finally:
        svc.close()
    assert prepared.lookup(svc.policy.tables["visits"], info.version) is None


@pytest.fixture(scope="module")
def gen_csv(tmp_path_factory) -> Path:
    return write_csv(tmp_path_factory.mktemp("gen") / "t.csv", list(GEN_COLUMNS), _gen_rows())


@pytest.mark.usefixtures("unrouted")
def test_binding_bounds_and_row_level_are_exact_on_spark(spark, gen_csv):
    """R = 2, G = 2 bind for half the units (all three phases run); row-level too."""
    for unit in ("uid", None):
        policy = table_policy(gen_csv, GEN_COLUMNS, unit=unit, rows=2, groups=2)
        svc = _service(_with_store(policy), spark)
        try:
            assert _compare(svc, GEN_QUERIES[:3], secrets=(4242,)) == 3
            if unit is not None:  # a WHERE: the two-phase plan, its direct sums over all rows
                settings = Settings.from_policy(svc.policy)
                settings.bias_estimate = "off"  # the store plan (bias: docs/bias.md)
                plan = svc.plan(parse_statement(GEN_QUERIES[2], svc.policy), settings)
                text = svc.engine._render(compile_plan(plan, 1)).upper()
                # every SUM accumulates in DECIMAL(38, 0): Spark's SUM(BIGINT) wraps past 2^63
                assert "GROUPED AS" in text and text.count("SUM(") == text.count("SUM(CAST(")
        finally:
            svc.close()


def test_store_rows_match_the_duckdb_store(spark, gen_csv):
    """Same derived columns and values as the DuckDB store (the hash mix aside)."""
    policy = table_policy(gen_csv, GEN_COLUMNS, unit="uid", rows=2, groups=2)
    duck, on_spark = _service(_with_store(policy)), _service(_with_store(policy), spark)
    try:
        d_info, s_info = duck.engine.stores[0], on_spark.engine.stores[0]
        columns = [*GEN_COLUMNS, d_info.unit_rows, *d_info.pair_rows.values()]
        columns += [*d_info.unit_keys.values(), *(fp for _, _, fp in d_info.fixed.values())]
        assert (s_info.pair_rows, s_info.unit_keys, s_info.fixed) == (
            d_info.pair_rows,
            d_info.unit_keys,
            d_info.fixed,
        )
        names = ", ".join(columns[1:])  # uid first, then the rest in order
        want = duck.engine._con.execute(
            f"SELECT uid, {names} FROM __dp_store_t ORDER BY ALL"
        ).fetchall()
        got = on_spark.engine._spark.sql(f"SELECT uid, {names} FROM __dp_store_t").collect()
        key = lambda r: tuple((v is None, str(v)) for v in r)  # noqa: E731
        assert sorted(map(tuple, got), key=key) == sorted(want, key=key)
    finally:
        duck.close()
        on_spark.close()


def test_matches_duckdb_where_no_bound_binds(spark, gen_csv):
    """R and G larger than any unit: the Spark store plan releases DuckDB's measures."""
    policy = table_policy(gen_csv, GEN_COLUMNS, unit="uid", rows=25, groups=6)
    duck, on_spark = _service(policy), _service(_with_store(policy), spark)
    settings = Settings.from_policy(duck.policy)
    settings.bias_estimate = "off"  # the store plan (bias: docs/bias.md)
    settings.delta = 1e-6
    try:
        table = duck.policy.tables["t"]
        version = on_spark.engine.stores[0].version
        # compile_plan's own lookup is engine-blind: each engine's compile names its stores
        assert prepared.lookup(table, version, "duckdb") is None
        spark_info = prepared.lookup(table, version, "spark")
        assert spark_info is on_spark.engine.stores[0]
        for q in GEN_QUERIES[:2]:  # at most 6 groups (dept and NULL) per unit, 20 rows
            plan = duck.plan(parse_statement(q, duck.policy), settings)
            spark_plan = on_spark.plan(parse_statement(q, on_spark.policy), settings)
            compiled = compile_plan(spark_plan, 7, store=spark_info)
            assert "__dp_store_" in compiled.render("spark")
            want = _rows(duck, compile_plan(plan, 7, store=False))
            assert _rows(on_spark, compiled) == want, q
    finally:
        duck.close()
        on_spark.close()


def _disk_policy(csv_path: Path, store_dir: Path, version: str):
    policy = table_policy(csv_path, GEN_COLUMNS, unit="uid", rows=3, groups=2)
    policy["tables"]["t"]["version"] = version
    return _with_store(policy, "disk", prepared_dir=str(store_dir))


@pytest.mark.usefixtures("unrouted")
def test_disk_store_reused_then_rebuilt_on_a_new_version(spark, gen_csv, tmp_path):
    store_dir = tmp_path / "store"
    first = _service(_disk_policy(gen_csv, store_dir, "v1"), spark)
    info1 = first.engine.stores[0]
    first.close()
    path1 = Path(info1.path)
    assert not info1.reused and (path1 / spark_store.META).is_file()
    assert oct(path1.stat().st_mode & 0o777) == "0o700"
    assert ("t", "v1") not in spark_store.STORES  # closed: unregistered

    again = _service(_disk_policy(gen_csv, store_dir, "v1"), spark)
    try:
        assert again.engine.stores[0].reused and again.engine.stores[0].path == info1.path
        assert _compare(again, GEN_QUERIES[:2], secrets=(9,)) == 2
    finally:
        again.close()

    # a tampered key is never read: rebuilt under the same name
    (path1 / spark_store.META).write_text(json.dumps({"key": "other"}))
    rebuilt = _service(_disk_policy(gen_csv, store_dir, "v1"), spark)
    assert not rebuilt.engine.stores[0].reused
    rebuilt.close()

    changed = _service(_disk_policy(gen_csv, store_dir, "v2"), spark)
    try:
        info2 = changed.engine.stores[0]
        assert not info2.reused and info2.path != info1.path and not path1.exists()
        assert _compare(changed, GEN_QUERIES[:1], secrets=(9,)) == 1
    finally:
        changed.close()


def test_a_duckdb_store_plan_runs_exactly_on_spark(spark, gen_csv):
    """One process, both engines, one table and version: compile_plan finds the DuckDB store
    (its hash mix, its file), and the Spark engine -- with its own store or none -- runs that
    tree on its view, the mix replaced by the keyed hash: the measures of its plain plan."""
    policy = table_policy(gen_csv, GEN_COLUMNS, unit="uid", rows=2, groups=2)
    policy["tables"]["t"]["bounding"] = "sample"  # the hash mix is a sampling plan's
    duck = _service(_with_store(policy))
    engines = [_service(_with_store(policy), spark), _service(load_policy(policy), spark)]
    settings = Settings.from_policy(duck.policy)
    settings.bias_estimate = "off"  # the store plan (bias: docs/bias.md)
    settings.delta = 1e-6
    try:
        assert duck.engine.stores[0].hash_mix is not None
        for q in GEN_QUERIES[:2]:
            plan = duck.plan(parse_statement(q, duck.policy), settings)
            tree = compile_plan(plan, 31)
            assert "__dp_h" in tree.render("duckdb")
            for svc in engines:
                assert _rows(svc, tree) == _rows(svc, compile_plan(plan, 31, store=False)), q
    finally:
        for svc in (duck, *engines):
            svc.close()


def test_dpsql_prepare_builds_then_reuses_on_spark(spark, gen_csv, tmp_path, capsys):
    """``dpsql prepare`` with [engine] name = "spark": Parquet next to the ledger, reported with
    its size and time, reused by the next run of the same data version."""
    from dpsql.cli import main

    engine = '[engine]\nname = "spark"\nmaster = "local[1]"\n\n'
    policy = prepare_policy(tmp_path, gen_csv, engine)
    assert main(["prepare", "--policy", str(policy)]) == 0
    first = capsys.readouterr()
    assert "\tbuilt\t" in first.out and "building the Spark prepared store" in first.err
    assert ".spark.parquet" in first.out and " MiB\t" in first.out
    assert main(["prepare", "--policy", str(policy)]) == 0
    assert "\treused\t" in capsys.readouterr().out
    assert list((tmp_path / "dpsql-store").glob("t-*.spark.parquet"))
    assert spark.sparkContext._jsc is not None  # the shared session is still up
