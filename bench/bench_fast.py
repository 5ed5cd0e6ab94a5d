"""Issue 28's shape, default policy (no [engine] setting): the store built in the background and
its compiled pass, side by side with plain DuckDB and with the SQL plans it replaces.

Data (made once per size in bench/data/, a DuckDB file, rows shuffled): units of 10 rows, each
row of a unit in another of 16 public departments (every unit in 10 groups), age 0-89, cost
0-6000 with 2% NULL (17% above the declared 5000). Policy: ``tr`` row-level and ``tu`` with
privacy unit uid, R = 10, G = 1, both over the same table, nothing under [engine].

Query: ``SELECT dept, COUNT(*), SUM(cost), AVG(cost) FROM t WHERE age > -k GROUP BY dept`` with
a new k each run, and the same without the WHERE. The answer cache is on, as a service runs,
for what is bought once per analyst and data version (the default clamp range's histogram of
cost, keys ``bounds:...``), bought by a first untimed run and kept; no answer is replayed
(:class:`_Unreplayed`), so every timed run computes its answer. Timed in interleaved rounds,
process CPU (DuckDB's threads included) and wall, medians; ratios to the plain query on the
same connection. "SQL" rows: the same DP query with the store hidden (the plans that ran
before it is ready). Session settings as an analyst's connection starts them (bias estimates
on); ``--no-bias`` measures the answer alone.

    python bench/bench_fast.py --rows 1000000 --reps 5
    python bench/bench_fast.py --rows 10000000 --reps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import duckdb  # noqa: E402

from dpsql.dbapi import Service  # noqa: E402
from dpsql.frontend.bind import parse_statement  # noqa: E402
from dpsql.lower.compile import compile_plan  # noqa: E402
from dpsql.pipeline import Settings  # noqa: E402
from dpsql.privacy.ledger import MemoryLedger  # noqa: E402

DEPTS = [f"d{i:02d}" for i in range(16)]
COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "age": {"type": "int", "lower": 0, "upper": 100},
    "dept": {"type": "text", "values": DEPTS},
    "cost": {"type": "float", "lower": 0.0, "upper": 5000.0, "granularity": 0.01},
}
Q = "SELECT dept, COUNT(*), SUM(cost), AVG(cost) FROM {t} WHERE age > -{k} GROUP BY dept"
Q0 = "SELECT dept, COUNT(*), SUM(cost), AVG(cost) FROM {t} GROUP BY dept"
# --memory's int case: a SUM of an int column, whose fixed points the store fills (one int32
# row of the table per bound) at the first query that reads them
QI = "SELECT dept, COUNT(*), SUM(age), AVG(age) FROM {t} WHERE age > -{k} GROUP BY dept"


def generate(path: Path, rows: int) -> None:
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    depts = ", ".join(f"'{d}'" for d in DEPTS)
    con = duckdb.connect(str(tmp))
    con.execute(
        f"""CREATE TABLE t AS SELECT CAST(i // 10 AS BIGINT) AS uid,
          CAST(hash(i // 10, 2) % 90 AS BIGINT) AS age,
          ([{depts}])[1 + CAST(((i // 10) * 7 + i % 10) % 16 AS BIGINT)] AS dept,
          CASE WHEN hash(i, 7) % 50 = 0 THEN NULL
               ELSE CAST(hash(i, 8) % 600000 AS DOUBLE) / 100 END AS cost
        FROM range({rows}) t(i) ORDER BY hash(i, 11)"""
    )
    con.close()
    tmp.rename(path)


def policy() -> dict:
    return {
        "privacy": {
            "epsilon": 1.0,
            "delta": 1e-6,
            "budget_epsilon": 1e12,
            "budget_delta": 0.5,
            "dataset": "bench",
        },
        "tables": {
            "tr": {"source": "t", "columns": COLUMNS},
            "tu": {
                "source": "t",
                "columns": COLUMNS,
                "privacy_unit": "uid",
                "max_rows_per_unit": 10,
                "max_groups_per_unit": 1,
            },
        },
    }


class _Unreplayed(MemoryLedger):
    """A ledger that keeps what a first query buys once per analyst and data version (the
    contribution bounds' and the default clamp range's histograms) and replays no answer, so
    each timed run of the same text is computed, as a new query is."""

    def cached(self, analyst: str, dataset: str, cache_key: str) -> str | None:
        if not cache_key.startswith("bounds:"):
            return None
        return super().cached(analyst, dataset, cache_key)


def check(svc: Service, settings: Settings) -> None:
    """The compiled pass over the store returns exactly the SQL plan's integers (every
    measure, the bias measures included) for each timed query: the figures time the plan
    dpsql runs, and it is the same answer."""
    for table in ("tr", "tu"):
        for text in (Q.format(t=table, k=3), Q0.format(t=table)):
            plan = svc.plan(parse_statement(text, svc.policy), settings)
            compiled = compile_plan(plan, 99)
            fast = svc.engine._run_columns(compiled, None) if compiled.program else None
            sql = svc.engine.execute(dataclasses.replace(compiled, program=None))
            if fast is None:
                raise SystemExit(f"no compiled pass for {text!r}")

            def rows(result):
                return sorted(zip(result.key_rows, *result.measures, strict=True), key=repr)

            if rows(fast) != rows(sql):
                raise SystemExit(f"check failed: {text!r}")
            print(f"check: {table} compiled pass = SQL ({len(plan.measures)} measures): {text}")


def memory_child(db: Path, kind: str) -> int:
    """One query in this fresh process; prints the peak RSS (MiB) before it (after connect
    and the store's build), the query's CPU and wall seconds, and the peak RSS after it. The
    dpsql query is a first one (cache off): it buys the default clamp range's histogram of
    cost, as a pass over the store ("dpsql") or as its SQL ("dpsql-sql-clamp": the pass
    switched off, the plan before it existed); "dpsql-int" sums the int column age instead
    (:data:`QI`: its fixed-point rows filled by that first query; plain runs :data:`Q`)."""
    if kind == "plain":
        con = duckdb.connect()
        con.execute(f"ATTACH '{db}' AS s (READ_ONLY)")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        c, w = cpu(), time.perf_counter()
        con.execute(Q.format(t="s.t", k=1)).fetchall()
    else:
        if kind == "dpsql-sql-clamp":
            from dpsql.engine import clamp_pass

            clamp_pass.runnable = lambda store, spec: False  # type: ignore[assignment]
        pol = policy()
        del pol["tables"]["tr"]
        svc = Service(pol, str(db), ledger=MemoryLedger(), cache=False)
        svc.engine.wait_for_stores()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        c, w = cpu(), time.perf_counter()
        text = QI if kind == "dpsql-int" else Q
        svc.execute(text.format(t="tu", k=1), None, Settings.from_policy(svc.policy), "a")
    c, w = cpu() - c, time.perf_counter() - w
    print(before, c, w, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return 0


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-bias", action="store_true", help="SET bias_estimate = off")
    ap.add_argument("--no-sql", action="store_true", help="skip the SQL plans (slow at 10M)")
    ap.add_argument("--data-dir", type=Path, default=ROOT / "bench" / "data")
    ap.add_argument(
        "--memory",
        action="store_true",
        help="peak RSS and CPU of plain DuckDB and of dpsql's first query (one unit table, its "
        "store ready; the clamp histogram on the store and in SQL), each in a fresh process",
    )
    ap.add_argument(
        "--memory-child",
        choices=["plain", "dpsql", "dpsql-int", "dpsql-sql-clamp"],
        help=argparse.SUPPRESS,
    )
    args = ap.parse_args(argv)
    db = args.data_dir / f"fast_{args.rows}.duckdb"
    generate(db, args.rows)
    if args.memory_child:
        return memory_child(db, args.memory_child)
    if args.memory:
        kinds = ("plain", "dpsql", "dpsql-int", "dpsql-sql-clamp")
        print(f"{args.rows:,} rows; load {' '.join(map(str, os.getloadavg()))}", flush=True)
        got = {}
        for kind in kinds:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--rows",
                    str(args.rows),
                    "--data-dir",
                    str(args.data_dir),
                    "--memory-child",
                    kind,
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            got[kind] = [float(v) for v in out.split()[-4:]]
        plain = got["plain"]
        print("each in a fresh process, one WHERE query (dpsql: a first query, its store ready)")
        print(f"{'run':34s} {'RSS before':>10s} {'peak RSS':>9s} {'ratio':>6s} {'CPU s':>7s} "
              f"{'ratio':>7s} {'wall s':>7s}")  # fmt: skip
        labels = {
            "plain": "plain DuckDB",
            "dpsql": "dpsql, clamp histogram on the store",
            "dpsql-int": "dpsql, SUM/AVG of the int column",
            "dpsql-sql-clamp": "dpsql, clamp histogram in SQL",
        }
        for kind in kinds:
            before, c, w, peak = got[kind]
            print(
                f"{labels[kind]:34s} {before:9.0f}M {peak:8.0f}M {peak / plain[3]:5.1f}x "
                f"{c:7.2f} {c / plain[1]:6.1f}x {w:7.2f}"
            )
        print(f"load {' '.join(map(str, os.getloadavg()))}")
        return 0
    print(f"{args.rows:,} rows; load {' '.join(map(str, os.getloadavg()))}", flush=True)
    c0, w0 = cpu(), time.perf_counter()
    svc = Service(policy(), str(db), ledger=_Unreplayed(), cache=True)
    print(f"connect: {time.perf_counter() - w0:.2f} s wall", flush=True)
    svc.engine.wait_for_stores()
    print(
        f"stores ready: {time.perf_counter() - w0:.1f} s wall, {cpu() - c0:.1f} s CPU "
        f"({(cpu() - c0) / (2 * args.rows) * 1e6:.2f} µs CPU per row per store, two stores)",
        flush=True,
    )
    settings = Settings.from_policy(svc.policy)
    settings = dataclasses.replace(settings, bias_estimate="off" if args.no_bias else "on")
    check(svc, settings)
    con = svc.engine._con
    ctr = itertools.count(1)
    held = dict(svc.engine.columns)

    for table in ("tr", "tu"):  # what a first query buys (kept per analyst and data version)
        c, w = cpu(), time.perf_counter()
        svc.execute(Q.format(t=table, k=0), None, settings, "a")
        print(f"first query on {table}: {time.perf_counter() - w:.2f} s wall, "
              f"{cpu() - c:.2f} s CPU", flush=True)  # fmt: skip

    def sql_plan(fn):
        def run():
            svc.engine.columns.clear()
            try:
                fn()
            finally:
                svc.engine.columns.update(held)

        return run

    runs = {
        "plain, WHERE": lambda: con.execute(Q.format(t="tr", k=next(ctr))).fetchall(),
        "plain, no WHERE": lambda: con.execute(Q0.format(t="tr")).fetchall(),
        "row-level, WHERE": lambda: svc.execute(Q.format(t="tr", k=next(ctr)), None, settings, "a"),
        "privacy unit, WHERE": lambda: svc.execute(
            Q.format(t="tu", k=next(ctr)), None, settings, "a"
        ),
        "privacy unit, no WHERE": lambda: svc.execute(Q0.format(t="tu"), None, settings, "a"),
    }
    if not args.no_sql:
        runs["row-level, WHERE, SQL"] = sql_plan(runs["row-level, WHERE"])
        runs["privacy unit, WHERE, SQL"] = sql_plan(runs["privacy unit, WHERE"])
    cpus: dict[str, list[float]] = {k: [] for k in runs}
    walls: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.reps):
        for key, fn in runs.items():
            c, w = cpu(), time.perf_counter()
            fn()
            walls[key].append(time.perf_counter() - w)
            cpus[key].append(cpu() - c)
    base_c = {w: statistics.median(cpus[f"plain, {w}"]) for w in ("WHERE", "no WHERE")}
    base_w = {w: statistics.median(walls[f"plain, {w}"]) for w in ("WHERE", "no WHERE")}
    print(f"{'query':28s} {'CPU ms':>9s} {'ratio':>7s} {'wall ms':>9s} {'ratio':>7s}")
    for key in runs:
        which = "no WHERE" if "no WHERE" in key else "WHERE"
        c, w = statistics.median(cpus[key]), statistics.median(walls[key])
        print(
            f"{key:28s} {c * 1e3:9.1f} {c / base_c[which]:6.2f}x {w * 1e3:9.1f} "
            f"{w / base_w[which]:6.2f}x"
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak:.0f} MiB; load {' '.join(map(str, os.getloadavg()))}")
    svc.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
