"""Shared helpers for the core test suite: small dict policies, exact connections, spies.

Exact connections use the internal test hooks (``ZeroNoise``, a ``MemoryLedger``, no answer
cache) so a query returns its exact contribution-bounded aggregates, which tests compare with
hand-written reference SQL run directly in DuckDB.
"""

from __future__ import annotations

import copy
import csv
import math
import os
import random
import shutil
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import duckdb
import pytest

import dpsql
from dpsql.engine import columnar
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise
from dpsql.privacy.sqlite_ledger import SQLiteLedger

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_TOML = ROOT / "fixtures" / "visits.toml"
FIXTURE_CSV = ROOT / "fixtures" / "visits.csv"
DATA = Path(__file__).resolve().parent / "data"

# cl(x, lo, hi): clamp like dpsql does. Not LEAST(GREATEST(...)) alone: DuckDB's GREATEST and
# LEAST skip NULL arguments, so GREATEST(NULL, lo) is lo, not NULL.
CLAMP_MACRO = (
    "CREATE MACRO cl(x, lo, hi) AS "
    "CASE WHEN x IS NULL THEN NULL ELSE LEAST(GREATEST(x, lo), hi) END"
)


def pytest_configure(config: pytest.Config) -> None:
    """Compile the engine's kernels into numba's on-disk cache once, in the controller before
    xdist starts its workers, then load them in each worker (~1 s), so the compiled passes
    run from the first test (dpsql.engine.kernel_readiness). In a fresh clone each worker,
    and every CLI or server subprocess started before the cache was written, compiled them
    again: ~2 min of CPU each (measured 124 s for ``warm_up``, 1.3 s to load them cached)."""
    columnar.warm_up()


def fixture_policy(*, privacy: dict | None = None, table: dict | None = None) -> dict:
    """The shipped fixture's policy as a dict (source made absolute), with overrides."""
    policy = tomllib.loads(FIXTURE_TOML.read_text())
    policy["tables"]["visits"]["source"] = str(FIXTURE_CSV)
    policy["privacy"].update(privacy or {})
    policy["tables"]["visits"].update(table or {})
    return policy


def write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
    """CSV with empty cells for None (read back as NULL)."""
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        for row in rows:
            writer.writerow(["" if v is None else v for v in row])
    return path


def table_policy(
    path: Path,
    columns: dict[str, dict],
    *,
    name: str = "t",
    unit: str | None = None,
    rows: int = 1,
    groups: int = 1,
    privacy: dict | None = None,
) -> dict:
    """A one-table dict policy over the CSV at ``path``."""
    spec: dict[str, Any] = {"source": str(path), "columns": copy.deepcopy(columns)}
    if unit is not None:
        spec.update(privacy_unit=unit, max_rows_per_unit=rows, max_groups_per_unit=groups)
    base = {"epsilon": 1.0, "delta": 1e-6, "budget_epsilon": 1e9, "budget_delta": 0.5}
    base.update(privacy or {})
    return {"privacy": base, "tables": {name: spec}}


GRP5 = ["g1", "g2", "g3", "g4", "g5"]


def heavy_policy(directory: Path) -> tuple[dict, dict[int, list[str]]]:
    """50 units, each with 5 rows in each of 4 of GRP5's groups (R = 2, G = 3 both bind).

    Returns the policy and each unit's groups. ``val`` is constant per unit (uid % 11), so
    clamping to [0, 8] binds for 9 and 10.
    """
    rnd = random.Random(3)
    rows, groups_of = [], {}
    for uid in range(1, 51):
        groups_of[uid] = rnd.sample(GRP5, 4)
        for g in groups_of[uid]:
            rows += [(uid, g, uid % 11, i) for i in range(5)]
    path = write_csv(directory / "h.csv", ["uid", "grp", "val", "i"], rows)
    cols = {
        "uid": {"type": "int"},
        "grp": {"type": "text", "values": GRP5, "nullable": False},
        "val": {"type": "int", "lower": 0, "upper": 8},
        "i": {"type": "int", "lower": 0, "upper": 4},
    }
    return table_policy(path, cols, unit="uid", rows=2, groups=3), groups_of


def budget(conn: dpsql.Connection) -> dict[str, Any]:
    """The analyst's ``SHOW budget WIDE`` row, by column name: spent_epsilon, spent_delta,
    spent_rho (the filter's view), charged_epsilon, charged_delta, gaussian_rho (raw sums)..."""
    cur = conn.cursor()
    cur.execute("SHOW budget WIDE")
    names = [d[0] for d in cur.description]
    return dict(zip(names, cur.fetchone(), strict=True))


def declared_clips(policy: Any) -> Any:
    """A dict policy with ``clip = "declared"`` on every number column that states no clip:
    its SUM/AVG/VAR clamp to the declared bounds, as an exactness test's reference SQL does
    (unstated, the clamp range is chosen from a kept DP histogram: dpsql.service.bounds,
    tested in tests/test_default_clamp.py). Other policies are returned as they are."""
    if not isinstance(policy, dict):
        return policy
    policy = copy.deepcopy(policy)
    for table in (policy.get("tables") or {}).values():
        if not isinstance(table, dict):
            continue
        for column in (table.get("columns") or {}).values():
            if isinstance(column, dict) and column.get("type") in ("int", "float"):
                column.setdefault("clip", "declared")
    return policy


