"""Core speed: planning latency, and DP queries vs the same plain DuckDB query, side by side.

Generates a deterministic synthetic table of patient visits (``--rows``, default 10M; about
10 rows per patient) into a DuckDB file under ``bench/data/`` (git-ignored), then in ONE run:

1. planning latency (parse -> bind -> plan -> compile) over a mix of queries on the fixture;
2. the fixture (20k rows) DP query vs plain, end to end, and DP queries/s on one thread;
3. for each query: the plain DuckDB query and the DP query (row-level table, and the same data
   with a privacy unit), interleaved, ``--reps`` times: medians of wall and process-CPU time,
   and their ratios. "DP" is the whole pipeline (bind, plan, engine, noise, post-processing);
   "engine" is the compiled SQL alone; "floor" is the least work any bounded plan must do
   (FLOORS: clamping every value, or one aggregate per (unit, group), and nothing else);
4. peak memory: a fresh subprocess per query, its peak RSS (VmHWM, what ru_maxrss reports for a
   process not forked from a bigger one: the whole process, with Python, DuckDB and the pages
   of the table it read), and that peak minus the RSS just before the query.

Correctness is checked in the same run: with ZeroNoise, the row-level DP aggregates equal a
hand-written reference query exactly, and (``--check-reference``, on by default for --quick)
the unit-level result equals the previous window-over-every-row plan with the same secret.

    python bench/bench_core.py --quick          # 1M rows, ~2 minutes
    python bench/bench_core.py                  # 10M rows
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import duckdb  # noqa: E402

from dpsql.dbapi import Service  # noqa: E402
from dpsql.frontend.bind import parse_statement  # noqa: E402
from dpsql.lower.compile import compile_plan  # noqa: E402
from dpsql.lower.prepared_plan import two_phase_pays  # noqa: E402
from dpsql.pipeline import Settings  # noqa: E402
from dpsql.privacy.ledger import MemoryLedger  # noqa: E402
from dpsql.privacy.samplers import ZeroNoise  # noqa: E402

DEPARTMENTS = ["cardiology", "dermatology", "emergency", "neurology", "oncology", "pediatrics"]

COLUMNS: dict[str, dict[str, Any]] = {
    "patient_id": {"type": "int", "nullable": False},
    "age": {"type": "int", "lower": 0, "upper": 100, "nullable": False},
    "department": {"type": "text", "values": DEPARTMENTS, "nullable": False},
    "diagnosis": {"type": "text", "nullable": False},
    "cost": {"type": "float", "lower": 0.0, "upper": 5000.0, "granularity": 0.01},
    "visit_date": {"type": "date", "nullable": False},
    "smoker": {"type": "bool", "nullable": False},
}

# {t} is the table: visits_rows (every row its own unit) or visits (privacy unit patient_id).
QUERIES = {
    "group_by": "SELECT department, COUNT(*), SUM(cost), AVG(cost) FROM {t} GROUP BY department",
    "no_group": "SELECT COUNT(*), SUM(cost), AVG(cost) FROM {t}",
    "bins_where": (
        "SELECT smoker, FLOOR(age / 10) * 10 AS decade, COUNT(*), AVG(cost) FROM {t} "
        "WHERE visit_date >= DATE '2024-03-01' GROUP BY smoker, decade"
    ),
}

# The least work any bounded plan must do, timed beside the plain query: row-level, clamping
# every value to its declared bounds (SUM's sensitivity rests on it), in doubles, without the
# fixed point; privacy unit, one aggregate per (unit, group) (each unit's contribution to a group
# must be known before it can be bounded), with no bounding at all (its sums are summed again,
# or DuckDB would prune them).
_CLAMP = "CASE WHEN cost < 0.0 THEN 0.0 WHEN cost > 5000.0 THEN 5000.0 ELSE cost END"
FLOORS = {
    ("group_by", "visits_rows"): (
        f"SELECT department, COUNT(*), SUM({_CLAMP}), COUNT(cost) FROM visits_rows "
        "GROUP BY department"
    ),
    ("no_group", "visits_rows"): f"SELECT COUNT(*), SUM({_CLAMP}), COUNT(cost) FROM visits_rows",
    ("bins_where", "visits_rows"): (
        f"SELECT smoker, FLOOR(age / 10) * 10 AS decade, COUNT(*), SUM({_CLAMP}), COUNT(cost) "
        "FROM visits_rows WHERE visit_date >= DATE '2024-03-01' GROUP BY smoker, decade"
    ),
    ("group_by", "visits"): (
        "SELECT COUNT(*), SUM(n), SUM(s), SUM(c) FROM (SELECT patient_id, department, "
        "COUNT(*) AS n, SUM(cost) AS s, COUNT(cost) AS c FROM visits GROUP BY patient_id, "
        "department)"
    ),
    ("no_group", "visits"): (
        "SELECT COUNT(*), SUM(n), SUM(s), SUM(c) FROM (SELECT patient_id, COUNT(*) AS n, "
        "SUM(cost) AS s, COUNT(cost) AS c FROM visits GROUP BY patient_id)"
    ),
    ("bins_where", "visits"): (
        "SELECT COUNT(*), SUM(n), SUM(s), SUM(c) FROM (SELECT patient_id, smoker, "
        "FLOOR(age / 10) * 10, COUNT(*) AS n, SUM(cost) AS s, COUNT(cost) AS c FROM visits "
        "WHERE visit_date >= DATE '2024-03-01' GROUP BY ALL)"
    ),
}

PLANNING_MIX = [
    "SELECT COUNT(*) FROM visits",
    "SELECT department, COUNT(*), AVG(cost) FROM visits GROUP BY department",
    "SELECT department, smoker, SUM(cost) AS s FROM visits WHERE age BETWEEN 20 AND 60 "
    "GROUP BY 1, 2 ORDER BY s DESC LIMIT 5",
    "SELECT FLOOR(age / 10) * 10 AS decade, COUNT(DISTINCT patient_id), STDDEV(cost) "
    "FROM visits GROUP BY decade HAVING COUNT(*) > 10",
    "SELECT diagnosis, COUNT(*) FROM visits WHERE department IN ('oncology', 'neurology') "
    "GROUP BY diagnosis",
    "SELECT AVG(age), SUM(cost) FROM visits WHERE smoker AND cost > 100",
]


def generate(path: Path, rows: int, hot: float) -> None:
    """Deterministic data (DuckDB's HASH of the row number): ~10 rows per patient, a patient's
    visits go to their 'home' department with probability ``hot``; ~17% of costs lie above
    the declared upper bound (clamping binds), 2% are NULL."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    units = max(1, rows // 10)
    depts = ", ".join(f"'{d}'" for d in DEPARTMENTS)
    hot_per_mille = round(hot * 1000)
    con = duckdb.connect(str(tmp))
    con.execute(
        f"""
        CREATE TABLE visits AS
        WITH r AS (SELECT i, hash(i, 1) % {units} AS pid FROM range({rows}) t(i))
        SELECT
          CAST(pid AS BIGINT) AS patient_id,
          CAST(18 + hash(pid, 2) % 80 AS BIGINT) AS age,
          ([{depts}])[1 + CAST(CASE WHEN hash(i, 3) % 1000 < {hot_per_mille}
              THEN hash(pid, 4) % 6 ELSE hash(i, 5) % 6 END AS BIGINT)] AS department,
          'D' || lpad(CAST(hash(i, 6) % 300 AS VARCHAR), 3, '0') AS diagnosis,
          CASE WHEN hash(i, 7) % 50 = 0 THEN NULL
               ELSE CAST(hash(i, 8) % 600000 AS DOUBLE) / 100 END AS cost,
          DATE '2024-01-01' + CAST(hash(i, 9) % 366 AS INTEGER) AS visit_date,
          hash(pid, 10) % 4 = 0 AS smoker
        FROM r
        """
    )
    con.close()
    tmp.rename(path)


def policy(
    max_rows: int,
    max_groups: int,
    perfect_hash_bits: int = 12,
    store: Path | None = None,
    bounding: str = "scale",
) -> dict[str, Any]:
    """The bench policy; with ``store`` (a directory), a disk prepared store per table
    (dpsql.engine.prepared), keyed by the data file's name as its version."""
    engine: dict[str, Any] = {"perfect_hash_bits": perfect_hash_bits}
    version: dict[str, str] = {}
    if store is not None:
        engine.update(prepared="disk", prepared_dir=str(store))
        version = {"version": store.name}
    return {
        "engine": engine,
        "privacy": {
            "epsilon": 1.0,
            "delta": 1e-6,
            "budget_epsilon": 1e12,
            "budget_delta": 0.5,
            "dataset": "bench",
        },
        "tables": {
            "visits_rows": {"source": "visits", "columns": COLUMNS, **version},
            "visits": {
                "source": "visits",
                **version,
                "privacy_unit": "patient_id",
                "max_rows_per_unit": max_rows,
                "max_groups_per_unit": max_groups,
                "bounding": bounding,
                "columns": COLUMNS,
            },
        },
    }


def service(db: Path | str, pol: dict | str, noise: Any = None) -> Service:
    """A service whose background stores (dpsql.engine.columnar.load_clustered) are ready: the
    figures time the plans a running service answers with, not its first seconds."""
    svc = Service(pol, str(db), ledger=MemoryLedger(), noise=noise, cache=False)
    svc.engine.wait_for_stores()
    return svc


def answer_only(svc: Service) -> Settings:
    """The session's settings without the bias measures (dpsql.plan.bias): the reference
    queries of the checks compute the answer's measures only."""
    return dataclasses.replace(Settings.from_policy(svc.policy), bias_estimate="off")


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn) -> tuple[float, float]:
    c, w = cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - w, cpu() - c


