"""Utility of the two boundings of a (unit, group) over R rows: "sample" (R rows by keyed hash)
against "scale" (R/n of every row), on the same data, queries, ε and noise seeds.

For each query and ε: the mean relative error |released − true| / |true| over ``--reps``
repetitions (fresh noise and, for sampling, a fresh secret each time; averaged over groups),
where *true* is the plain, unbounded answer; and the bounding's own error with the noise off
(ZeroNoise): its mean relative error and the standard deviation of the exact bounded value
across repetitions (sampling varies with the secret, rescaling does not).

    python bench/bench_bounding.py --reps 200                    # the figures in docs/mechanisms.md
    python bench/bench_bounding.py --data /path/to/pums --reps 50

Data: PUMS_dup (1,948 rows, 1–3 per person, ``--data``; R = 1, G = 1) and the synthetic visits
of bench_core (``--rows``, default 100k: ~10 rows per patient, 60% in a home department;
R = 5, G = 3: bounds bind on about half the rows).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_core  # noqa: E402
import duckdb  # noqa: E402

import dpsql  # noqa: E402
from dpsql.privacy.ledger import MemoryLedger  # noqa: E402
from dpsql.privacy.samplers import SeededNoise, ZeroNoise  # noqa: E402

PUMS_QUERIES = [
    ("PUMS_dup COUNT(*)", "SELECT 0, COUNT(*) FROM pums"),
    ("PUMS_dup SUM(income)", "SELECT 0, SUM(income) FROM pums"),
    ("PUMS_dup AVG(income) BY sex", "SELECT sex, AVG(income) FROM pums GROUP BY sex"),
    ("PUMS_dup AVG(age) BY educ", "SELECT educ, AVG(age) FROM pums GROUP BY educ"),
]
VISITS_QUERIES = [
    ("visits SUM(cost) BY department", "SELECT department, SUM(cost) FROM {t} GROUP BY 1"),
    ("visits AVG(cost) BY department", "SELECT department, AVG(cost) FROM {t} GROUP BY 1"),
    ("visits SUM(cost)", "SELECT 0, SUM(cost) FROM {t}"),
    (
        "visits AVG(cost) BY smoker, decade, WHERE",
        "SELECT smoker || '/' || CAST(FLOOR(age / 10) * 10 AS VARCHAR), AVG(cost) FROM {t} "
        "WHERE visit_date >= DATE '2024-03-01' GROUP BY 1",
    ),
]


def pums_policy(csv: Path, bounding: str, epsilon: float) -> dict:
    columns = {
        "pid": {"type": "int", "nullable": False},
        "age": {"type": "int", "lower": 0, "upper": 100, "nullable": False},
        "sex": {"type": "int", "values": [0, 1], "nullable": False},
        "educ": {"type": "int", "values": list(range(1, 17)), "nullable": False},
        "income": {"type": "float", "lower": 0, "upper": 500_000, "nullable": False},
    }
    return {
        "privacy": {"epsilon": epsilon, "delta": 1e-6, "budget_epsilon": 1e12},
        "tables": {
            "pums": {
                "source": str(csv),
                "privacy_unit": "pid",
                "max_rows_per_unit": 1,
                "bounding": bounding,
                "columns": columns,
            }
        },
    }


def visits_policy(bounding: str, epsilon: float) -> dict:
    policy = bench_core.policy(5, 3, bounding=bounding)
    policy["privacy"]["epsilon"] = epsilon
    return policy


def released(cur, sql: str) -> dict:
    cur.execute(sql)
    return {r[0]: float(r[1]) for r in cur.fetchall() if r[1] is not None}


def rel_errors(got: dict, true: dict) -> float:
    errs = [abs(got.get(k, 0.0) - v) / abs(v) for k, v in true.items() if v]
    return float(np.mean(errs))


def run(queries, connect, truth_con, table: str, epsilons, reps: int) -> list[dict]:
    rows = []
    for name, sql in queries:
        sql_dp = sql.format(t=table)
        true = {r[0]: float(r[1]) for r in truth_con.execute(sql.format(t="visits")).fetchall()}
        for bounding in ("sample", "scale"):
            with connect(bounding, 1.0, ZeroNoise()) as conn:  # the bounding's error alone
                cur = conn.cursor()
                exact = [released(cur, sql_dp) for _ in range(max(20, reps // 5))]
            keys = sorted(true, key=str)
            spread = np.std([[e.get(k, 0.0) for k in keys] for e in exact], axis=0, ddof=1)
            scale = np.array([abs(true[k]) or 1.0 for k in keys])
            row = {
                "query": name,
                "bounding": bounding,
                "bound_err": float(np.mean([rel_errors(e, true) for e in exact])),
                "bound_sd": float(np.mean(spread / scale)),
            }
            for eps in epsilons:
                with connect(bounding, eps, SeededNoise(int(eps * 1000) + 7)) as conn:
                    cur = conn.cursor()
                    row[eps] = float(
                        np.mean([rel_errors(released(cur, sql_dp), true) for _ in range(reps)])
                    )
            rows.append(row)
    return rows


def markdown(rows: list[dict], epsilons) -> str:
    head = ["query", "bounding", "bounding error (noise off)", "its sd across secrets"]
    head += [f"rel. error at ε = {e:g}" for e in epsilons]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["query"], r["bounding"], f"{r['bound_err']:.4%}", f"{r['bound_sd']:.4%}"]
        cells += [f"{r[e]:.4%}" for e in epsilons]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("/work/shared/datasets/pums"))
    parser.add_argument("--rows", type=int, default=100_000, help="synthetic visits rows")
    parser.add_argument("--reps", type=int, default=50, help="repetitions (200 for the docs)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.1, 1.0])
    parser.add_argument("--data-dir", type=Path, default=ROOT / "bench" / "data")
    args = parser.parse_args(argv)
    load, start = os.getloadavg()[0], time.perf_counter()
    warnings.simplefilter("ignore")
    rows: list[dict] = []
    csv = args.data / "PUMS_dup.csv"
    if csv.exists():
        truth = duckdb.connect()
        truth.execute(f"CREATE TABLE visits AS SELECT * FROM read_csv_auto('{csv}')")

        def pums(bounding, eps, noise):
            return dpsql.connect(
                policy=pums_policy(csv, bounding, eps),
                ledger=MemoryLedger(),
                cache=False,
                noise=noise,
            )

        queries = [(n, q.replace("FROM pums", "FROM {t}")) for n, q in PUMS_QUERIES]
        rows += run(queries, pums, truth, "pums", args.epsilons, args.reps)
    else:
        print(f"(no {csv}: PUMS_dup rows skipped)", file=sys.stderr)
    db = args.data_dir / f"core_{args.rows}_hot60.duckdb"
    bench_core.generate(db, args.rows, 0.6)
    truth = duckdb.connect(str(db), read_only=True)

    def visits(bounding, eps, noise):
        return dpsql.connect(
            policy=visits_policy(bounding, eps),
            database=str(db),
            ledger=MemoryLedger(),
            cache=False,
            noise=noise,
        )

    rows += run(VISITS_QUERIES, visits, truth, "visits", args.epsilons, args.reps)
    print(markdown(rows, args.epsilons))
    print(
        f"\n{args.reps} repetitions, {time.perf_counter() - start:.0f} s; load average {load:.1f} "
        f"at start, {os.getloadavg()[0]:.1f} at end; {os.cpu_count()} cores",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
