"""Small plans on the shipped fixture (20k rows): planning CPU, DB-API DP/plain latency and
``dpsql serve`` throughput, side by side in one run, with the machine's load.

1. ``planning``: thread CPU from a statement's text to what the engine runs (its column
   program, dpsql.engine.columnar, else its rendered SQL; ``cold+sql`` renders the SQL
   always), through the service's own path (plan cache, text shapes, shape cache, parse,
   bind, type, plan, compile, render),
   for the fixture's typical queries in three modes: ``repeat`` (a text seen before: the plan
   cache), ``shape`` (the same shape with other WHERE numbers: the text shapes and the shape
   cache) and ``cold`` (a new shape every time: all caches off).
2. ``dbapi``: median wall latency of the DP queries through ``dpsql.connect`` (answer cache
   off, new literals each time as in bench_server.py) against the same SQL through DuckDB's
   own DB-API on the same table (``duckdb.connect``, CSV loaded with the declared types);
   dpsql twice, interleaved: with column programs (the default, dpsql.engine.columnar) and
   running its compiled SQL (``[engine] small_tables = "sql"``).
3. ``server``: DP queries/s over N connections to ``dpsql serve --workers W`` (the queries of
   bench/bench_server.py), and beside it the compiled SQL alone on N threads (``engine``: no
   bind, noise or ledger, and no column programs).

    python bench/bench_small.py                       # ~1 min
    python bench/bench_small.py --seconds 10 --workers 2 --connections 16
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import duckdb
from bench_server import (
    DP_QUERIES,
    EPSILON,
    PASSWORD,
    run_engine,
    run_server,
    start_server,
)

import dpsql
from dpsql.frontend.bind import parse_statement
from dpsql.policy import SQL_TYPES, load_policy
from dpsql.privacy.ledger import MemoryLedger
from dpsql.server.users import UserStore, users_path
from dpsql.service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "visits.toml"

# The fixture's typical DP queries: bench_server.py's four, and the planning mix of
# bench_core.py with a number in each WHERE ({i}: a new value each time).
TEMPLATES = [
    *DP_QUERIES,
    "SELECT department, smoker, SUM(cost) AS s FROM visits WHERE age BETWEEN {i} AND 60 "
    "GROUP BY 1, 2 ORDER BY s DESC LIMIT 5",
    "SELECT FLOOR(age / 10) * 10 AS decade, COUNT(DISTINCT patient_id), STDDEV(cost) "
    "FROM visits WHERE age > {i} GROUP BY decade HAVING COUNT(*) > 10",
    "SELECT diagnosis, COUNT(*) FROM visits WHERE department IN ('oncology', 'neurology') "
    "AND age >= {i} GROUP BY diagnosis",
    "SELECT AVG(age), SUM(cost) FROM visits WHERE smoker AND cost > {j}",
]


def _text(template: str, k: int) -> str:
    return template.format(i=k % 90, j=10 + k % 90)


def _plan_cpu(service: dpsql.Service, text: str, settings: Settings, sql: bool = False) -> float:
    """Thread CPU seconds from text to what the engine runs, as Service.execute plans it: the
    column program where the plan has one (its SQL is then built only if the engine falls
    back), else the rendered SQL; ``sql``: the rendered SQL always."""
    start = time.thread_time()
    key = service._plans.key(text, None, settings, "bench")
    prepared = service._lookup(key)
    if prepared is None:
        prepared = service._from_text(key, text, None, settings, "bench")
    if prepared is None:
        statement = parse_statement(text, service.policy)
        prepared = service._prepare(key, statement, settings, "bench")  # type: ignore[arg-type]
        if prepared.shape_key is not None:  # as Service.execute does once the statement ran
            service._texts.learn(service, text, statement, settings, "bench", prepared.shape_key)  # type: ignore[arg-type]
    compiled = service._compiled(prepared)
    if sql or compiled.program is None:
        compiled.render("duckdb")
    return time.thread_time() - start


def bench_planning(reps: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    cached = dpsql.Service(FIXTURE, ledger=MemoryLedger(), cache=False)
    cold = dpsql.Service(FIXTURE, ledger=MemoryLedger(), cache=False, plan_cache=0)
    settings = Settings.from_policy(cached.policy)
    try:
        for template in TEMPLATES:
            for svc in (cached, cold):  # warm the domain caches (policy only) and the shape
                _plan_cpu(svc, _text(template, 0), settings)  # the shape is seen
                _plan_cpu(svc, _text(template, 0) + "  ", settings)  # ... and verified
            repeat = [_plan_cpu(cached, _text(template, 0), settings) for _ in range(reps)]
            # new numbers each time (k % 90; past 90 a trailing space keeps the text new)
            texts = [_text(template, k) + (" " * (k // 90)) for k in range(1, reps + 1)]
            shape = [_plan_cpu(cached, text, settings) for text in texts]
            fresh, fresh_sql = [], []
            for k, text in enumerate(texts):  # interleaved, in turns (the machine is shared)
                pair = [(fresh, text, False), (fresh_sql, text + " ", True)]
                for times, statement, sql in pair if k % 2 else pair[::-1]:
                    times.append(_plan_cpu(cold, statement, settings, sql=sql))
            out[template] = {
                "repeat": statistics.median(repeat) * 1e3,
                "shape": statistics.median(shape) * 1e3,
                "cold": statistics.median(fresh) * 1e3,
                "cold_sql": statistics.median(fresh_sql) * 1e3,
            }
    finally:
        cached.close()
        cold.close()
    return out


def _plain_connection() -> duckdb.DuckDBPyConnection:
    policy = load_policy(FIXTURE)
    con = duckdb.connect()
    for table in policy.tables.values():
        cols = ", ".join(
            f'CAST("{c.name}" AS {SQL_TYPES[c.type]}) AS "{c.name}"' for c in table.columns.values()
        )
        con.execute(
            f"CREATE TABLE \"{table.name}\" AS SELECT {cols} FROM read_csv('{table.source_path}', "
            "header = true, all_varchar = true)"
        )
    return con


def _dp_cursor(small_tables: str) -> tuple[dpsql.Connection, object]:
    policy = load_policy(FIXTURE)
    policy = dataclasses.replace(
        policy, engine=dataclasses.replace(policy.engine, small_tables=small_tables)
    )
    conn = dpsql.connect(policy=policy, ledger=MemoryLedger(), cache=False)
    cur = conn.cursor()
    cur.execute(f"SET epsilon = {EPSILON}")
    return conn, cur


def bench_dbapi(reps: int) -> dict[str, dict[str, tuple[float, float]]]:
    """Per query and side, the median (wall, CPU) ms: dpsql with column programs (the
    default), dpsql running its SQL (small_tables = "sql") and plain DuckDB, interleaved."""
    columns, columns_cur = _dp_cursor("columns")
    sql, sql_cur = _dp_cursor("sql")
    plain = _plain_connection()
    sides = {"columns": columns_cur, "sql": sql_cur, "plain": plain}
    out = {}
    try:
        for template in DP_QUERIES:
            times: dict[str, tuple[list[float], list[float]]] = {s: ([], []) for s in sides}
            for k in range(reps):
                text = _text(template, k)
                for side, cur in sides.items():
                    start, cpu = time.perf_counter(), time.process_time()
                    cur.execute(text).fetchall()  # type: ignore[attr-defined]
                    times[side][0].append(time.perf_counter() - start)
                    times[side][1].append(time.process_time() - cpu)
            out[template] = {
                side: (statistics.median(w) * 1e3, statistics.median(c) * 1e3)
                for side, (w, c) in times.items()
            }
    finally:
        columns.close()
        sql.close()
        plain.close()
    return out


def bench_server(connections: int, seconds: float, workers: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="dpsql-small-") as tmp:
        policy = Path(tmp) / FIXTURE.name
        shutil.copy(FIXTURE, policy)
        for table in load_policy(FIXTURE).tables.values():
            if table.source_path is not None:
                shutil.copy(table.source_path, Path(tmp) / table.source_path.name)
        users = UserStore(users_path(policy))
        for i in range(connections):
            users.add(f"bench{i}", PASSWORD)
        engine = run_engine(policy, connections, seconds)
        server = start_server(policy, workers)
        try:
            rate = run_server(server, connections, seconds, None, f"server w{workers}")
        finally:
            server[0].terminate()
            server[0].wait(30)
    return engine, rate


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=60, help="statements per query and mode")
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0, help="server run length")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-server", action="store_true")
    args = ap.parse_args()
    print(f"dpsql small-plan bench: fixture, duckdb {duckdb.__version__}, load {_load()}")

    planning = bench_planning(args.reps)
    print(
        "planning, thread CPU ms per statement (text -> what the engine runs: its column "
        "program, else its SQL; cold+sql: rendering the SQL always), median:"
    )
    print("  repeat   shape    cold  cold+sql  query")
    for template, row in planning.items():
        shown = template.format(i="i", j="j")
        print(
            f"  {row['repeat']:6.3f}  {row['shape']:6.3f}  {row['cold']:6.3f}  "
            f"{row['cold_sql']:6.3f}   {shown[:66]}"
        )
    medians = {
        m: statistics.median(r[m] for r in planning.values())
        for m in ("repeat", "shape", "cold", "cold_sql")
    }
    print(
        f"  median over the queries: repeat {medians['repeat']:.3f}  shape {medians['shape']:.3f}"
        f"  cold {medians['cold']:.3f} (with SQL {medians['cold_sql']:.3f}) ms (target <= 1 ms)"
    )

    dbapi = bench_dbapi(args.reps)
    print(
        "dbapi, ms per query, median: dpsql.connect DP (column programs; its SQL) vs "
        "duckdb.connect plain, wall | CPU:"
    )
    ratios: dict[str, list[float]] = {"columns": [], "sql": [], "cpu": [], "cpu_sql": []}
    for template, row in dbapi.items():
        (dp, dp_cpu), (sql, sql_cpu), (plain, plain_cpu) = row["columns"], row["sql"], row["plain"]
        ratios["columns"].append(dp / plain)
        ratios["sql"].append(sql / plain)
        ratios["cpu"].append(dp_cpu / plain_cpu)
        ratios["cpu_sql"].append(sql_cpu / plain_cpu)
        print(
            f"  DP {dp:5.2f} ({sql:5.2f})  plain {plain:5.2f}  x{dp / plain:4.1f} "
            f"(x{sql / plain:4.1f}) | CPU x{dp_cpu / plain_cpu:4.1f} (x{sql_cpu / plain_cpu:4.1f})"
            f"   {template}"
        )
    med = {k: statistics.median(v) for k, v in ratios.items()}
    print(
        f"  median DP/plain ratio wall x{med['columns']:.1f} (its SQL x{med['sql']:.1f}), CPU "
        f"x{med['cpu']:.1f} (its SQL x{med['cpu_sql']:.1f}) (target <= 3)"
    )

    if not args.skip_server:
        engine, rate = bench_server(args.connections, args.seconds, args.workers)
        print(
            f"server: {rate:.0f} DP q/s over {args.connections} connections, --workers "
            f"{args.workers} (the compiled SQL alone on {args.connections} threads, without "
            f"column programs: {engine:.0f} q/s; target 300)"
        )
    print(f"load {_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