def med(xs: list[float]) -> float:
    return statistics.median(xs)


# -- planning -------------------------------------------------------------------------------
def bench_planning(reps: int) -> dict[str, Any]:
    svc = service(":memory:", str(ROOT / "fixtures" / "visits.toml"))
    settings = Settings.from_policy(svc.policy)
    per_query = {}
    everything: list[float] = []
    cpu_times: list[float] = []
    for q in PLANNING_MIX:  # warm the domain cache: it depends on the policy only
        compile_plan(svc.plan(parse_statement(q, svc.policy), settings), 1)
    sql_times: list[float] = []
    for q in PLANNING_MIX:
        times = []
        for i in range(reps):
            text = q + " " * i  # a new text each time: no token-cache hit
            c = thread_cpu()
            t = time.perf_counter()
            compiled = compile_plan(svc.plan(parse_statement(text, svc.policy), settings), 1)
            if compiled.program is None:  # a column program runs without its SQL
                compiled.render("duckdb")
            times.append(time.perf_counter() - t)
            cpu_times.append(thread_cpu() - c)
            c = thread_cpu()  # interleaved: the same text, its SQL rendered always
            compile_plan(svc.plan(parse_statement(text + " ", svc.policy), settings), 1).render(
                "duckdb"
            )
            sql_times.append(thread_cpu() - c)
        per_query[q] = med(times) * 1e3
        everything += times
    svc.close()
    return {
        "median_ms": med(everything) * 1e3,
        "median_cpu_ms": med(cpu_times) * 1e3,
        "median_cpu_ms_with_sql": med(sql_times) * 1e3,
        "per_query_ms": per_query,
    }