def exact_connect(policy: Any, **options: Any) -> dpsql.Connection:
    """A connection releasing exact bounded aggregates (noise switched off), clamped to the
    declared bounds (:func:`declared_clips`)."""
    options.setdefault("ledger", MemoryLedger())
    options.setdefault("noise", ZeroNoise())
    options.setdefault("cache", False)
    return dpsql.connect(policy=declared_clips(policy), **options)


def rows_of(conn: dpsql.Connection, sql: str, params: Sequence[Any] | None = None) -> list:
    cur = conn.cursor()
    cur.execute(sql, params)
    return cur.fetchall()


def _sort_key(row: Sequence[Any]) -> tuple:
    return tuple((v is None, repr(type(v)) if v is None else "", v) for v in row)


def assert_same_rows(
    got: Sequence[Sequence[Any]],
    expected: Sequence[Sequence[Any]],
    *,
    ordered: bool = False,
    rel: float = 1e-9,
    abs_tol: float = 1e-9,
) -> None:
    """Row sets equal, numbers compared with a relative tolerance (fixed point -> float)."""
    got = [tuple(r) for r in got]
    expected = [tuple(r) for r in expected]
    if not ordered:
        got = sorted(got, key=_sort_key)
        expected = sorted(expected, key=_sort_key)
    assert len(got) == len(expected), f"{len(got)} rows, expected {len(expected)}:\n{got}"
    for g_row, e_row in zip(got, expected, strict=True):
        assert len(g_row) == len(e_row), (g_row, e_row)
        for g, e in zip(g_row, e_row, strict=True):
            if isinstance(e, float) or isinstance(g, float):
                assert g is not None and e is not None, (g_row, e_row)
                assert math.isclose(float(g), float(e), rel_tol=rel, abs_tol=abs_tol), (
                    g_row,
                    e_row,
                )
            else:
                assert g == e, (g_row, e_row)


class EngineSpy:
    """Records every compiled query the private engine runs (and lets it run)."""

    def __init__(self, service: dpsql.Service) -> None:
        self.engine = service.engine
        self.original = self.engine.execute
        self.sql: list[str] = []
        self.engine.execute = self  # type: ignore[method-assign]

    def __call__(self, compiled, handle=None):
        self.sql.append(compiled.render(self.engine.dialect))
        return self.original(compiled, handle)

    @property
    def calls(self) -> int:
        return len(self.sql)


@pytest.fixture(params=["memory", "sqlite"])
def any_ledger(request, tmp_path: Path):
    """A MemoryLedger and a SQLiteLedger: protocol-level behaviour must be the same for both."""
    if request.param == "memory":
        yield MemoryLedger()
    else:
        with SQLiteLedger(tmp_path / "l.sqlite") as led:
            yield led


def require_spark() -> None:
    """Skip the calling test module (or fixture) unless pyspark and a Java runtime are there."""
    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'dpsql[spark]')")
    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        pytest.skip("Spark needs Java 17+ (no java on PATH, no JAVA_HOME)", allow_module_level=True)


def local_spark() -> Any:
    """The test suite's one local Spark session (two cores, no UI), created or joined; the
    Spark modules of a worker share it and do not stop it (a new context costs seconds)."""
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("dpsql-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.default.parallelism", "2")
        # Tiny tables: a query's time is Spark's own per-query work, not the data's. Adaptive
        # re-planning, a second shuffle partition and whole-stage code generation (the
        # interpreted operators compute the same values; tests/test_spark_engine.py turns it
        # back on for its DuckDB comparisons) cost ~20% of the JVM's CPU in five Spark tests
        # (157.6 / 142.0 s -> 116.6 / 124.5 s, alternated, load 12-23).
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.sql.codegen.wholeStage", "false")
        # The JIT's client compiler only and one GC thread: a test JVM lives minutes, so the
        # server compiler's work never pays back. The JVM's CPU over two short Spark tests
        # 105.1 / 108.9 s -> 57.7 / 52.4 s, over the two longest store tests 196.5 -> 131.6 s
        # (alternated, load 10-19; tests/conftest.py at ce5ef70 with SPARK_JOPTS).
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    return session


@pytest.fixture(scope="session")
def visits() -> Iterable[dpsql.Connection]:
    """Exact connection to the shipped fixture with its own policy (R = 5, G = 3)."""
    conn = exact_connect(fixture_policy(privacy={"budget_epsilon": 1e9}))
    yield conn
    conn.close()


@pytest.fixture(scope="session")
def visits_ref() -> Iterable[duckdb.DuckDBPyConnection]:
    """The fixture loaded directly into DuckDB with the policy's types, for reference SQL."""
    con = duckdb.connect(":memory:")
    con.execute(
        "CREATE TABLE visits AS SELECT CAST(patient_id AS BIGINT) AS patient_id, "
        "CAST(age AS BIGINT) AS age, department, diagnosis, CAST(cost AS DOUBLE) AS cost, "
        "CAST(visit_date AS DATE) AS visit_date, CAST(smoker AS BOOLEAN) AS smoker "
        f"FROM read_csv('{FIXTURE_CSV}', header = true, all_varchar = true)"
    )
    con.execute(CLAMP_MACRO)
    yield con
    con.close()


def as_released(plan: Any, released: Any) -> list[Any]:
    """The first output's values as the answer holds them: an integer-typed aggregate (COUNT,
    SUM of an int column) rounded, as dpsql.service.results does before any outer query."""
    from dpsql.aggregates import kind_of

    output = plan.outputs[0]
    column = plan.query.table.columns.get(output.call.column) if output.call.column else None
    values = released.outputs[0].tolist()
    if kind_of(output).released_type(column) == "BIGINT":
        return [round(v) for v in values]
    return values
