"""Spark with and without the prepared store (dpsql.engine.spark_store): wall time per query.

bench_core.py's data (``generate``) written once as Parquet, read by a local Spark session;
per query the plain Spark query, the DP plan without a store and over the store (engine SQL
alone, exact measures, one secret), median of ``--reps``; the store plan's measures are checked
equal to the plan's without a store. Wall times: Spark's work happens in its JVM.

    python bench/bench_spark_store.py --rows 1000000 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import sqlglot

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_core import COLUMNS, FLOORS, QUERIES, generate  # noqa: E402

from dpsql.dbapi import Service  # noqa: E402
from dpsql.engine import prepared  # noqa: E402
from dpsql.frontend.bind import parse_statement  # noqa: E402
from dpsql.lower.compile import compile_plan  # noqa: E402
from dpsql.pipeline import Settings  # noqa: E402
from dpsql.policy import load_policy  # noqa: E402
from dpsql.privacy.ledger import MemoryLedger  # noqa: E402


def _policy(parquet: Path, rows: int, groups: int, store: Path) -> dict:
    unit = {"privacy_unit": "patient_id", "max_rows_per_unit": rows, "max_groups_per_unit": groups}
    common = {"source": str(parquet), "columns": COLUMNS, "version": parquet.stem}
    return {
        "engine": {"name": "spark", "prepared": "disk", "prepared_dir": str(store)},
        "privacy": {"epsilon": 1.0, "delta": 1e-6, "budget_epsilon": 1e12, "budget_delta": 0.5},
        "tables": {"visits_rows": dict(common), "visits": {**common, **unit}},
    }


def _wall(fn, reps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _rows(result) -> list[tuple]:
    return sorted(zip(result.key_rows, *result.measures, strict=True), key=repr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-rows-per-unit", type=int, default=5)
    ap.add_argument("--max-groups-per-unit", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "dpsql-bench")
    args = ap.parse_args(argv)

    db = args.dir / f"visits_{args.rows}.duckdb"
    generate(db, args.rows, 0.5)
    parquet = args.dir / f"visits_{args.rows}.parquet"
    if not parquet.exists():
        con = duckdb.connect(str(db), read_only=True)
        con.execute(f"COPY visits TO '{parquet}' (FORMAT parquet)")
        con.close()

    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("dpsql-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    pol = load_policy(
        _policy(parquet, args.max_rows_per_unit, args.max_groups_per_unit, args.dir / "store")
    )
    start = time.perf_counter()
    svc = Service(pol, ledger=MemoryLedger(), cache=False, engine="spark", spark_session=spark)
    print(f"# engine + stores ready in {time.perf_counter() - start:.1f} s", flush=True)
    for info in svc.engine.stores:
        state = "reused" if info.reused else "built"
        print(
            f"# store {info.table}: {state} in {info.build_seconds:.1f} s, "
            f"{info.rows:,} rows, {info.bytes / 2**20:.1f} MiB",
            flush=True,
        )
    settings = Settings.from_policy(pol)
    settings.delta = 1e-6
    engine = svc.engine
    print("query\ttable\tplain s\tno store s\tstore s\tno store/plain\tstore/plain")
    for table in ("visits_rows", "visits"):
        for name, q in QUERIES.items():
            sql = q.format(t=table)
            plan = svc.plan(parse_statement(sql, pol), settings)
            old = compile_plan(plan, 12345, store=False)
            info = prepared.lookup(plan.query.table, plan.data_version, "spark")
            new = compile_plan(plan, 12345, store=info or False)
            floor = sqlglot.transpile(FLOORS[(name, table)], read="duckdb", write="spark")[0]
            plain, _ = _wall(lambda s=floor: engine._spark.sql(s).collect(), args.reps)
            t_old, a = _wall(lambda c=old: engine.execute(c), args.reps)
            t_new, b = _wall(lambda c=new: engine.execute(c), args.reps)
            same = _rows(a) == _rows(b)
            assert same, f"store plan of {name}/{table} differs"
            print(
                f"{name}\t{table}\t{plain:.2f}\t{t_old:.2f}\t{t_new:.2f}\t"
                f"{t_old / plain:.1f}x\t{t_new / plain:.1f}x",
                flush=True,
            )
    svc.close()
    spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