def thread_cpu() -> float:
    # CLOCK_THREAD_CPUTIME_ID: nanoseconds (getrusage's RUSAGE_THREAD counts whole ticks, too
    # coarse for a ~1 ms plan: its median read 0).
    return time.thread_time()


def bench_fixture(reps: int) -> dict[str, Any]:
    """The fixture query at 20k rows: plain vs DP end to end, and DP queries/s (one thread)."""
    svc = service(":memory:", str(ROOT / "fixtures" / "visits.toml"))
    settings = Settings.from_policy(svc.policy)
    settings.epsilon = 1e-6  # a tiny charge per run (the fine grid of a rescaled sum needs > 1e-9)
    q = "SELECT department, COUNT(*), AVG(cost) FROM visits GROUP BY department"
    con = svc.engine._con
    plain, dp = [], []
    for _ in range(reps):
        plain.append(timed(lambda: con.execute(q).fetchall())[0])
        dp.append(timed(lambda: svc.execute(q, None, settings, "bench"))[0])
    svc.close()
    return {
        "plain_ms": med(plain) * 1e3,
        "dp_ms": med(dp) * 1e3,
        "ratio": med(dp) / med(plain),
        "dp_queries_per_s": 1 / med(dp),
    }


# -- plain vs DP at scale --------------------------------------------------------------------
def check_row_level(svc: Service, exact: Service) -> None:
    """ZeroNoise: the row-level DP aggregates equal hand-written reference SQL, exactly."""
    settings = answer_only(exact)
    q = QUERIES["group_by"].format(t="visits_rows")
    plan = exact.plan(parse_statement(q, exact.policy), settings)
    got = exact.engine.execute(compile_plan(plan, 7))
    by_key = {k[0]: [m[i] for m in got.measures] for i, k in enumerate(got.key_rows)}
    ref = svc.engine._con.execute(
        "SELECT department, COUNT(*), SUM(CASE WHEN cost IS NOT NULL THEN CAST(ROUND(LEAST("
        "GREATEST(cost, 0.0), 5000.0) / 0.01) AS BIGINT) - 250000 END), COUNT(cost) "
        "FROM visits_rows GROUP BY department"
    ).fetchall()
    for dept, n, s, c in ref:
        assert by_key[dept] == [n, s, c], (dept, by_key[dept], (n, s, c))
    released = dict(
        (r[0], r[1:]) for r in exact.execute(q, None, settings, "check").rows
    )  # COUNT(*) after (zero) noise equals the plain count
    for dept, n, _, _ in ref:
        assert released[dept][0] == n


