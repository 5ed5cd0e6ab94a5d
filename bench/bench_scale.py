"""DuckDB vs Spark (local) on the same DP GROUP BY with a privacy unit, as rows grow.

For each size the script writes one Parquet file (DuckDB generates it), then runs the same
private query through dpsql on each engine, each engine in its own fresh process so that peak
memory is its own:

    SELECT grp, COUNT(*), AVG(val) FROM t GROUP BY grp      -- unit uid, R = 5, G = 3

Data (--shape typical): 96% of rows in ~N/10 units of 10 rows spread over 5 of the 20 public
groups (at most 3 rows in one group: G = 3 binds, R = 5 does not); 4% of rows in N/1000
heavy units of 40 rows in one group (R binds). --shape all-over: N/10 units of 10 rows all in
one group, so every (unit, group) exceeds R: the worst case for the row-sampling step.

Reported per engine and size: query time (best of --repeat runs), ns per row, peak RSS (DuckDB:
the whole process; Spark: the driver JVM plus the Python side), and for Spark the session
startup (JVM launch) and connect (policy load, schema check) separately.

    python bench/bench_scale.py --sizes 1000000,10000000 --repeat 2
    python bench/bench_scale.py --sizes 50000000 --engines spark --spark-memory 6g
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUERY = "SELECT grp, COUNT(*), AVG(val) FROM t GROUP BY grp"
GROUPS = 20


def _peak_rss_mb(pid: int | str = "self") -> float:
    """Peak resident set (VmHWM) of a live process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_data(rows: int, directory: Path, shape: str = "typical") -> Path:
    import duckdb

    path = directory / f"scale_{shape}_{rows}.parquet"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    if shape == "typical":
        heavy = "i % 1000 < 40"
        uid = f"CASE WHEN {heavy} THEN {rows} + i // 1000 ELSE i // 10 END"
        grp = (
            f"CASE WHEN {heavy} THEN (i // 1000) % {GROUPS} "
            f"ELSE ((i // 10) * 3 + (i % 10) * 7 + (i % 10) * (i % 10)) % {GROUPS} END"
        )
    else:
        units = max(rows // 10, 1)
        uid, grp = f"(i * 7919) % {units}", f"i % {GROUPS}"
    tmp = path.with_suffix(".tmp")
    con = duckdb.connect()
    con.execute(
        f"COPY (SELECT {uid} AS uid, 'g' || CAST({grp} AS VARCHAR) AS grp, "
        f"CAST((i * 37) % 10000 AS DOUBLE) / 100 AS val FROM range({rows}) AS r(i)) "
        f"TO '{tmp}' (FORMAT parquet, ROW_GROUP_SIZE 1000000)"
    )
    con.close()
    tmp.rename(path)
    return path


def policy_for(path: Path, engine: str, master: str, memory: str) -> dict:
    policy: dict = {
        "privacy": {"epsilon": 1.0, "delta": 1e-6, "budget_epsilon": 1e9, "budget_delta": 0.5},
        "tables": {
            "t": {
                "source": str(path),
                "privacy_unit": "uid",
                "max_rows_per_unit": 5,
                "max_groups_per_unit": 3,
                "version": path.name,
                "columns": {
                    "uid": {"type": "int", "nullable": False},
                    "grp": {
                        "type": "text",
                        "values": [f"g{i}" for i in range(GROUPS)],
                        "nullable": False,
                    },
                    "val": {"type": "float", "lower": 0.0, "upper": 100.0, "granularity": 0.01},
                },
            }
        },
    }
    if engine == "spark":
        policy["engine"] = {
            "name": "spark",
            "master": master,
            "conf": {
                "spark.driver.memory": memory,
                "spark.ui.enabled": False,
                "spark.ui.showConsoleProgress": False,
                "spark.sql.shuffle.partitions": 8,
            },
        }
    return policy


def worker(engine: str, path: Path, repeat: int, master: str, memory: str) -> dict:
    """Runs in its own process: connect, run the query ``repeat`` times, report JSON."""
    sys.path.insert(0, str(ROOT))
    import dpsql
    from dpsql.privacy.ledger import MemoryLedger

    out: dict = {"engine": engine}
    session = None
    if engine == "spark":
        from dpsql.engine.spark_engine import start_session

        t0 = time.perf_counter()
        pol = policy_for(path, engine, master, memory)["engine"]
        session = start_session(pol["master"], pol["conf"])
        session.sparkContext.setLogLevel("ERROR")
        out["startup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    conn = dpsql.connect(
        policy=policy_for(path, engine, master, memory),
        ledger=MemoryLedger(),
        cache=False,
        **({"spark_session": session} if session is not None else {}),
    )
    out["connect_s"] = time.perf_counter() - t0
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        rows = conn.cursor().execute(QUERY).fetchall()
        times.append(time.perf_counter() - t0)
    out["query_s"] = times
    out["groups"] = len(rows)
    out["python_peak_mb"] = _peak_rss_mb()
    if session is not None:
        proc = session.sparkContext._gateway.proc  # the driver JVM (spark-submit execs java)
        out["jvm_peak_mb"] = _peak_rss_mb(proc.pid)
    conn.close()
    if session is not None:
        session.stop()
    return out


def run_worker(engine: str, path: Path, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        engine,
        "--path",
        str(path),
        "--repeat",
        str(args.repeat),
        "--master",
        args.master,
        "--spark-memory",
        args.spark_memory,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=os.environ.copy())
    if done.returncode != 0:
        raise SystemExit(f"{engine} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000000,10000000", help="comma-separated row counts")
    parser.add_argument("--engines", default="duckdb,spark")
    parser.add_argument("--shape", choices=("typical", "all-over"), default="typical")
    parser.add_argument("--repeat", type=int, default=2, help="runs per engine (best reported)")
    parser.add_argument("--master", default="local[2]", help="Spark master for the Spark runs")
    parser.add_argument("--spark-memory", default="4g", help="spark.driver.memory")
    parser.add_argument(
        "--data", default="/tmp/dpsql_bench_scale", help="directory for the generated Parquet"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(
            json.dumps(
                worker(args.worker, Path(args.path), args.repeat, args.master, args.spark_memory)
            )
        )
        return

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    print(f"query: {QUERY}  (privacy unit uid, R = 5, G = 3; {os.cpu_count()} cores)")
    print(f"data shape {args.shape}; Spark master {args.master}, driver memory {args.spark_memory}")
    print(f"load average at start: {os.getloadavg()[0]:.1f}\n")
    header = (
        f"{'rows':>11} {'engine':>7} {'query s':>8} {'ns/row':>7} {'peak MB':>8} "
        f"{'startup s':>9} {'connect s':>9} {'vs duckdb':>9}"
    )
    print(header)
    print("-" * len(header))
    results: dict = {}
    for rows in sizes:
        t0 = time.perf_counter()
        path = make_data(rows, Path(args.data), args.shape)
        gen = time.perf_counter() - t0
        for engine in engines:
            r = run_worker(engine, path, args)
            best = min(r["query_s"])
            peak = r.get("jvm_peak_mb", 0) + r["python_peak_mb"]
            results[(rows, engine)] = best
            ratio = best / results[(rows, "duckdb")] if (rows, "duckdb") in results else None
            print(
                f"{rows:>11,} {engine:>7} {best:>8.2f} {best / rows * 1e9:>7.0f} {peak:>8.0f} "
                f"{r.get('startup_s', 0):>9.1f} {r['connect_s']:>9.2f} "
                f"{'' if ratio is None else f'{ratio:.1f}x':>9}",
                flush=True,
            )
        if gen > 1:
            print(f"{'':>11} (generated {path.name} in {gen:.0f} s)")
    for engine in engines:
        pts = [(n, results[(n, engine)]) for n in sizes if (n, engine) in results]
        if len(pts) >= 2:
            (n0, t0_), (n1, t1_) = pts[0], pts[-1]
            print(
                f"{engine}: {n1 / n0:.0f}x rows -> {t1_ / t0_:.1f}x time "
                f"({t1_ / n1 * 1e9:.0f} ns/row at {n1:,})"
            )


if __name__ == "__main__":
    main()
