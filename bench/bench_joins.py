"""Joins: a DP query over fact ⋈ dimension vs the same DP query on the pre-joined table.

Generates (deterministic, into bench/data/, git-ignored) a fact table ``visits`` of ``--rows``
rows (~10 per patient), a private ``patients`` table (one row per patient), a public dimension
``departments`` of ``--dims`` rows (a Parquet file: public tables are read at connect), and
``visits_wide``, the same facts with the dimension's and the patient's columns already joined.
Then, interleaved ``--reps`` times, medians of wall and process-CPU time of the whole DP
pipeline (bind, plan, engine, noise) for each pair:

- public: ``visits v JOIN departments d`` (a real JOIN with the public rows as VALUES) vs
  ``visits_wide``;
- the same public joins in the first design, a lookup CASE per public column (and
  ``dept_id IN (keys)``) instead of a JOIN (``REAL_PUBLIC_JOINS = False``);
- private: ``visits v JOIN patients p ON v.patient_id = p.patient_id`` (a real JOIN in the
  engine, bounded after it) vs ``visits_wide``.

The answers are checked equal with noise off (same secret) before timing.

    python bench/bench_joins.py --rows 1000000 --dims 100 --reps 3
    python bench/bench_joins.py                       # 10M rows, 100 and 10000 departments
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import duckdb  # noqa: E402

from dpsql.dbapi import Service  # noqa: E402
from dpsql.frontend import private_joins  # noqa: E402
from dpsql.pipeline import Settings  # noqa: E402
from dpsql.privacy.ledger import MemoryLedger  # noqa: E402
from dpsql.privacy.samplers import ZeroNoise  # noqa: E402

REGIONS = ["north", "south", "east", "west"]
FACT = {
    "visit_id": {"type": "int"},
    "patient_id": {"type": "int", "nullable": False},
    "dept_id": {"type": "int"},
    "cost": {"type": "float", "lower": 0.0, "upper": 5000.0, "granularity": 0.01},
}
PATIENT = {
    "patient_id": {"type": "int", "nullable": False},
    "sex": {"type": "text", "values": ["f", "m"], "nullable": False},
}
DIM = {"id": {"type": "int"}, "name": {"type": "text"}, "region": {"type": "text"}}
WIDE = {
    **FACT,
    "region": {"type": "text", "values": REGIONS},
    "sex": {"type": "text", "values": ["f", "m"], "nullable": False},
}

# (label, DP query over the join, the same DP query over visits_wide)
QUERIES = [
    (
        "public: GROUP BY d.region, COUNT, SUM",
        "SELECT d.region, COUNT(*), SUM(v.cost) FROM visits v JOIN departments d "
        "ON v.dept_id = d.id GROUP BY d.region",
        "SELECT region, COUNT(*), SUM(cost) FROM visits_wide WHERE region IS NOT NULL "
        "GROUP BY region",
    ),
    (
        "public: WHERE d.region = 'north', SUM",
        "SELECT SUM(v.cost) FROM visits v JOIN departments d ON v.dept_id = d.id "
        "WHERE d.region = 'north'",
        "SELECT SUM(cost) FROM visits_wide WHERE region = 'north'",
    ),
    (
        "private on the unit: GROUP BY p.sex, COUNT, SUM",
        "SELECT p.sex, COUNT(*), SUM(v.cost) FROM visits v JOIN patients p "
        "ON v.patient_id = p.patient_id GROUP BY p.sex",
        "SELECT sex, COUNT(*), SUM(cost) FROM visits_wide GROUP BY sex",
    ),
]


def generate(directory: Path, rows: int, dims: int) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    db = directory / f"joins_{rows}_{dims}.duckdb"
    dim = directory / f"departments_{dims}.parquet"
    if db.exists() and dim.exists():
        return db, dim
    con = duckdb.connect(str(db))
    con.execute(
        f"CREATE OR REPLACE TABLE departments AS SELECT i AS id, 'dept' || i AS name, "
        f"{REGIONS!r}[1 + i % 4] AS region FROM range(1, {dims} + 1) t(i)"
    )
    con.execute(f"COPY departments TO '{dim}' (FORMAT parquet)")
    patients = max(rows // 10, 1)
    con.execute(
        f"CREATE OR REPLACE TABLE patients AS SELECT i AS patient_id, "
        f"CASE WHEN hash(i) % 2 = 0 THEN 'f' ELSE 'm' END AS sex FROM range(1, {patients} + 1) t(i)"
    )
    # dept_id: 2% match no department (0), 1% NULL
    con.execute(
        f"CREATE OR REPLACE TABLE visits AS SELECT i AS visit_id, "
        f"1 + (hash(i, 1) % {patients})::BIGINT AS patient_id, "
        f"CASE WHEN hash(i, 2) % 100 = 0 THEN NULL WHEN hash(i, 2) % 100 < 3 THEN 0 "
        f"ELSE 1 + (hash(i, 3) % {dims})::BIGINT END AS dept_id, "
        f"round((hash(i, 4) % 500000) / 100.0, 2) AS cost FROM range({rows}) t(i)"
    )
    con.execute(
        "CREATE OR REPLACE TABLE visits_wide AS SELECT v.*, d.region, p.sex FROM visits v "
        "LEFT JOIN departments d ON v.dept_id = d.id JOIN patients p USING (patient_id)"
    )
    con.close()
    return db, dim


def policy(dim: Path, dims: int, r: int = 5, g: int = 2) -> dict[str, Any]:
    bounds = {"privacy_unit": "patient_id", "max_rows_per_unit": r, "max_groups_per_unit": g}
    return {
        "privacy": {
            "epsilon": 1.0,
            "delta": 1e-6,
            "budget_epsilon": 1e12,
            "budget_delta": 0.5,
            "dataset": "bench_joins",
            "max_bins": max(dims, 10_000),
        },
        "tables": {
            "visits": {"source": "visits", "columns": FACT, **bounds},
            "visits_wide": {"source": "visits_wide", "columns": WIDE, **bounds},
            "patients": {
                "source": "patients",
                "privacy_unit": "patient_id",
                "primary_key": "patient_id",
                "columns": PATIENT,
            },
            "departments": {
                "source": str(dim),
                "public": True,
                "primary_key": "id",
                "columns": DIM,
            },
        },
    }


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn) -> tuple[float, float]:
    c, w = cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - w, cpu() - c


def _answer(svc: Service, sql: str, settings: Settings) -> list[tuple]:
    rows = svc.execute(sql, None, settings, "bench").rows
    return sorted(
        (tuple(round(x, 2) if isinstance(x, float) else x for x in r) for r in rows), key=repr
    )


def run(rows: int, dims: int, reps: int, lookup_max: int) -> list[dict[str, Any]]:
    db, dim = generate(ROOT / "bench" / "data", rows, dims)
    pol = policy(dim, dims)
    import dpsql.pipeline

    original = dpsql.pipeline.secrets.randbits
    dpsql.pipeline.secrets.randbits = lambda bits: 4242  # the same secret: comparable answers
    # bounds that never bind: which R rows a unit keeps depends on the hash of its whole row,
    # and the pre-joined rows have more columns
    wide_bounds = policy(dim, dims, r=1000, g=10)
    for lookup in (False, True) if dims <= lookup_max else (False,):
        private_joins.REAL_PUBLIC_JOINS = not lookup
        # a Service per lowering: a service keeps its plans, by query text
        exact = Service(wide_bounds, str(db), ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
        settings = Settings.from_policy(exact.policy)
        for label, joined, wide in QUERIES:
            _check_lowering(exact, joined, settings, lookup)
            got, want = _answer(exact, joined, settings), _answer(exact, wide, settings)
            if got != want:
                raise SystemExit(f"{label}: answers differ\n  join: {got}\n  wide: {want}")
        exact.close()
    dpsql.pipeline.secrets.randbits = original
    services = {
        lookup: Service(pol, str(db), ledger=MemoryLedger(), cache=False)
        for lookup in (False, True)
    }
    settings = Settings.from_policy(services[False].policy)
    out = []
    variants = [(label, joined, wide, False) for label, joined, wide in QUERIES]
    variants += [
        (label.replace("public:", "public, lookup CASE:"), joined, wide, True)
        for label, joined, wide in QUERIES
        if label.startswith("public") and dims <= lookup_max
    ]
    for label, joined, wide, lookup in variants:
        private_joins.REAL_PUBLIC_JOINS = not lookup
        svc = services[lookup]
        times: dict[str, list[tuple[float, float]]] = {"join": [], "wide": []}
        timed(lambda s=joined, svc=svc: svc.execute(s, None, settings, "bench"))  # warm
        timed(lambda s=wide, svc=svc: svc.execute(s, None, settings, "bench"))
        for _ in range(reps):
            times["join"].append(
                timed(lambda s=joined, svc=svc: svc.execute(s, None, settings, "bench"))
            )
            times["wide"].append(
                timed(lambda s=wide, svc=svc: svc.execute(s, None, settings, "bench"))
            )
        med = {k: [statistics.median(x[i] for x in v) for i in (0, 1)] for k, v in times.items()}
        out.append(
            {
                "query": label,
                "dims": dims,
                "join_wall_s": med["join"][0],
                "wide_wall_s": med["wide"][0],
                "join_cpu_s": med["join"][1],
                "wide_cpu_s": med["wide"][1],
                "ratio_wall": med["join"][0] / med["wide"][0],
                "ratio_cpu": med["join"][1] / med["wide"][1],
            }
        )
    private_joins.REAL_PUBLIC_JOINS = True
    for svc in services.values():
        svc.close()
    return out


def _check_lowering(svc: Service, sql: str, settings: Settings, lookup: bool) -> None:
    """The engine SQL is the lowering measured: lookups (CASE) or a JOIN of VALUES."""
    from dpsql.frontend.bind import parse_statement
    from dpsql.lower.compile import compile_plan

    if "departments" not in sql:
        return
    text = compile_plan(svc.plan(parse_statement(sql, svc.policy), settings), 1).sql
    assert ("VALUES" in text) != lookup and ("CASE WHEN dept_id = 1" in text) == lookup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dims", type=int, nargs="+", default=[100, 10_000])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--lookup-max-dims",
        type=int,
        default=1000,
        help="measure the lookup-CASE lowering only up to this many dimension rows (it "
        "evaluates one CASE branch per row: ~10x the JOIN at 1000)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = [
        r for dims in args.dims for r in run(args.rows, dims, args.reps, args.lookup_max_dims)
    ]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.rows:,} fact rows; medians of {args.reps} (wall s / CPU s)")
    print(f"{'query':48} {'dims':>6} {'join':>13} {'pre-joined':>13} {'ratio':>11}")
    for r in results:
        print(
            f"{r['query']:48} {r['dims']:>6} {r['join_wall_s']:6.2f}/{r['join_cpu_s']:5.2f} "
            f"{r['wide_wall_s']:6.2f}/{r['wide_cpu_s']:5.2f} "
            f"{r['ratio_wall']:5.2f}/{r['ratio_cpu']:4.2f}"
        )


if __name__ == "__main__":
    main()