def reference_unit_sql(plan: Any, secret: int) -> str:
    """The previous plan (row_number() over every row), kept as an executable reference; for
    bounding = "scale", every pair's sums times R/n, in 128 bits, straight from the rows."""
    from dpsql.lower.compile import _domain_filters, _q, row_value

    table = plan.query.table
    conds = [f"TRY({plan.query.where.sql(dialect='duckdb')})"] if plan.query.where else []
    conds += _domain_filters(plan)
    where = f" WHERE {' AND '.join(conds)}" if conds else ""
    keys = [f"k{i}" for i in range(len(plan.keys))]
    key_select = [f"TRY({kp.key.sql}) AS {k}" for kp, k in zip(plan.keys, keys, strict=True)]
    vm = [m for m in plan.measures if row_value(m, table) is not None]
    cols = ", ".join(_q(c) for c in table.columns)
    gc = ", ".join(["__u", *keys])
    base = [f"{_q(table.privacy_unit)} AS __u", *key_select]
    base += [f"{row_value(m, table)} AS v_{m.name}" for m in vm]
    base.append(f"HASH({cols}, {secret}) AS __h")
    sums = "".join(f", SUM(v_{m.name}) AS v_{m.name}" for m in vm)
    sql = (
        f"WITH base AS (SELECT {', '.join(base)} FROM {_q(table.name)}{where}), "
        f"kept AS (SELECT * FROM base QUALIFY ROW_NUMBER() OVER (PARTITION BY {gc} "
        f"ORDER BY __h) <= {plan.max_rows}), "
        f"bounded AS (SELECT {gc}, COUNT(*) AS __n{sums} FROM kept GROUP BY {gc})"
    )
    if plan.bounding == "scale":
        r = plan.max_rows
        scaled = "".join(
            f", CAST(SUM(v_{m.name}) AS HUGEINT) * ({m.pair_scale} * LEAST(COUNT(*), {r})) "
            f"// COUNT(*) AS v_{m.name}"
            for m in vm
        )
        sql = (
            f"WITH base AS (SELECT {', '.join(base)} FROM {_q(table.name)}{where}), "
            f"bounded AS (SELECT {gc}, LEAST(COUNT(*), {r}) AS __n{scaled} FROM base "
            f"GROUP BY {gc})"
        )
    src = "bounded"
    if plan.group_scaling:  # public keys, scale: a unit's k > G groups all kept at G/k
        g = plan.max_groups
        rows_scale = next(m.pair_scale for m in plan.measures if m.kind in ("rows", "units"))
        parts = "".join(f", (v_{m.name} * LEAST(__g, {g})) // __g AS v_{m.name}" for m in vm)
        sql += (
            f", ranked AS (SELECT __u, {', '.join(keys)}, (__n * {rows_scale} * LEAST(__g, {g})) "
            f"// __g AS __n{parts} FROM (SELECT *, COUNT(*) OVER (PARTITION BY __u) AS __g "
            "FROM bounded))"
        )
        src = "ranked"
    elif keys:
        sql += (
            f", ranked AS (SELECT * FROM bounded QUALIFY ROW_NUMBER() OVER (PARTITION BY __u "
            # the compiler ranks a unit's groups by HASH(unit, keys, secret): each unit drops
            # its own groups, not the same groups for everyone
            f"ORDER BY HASH(__u, {', '.join(keys)}, {secret}), {', '.join(keys)}) "
            f"<= {plan.max_groups})"
        )
        src = "ranked"
    rounded = [
        ("__n" if m.kind == "rows" else f"v_{m.name}", m.fine)
        for m in plan.measures
        if m.fine > 1 and m.kind != "units"
    ]
    if rounded:
        # counts on the fine grid, rounded per unit (dpsql.plan.values, ROUNDED_KINDS): one
        # window over every pair of the unit in key order, NULLs last; U_u from the unit id
        from dpsql.plan.values import ROUNDING_MULTIPLIER

        grid = rounded[0][1]
        off = f"((((__u % {grid}) + {grid}) % {grid}) * {ROUNDING_MULTIPLIER}) % {grid}"
        order = ", ".join(f"{k} ASC NULLS LAST" for k in keys)
        window = f"OVER (PARTITION BY __u ORDER BY {order} ROWS UNBOUNDED PRECEDING)"
        parts = []
        for col, f in rounded:
            run = f"SUM(CAST({col} AS HUGEINT)) {window}" if keys else f"CAST({col} AS HUGEINT)"
            parts.append(f"(({run}) + __off) // {f} - (({run}) - {col} + __off) // {f} AS {col}")
        sql += (
            f", offs AS (SELECT *, {off} AS __off FROM {src}), "
            f"rounded AS (SELECT * REPLACE ({', '.join(parts)}) FROM offs)"
        )
        src = "rounded"
    sel = list(keys)
    for m in plan.measures:
        sel.append(
            "SUM(__n)"
            if m.kind == "rows"
            else "COUNT(*)"
            if m.kind == "units"
            else f"SUM(v_{m.name})"
        )
    return f"{sql} SELECT {', '.join(sel)} FROM {src}" + (
        f" GROUP BY {', '.join(keys)}" if keys else ""
    )


def _norm(rows: list[tuple], nk: int) -> list[tuple]:
    return sorted(tuple(int(v or 0) if i >= nk else v for i, v in enumerate(r)) for r in rows)


def check_unit_level(exact: Service) -> None:
    """Same secret, same rows and groups kept: the new plan equals the window-everything one."""
    settings = answer_only(exact)
    settings.delta = 1e-6
    for name, q in QUERIES.items():
        plan = exact.plan(parse_statement(q.format(t="visits"), exact.policy), settings)
        compiled = compile_plan(plan, 4242)
        got = exact.engine._con.execute(compiled.render("duckdb")).fetchall()
        ref = exact.engine._con.execute(reference_unit_sql(plan, 4242)).fetchall()
        nk = len(plan.keys)
        assert _norm(got, nk) == _norm(ref, nk), name
        print(f"  check: unit-level {name} equals the reference plan ({len(got)} groups)")


def check_store(exact_store: Service) -> None:
    """Same secret: the store-backed plan's exact measures equal the plan without a store."""
    settings = answer_only(exact_store)
    settings.delta = 1e-6
    con = exact_store.engine._con
    for name, q in QUERIES.items():
        for table in ("visits_rows", "visits"):
            plan = exact_store.plan(
                parse_statement(q.format(t=table), exact_store.policy), settings
            )
            new = compile_plan(plan, 4242)
            # the store is used, except on the shape where its plan would be slower
            # (dpsql.lower.prepared_plan.two_phase_pays: decided by the plan's shape)
            assert "__dp_p_" in new.sql or not two_phase_pays(plan), (name, table)
            got = con.execute(new.render("duckdb")).fetchall()
            ref = con.execute(compile_plan(plan, 4242, store=False).render("duckdb")).fetchall()
            nk = len(plan.keys)
            assert _norm(got, nk) == _norm(ref, nk), (name, table)
        print(f"  check: store plans of {name} equal the plans without a store (same secret)")


def bench_scale(
    svc: Service, reps: int, tables: list[str], store: Service | None = None
) -> list[dict[str, Any]]:
    settings = Settings.from_policy(svc.policy)
    con = svc.engine._con
    out = []
    for name, q in QUERIES.items():
        plain_sql = q.format(t="visits_rows")
        for table in tables:
            dp_sql = q.format(t=table)
            plan = svc.plan(parse_statement(dp_sql, svc.policy), settings)
            engine_sql = compile_plan(plan, 99).render("duckdb")
            floor_sql = FLOORS[(name, table)]
            runs = {
                "p": lambda s=plain_sql: con.execute(s).fetchall(),
                "d": lambda s=dp_sql: svc.execute(s, None, settings, "bench"),
                "e": lambda s=engine_sql: con.execute(s).fetchall(),
                "f": lambda s=floor_sql: con.execute(s).fetchall(),
            }
            if store is not None:  # the same query through the prepared store, side by side
                store_plan = store.plan(parse_statement(dp_sql, store.policy), settings)
                store_sql = compile_plan(store_plan, 99).render("duckdb")
                scon = store.engine._con
                runs["s"] = lambda s=dp_sql: store.execute(s, None, settings, "bench")
                runs["t"] = lambda s=store_sql, c=scon: c.execute(s).fetchall()
            rec: dict[str, list[float]] = {k + x: [] for k in runs for x in "wc"}
            for _ in range(reps):
                for key, fn in runs.items():
                    w, c = timed(fn)
                    rec[key + "w"].append(w)
                    rec[key + "c"].append(c)
            m = {k: med(v) for k, v in rec.items()}
            row = {
                "query": name,
                "table": table,
                "plain_ms": m["pw"] * 1e3,
                "dp_ms": m["dw"] * 1e3,
                "engine_ms": m["ew"] * 1e3,
                "ratio_wall": m["dw"] / m["pw"],
                "ratio_cpu": m["dc"] / m["pc"],
                "engine_ratio_wall": m["ew"] / m["pw"],
                "engine_ratio_cpu": m["ec"] / m["pc"],
                "floor_ratio_wall": m["fw"] / m["pw"],
                "floor_ratio_cpu": m["fc"] / m["pc"],
            }
            if store is not None:
                row.update(
                    store_dp_ms=m["sw"] * 1e3,
                    store_ratio_wall=m["sw"] / m["pw"],
                    store_ratio_cpu=m["sc"] / m["pc"],
                    store_engine_ratio_cpu=m["tc"] / m["pc"],
                )
            out.append(row)
            if store is not None:
                print(
                    f"  {name:10s} {table:12s} STORE DP {row['store_dp_ms']:8.1f} ms  "
                    f"x{row['store_ratio_wall']:5.2f} wall  x{row['store_ratio_cpu']:5.2f} cpu   "
                    f"(store engine SQL alone x{row['store_engine_ratio_cpu']:5.2f} cpu)",
                    flush=True,
                )
            print(
                f"  {name:10s} {table:12s} plain {row['plain_ms']:8.1f} ms  DP {row['dp_ms']:8.1f}"
                f" ms  x{row['ratio_wall']:5.2f} wall  x{row['ratio_cpu']:5.2f} cpu   "
                f"(engine SQL alone x{row['engine_ratio_wall']:5.2f} wall,"
                f" x{row['engine_ratio_cpu']:5.2f} cpu; floor x{row['floor_ratio_wall']:5.2f} wall,"
                f" x{row['floor_ratio_cpu']:5.2f} cpu)",
                flush=True,
            )
    return out


# -- memory: one fresh process per query -------------------------------------------------------
def _rss_kib(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def memory_child(db: str, pol: str, kind: str, query: str, table: str) -> None:
    svc = service(db, json.loads(pol))
    settings = Settings.from_policy(svc.policy)
    before = _rss_kib()
    if kind == "plain":
        svc.engine._con.execute(QUERIES[query].format(t="visits_rows")).fetchall()
    elif kind == "floor":
        svc.engine._con.execute(FLOORS[(query, table)]).fetchall()
    else:
        svc.execute(QUERIES[query].format(t=table), None, settings, "bench")
    # VmHWM: this process's peak RSS. (ru_maxrss would do, but Linux carries it over from the
    # parent across fork + exec, so a child of a big bench process reports the parent's peak.)
    peak = _rss_kib("VmHWM")
    print(json.dumps({"before_kib": before, "peak_kib": peak}))


def bench_memory(
    db: Path, pol: dict, queries: list[str], tables: list[str], store_pol: dict | None = None
) -> list[dict]:
    def child(kind: str, query: str, table: str, p: dict = pol) -> dict:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--memory-child",
                str(db),
                json.dumps(p),
                kind,
                query,
                table,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    rows = []
    for query in queries:
        plain = child("plain", query, "visits_rows")
        for table in tables:
            dp = child("dp", query, table)
            floor = child("floor", query, table)
            st = child("dp", query, table, store_pol) if store_pol is not None else None
            row = {
                "query": query,
                "table": table,
                "plain_peak_mib": plain["peak_kib"] / 1024,
                "dp_peak_mib": dp["peak_kib"] / 1024,
                "ratio_peak": dp["peak_kib"] / plain["peak_kib"],
                "plain_query_mib": (plain["peak_kib"] - plain["before_kib"]) / 1024,
                "dp_query_mib": (dp["peak_kib"] - dp["before_kib"]) / 1024,
                "floor_peak_mib": floor["peak_kib"] / 1024,
                "floor_ratio_peak": floor["peak_kib"] / plain["peak_kib"],
            }
            if st is not None:
                row["store_peak_mib"] = st["peak_kib"] / 1024
                row["store_ratio_peak"] = st["peak_kib"] / plain["peak_kib"]
                print(
                    f"  {query:10s} {table:12s} peak RSS STORE DP {row['store_peak_mib']:7.1f} "
                    f"MiB  x{row['store_ratio_peak']:4.2f}",
                    flush=True,
                )
            rows.append(row)
            print(
                f"  {query:10s} {table:12s} peak RSS plain {row['plain_peak_mib']:7.1f} MiB  DP "
                f"{row['dp_peak_mib']:7.1f} MiB  x{row['ratio_peak']:4.2f}   (above the RSS "
                f"before the query: plain {row['plain_query_mib']:6.1f}, DP "
                f"{row['dp_query_mib']:6.1f} MiB; floor {row['floor_peak_mib']:7.1f} MiB "
                f"x{row['floor_ratio_peak']:4.2f})",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=None, help="rows to generate (10M; quick 1M)")
    ap.add_argument(
        "--quick", action="store_true", help="1M rows unless --rows says, fewer repetitions"
    )
    ap.add_argument("--reps", type=int, default=None, help="repetitions per query (5; quick 3)")
    ap.add_argument(
        "--hot",
        type=float,
        default=0.6,
        help="share of a patient's visits in their home department (0.6)",
    )
    ap.add_argument("--max-rows-per-unit", type=int, default=5, help="R (5)")
    ap.add_argument("--max-groups-per-unit", type=int, default=3, help="G (3)")
    ap.add_argument(
        "--perfect-hash-bits",
        type=int,
        default=12,
        help="[engine] perfect_hash_bits of the policy (12, DuckDB's default)",
    )
    ap.add_argument(
        "--bounding",
        choices=["scale", "sample"],
        default="scale",
        help="the privacy-unit table's bounding (scale: R/n of every row; sample: R rows by "
        "keyed hash)",
    )
    ap.add_argument("--data-dir", type=Path, default=ROOT / "bench" / "data")
    ap.add_argument(
        "--check-reference",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare the unit-level plan with the window-everything plan "
        "(default: on with --quick; ~60 s per query at 10M rows)",
    )
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument(
        "--store",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the prepared-store plans side by side (built once under --data-dir)",
    )
    ap.add_argument("--only", choices=["planning", "fixture", "scale", "memory"], default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--memory-child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_child:
        memory_child(*args.memory_child)
        return 0
    # --rows wins over --quick's 1M (the smoke test asks for 200k; it silently ran 1M before)
    rows = args.rows or (1_000_000 if args.quick else 10_000_000)
    reps = args.reps or (3 if args.quick else 5)
    check = args.quick if args.check_reference is None else args.check_reference
    results: dict[str, Any] = {"rows": rows, "reps": reps}
    print(
        f"dpsql core bench: {rows:,} rows, {reps} reps, duckdb {duckdb.__version__}, "
        f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}, bounding {args.bounding}",
        flush=True,
    )
    if args.only in (None, "planning"):
        p = bench_planning(200)
        results["planning"] = p
        print(
            f"planning (parse+bind+plan+compile, to what the engine runs) median "
            f"{p['median_ms']:.2f} ms wall, {p['median_cpu_ms']:.2f} ms CPU over the mix "
            f"(rendering the SQL always: {p['median_cpu_ms_with_sql']:.2f} ms CPU)"
        )
        for q, ms in p["per_query_ms"].items():
            print(f"  {ms:6.2f} ms  {q[:80]}")
    if args.only in (None, "fixture"):
        f = bench_fixture(30)
        results["fixture"] = f
        print(
            f"fixture (20k rows) GROUP BY department: plain {f['plain_ms']:.2f} ms, DP end to end "
            f"{f['dp_ms']:.2f} ms (x{f['ratio']:.1f}), {f['dp_queries_per_s']:.0f} DP queries/s"
            " on one thread"
        )
    db = args.data_dir / f"core_{rows}_hot{round(args.hot * 100)}.duckdb"
    pol = policy(
        args.max_rows_per_unit,
        args.max_groups_per_unit,
        args.perfect_hash_bits,
        bounding=args.bounding,
    )
    tables = ["visits_rows", "visits"]
    store_pol = None
    if args.only in (None, "scale", "memory"):
        t = time.perf_counter()
        generate(db, rows, args.hot)
        print(f"data: {db} ({time.perf_counter() - t:.1f} s to generate or find)", flush=True)
        if args.store:
            store_pol = policy(
                args.max_rows_per_unit,
                args.max_groups_per_unit,
                args.perfect_hash_bits,
                store=args.data_dir / f"store_{db.stem}",
                bounding=args.bounding,
            )
            store_svc = service(db, store_pol)
            for info in store_svc.engine.stores:
                print(
                    f"  store {info.table}: {'reused' if info.reused else 'built'} in "
                    f"{info.build_seconds:.1f} s, {info.bytes / 2**20:.0f} MiB on disk",
                    flush=True,
                )
            results["store"] = [
                {"table": i.table, "seconds": i.build_seconds, "bytes": i.bytes, "reused": i.reused}
                for i in store_svc.engine.stores
            ]
            store_svc.close()
    if args.only in (None, "scale"):
        svc = service(db, pol)
        exact = service(db, pol, noise=ZeroNoise())
        check_row_level(svc, exact)
        print("  check: row-level DP aggregates (ZeroNoise) equal the reference query exactly")
        if check:
            check_unit_level(exact)
        exact.close()
        store = None
        if store_pol is not None:
            exact_store = service(db, store_pol, noise=ZeroNoise())
            check_store(exact_store)
            exact_store.close()
            store = service(db, store_pol)
        print(
            f"plain vs DP, medians of {reps} interleaved runs (visits = privacy unit "
            f"patient_id, R={args.max_rows_per_unit}, G={args.max_groups_per_unit}, "
            f"perfect_hash_bits={args.perfect_hash_bits}):"
        )
        results["scale"] = bench_scale(svc, reps, tables, store)
        svc.close()
        if store is not None:
            store.close()
    if args.only in (None, "memory") and not args.skip_memory:
        print("peak memory (fresh process per query, peak RSS = VmHWM):")
        results["memory"] = bench_memory(db, pol, ["group_by", "no_group"], tables, store_pol)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
