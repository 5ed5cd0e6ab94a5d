"""Issue 28 item 2 for the opt-in SQL store: the same DP query as SQL with ``[engine] prepared =
"memory"`` and without it, side by side, on bench_fast's data and policy (every unit in 10
groups, G = 1: every unit over G), with and without a WHERE that changes every run.

Both services hide their in-memory store (the compiled pass, the default plan) so that both
run SQL; the answer cache is off (every query planned, and any per-query purchase such as the
default clamp range's histogram made, on both sides alike). Process CPU, medians of
interleaved rounds, ratios to plain DuckDB on the same connection.

    python bench/bench_prepared_sql.py --rows 2000000 --reps 5
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_fast as bf  # noqa: E402

from dpsql.dbapi import Service  # noqa: E402
from dpsql.pipeline import Settings  # noqa: E402
from dpsql.privacy.ledger import MemoryLedger  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--data-dir", type=Path, default=ROOT / "bench" / "data")
    args = ap.parse_args(argv)
    db = args.data_dir / f"fast_{args.rows}.duckdb"
    bf.generate(db, args.rows)
    stored = copy.deepcopy(bf.policy())
    stored["engine"] = {"prepared": "memory"}
    plain_svc = Service(bf.policy(), str(db), ledger=MemoryLedger(), cache=False)
    store_svc = Service(stored, str(db), ledger=MemoryLedger(), cache=False)
    for svc in (plain_svc, store_svc):
        svc.engine.wait_for_stores()
        svc.engine.columns.clear()  # SQL plans on both sides
    print(f"{args.rows:,} rows; load {' '.join(map(str, os.getloadavg()))}", flush=True)
    con = plain_svc.engine._con
    ctr = itertools.count(1)

    def dp(svc: Service, text: str):
        return lambda: svc.execute(text.format(t="tu", k=next(ctr)), None, settings(svc), "a")

    def settings(svc: Service) -> Settings:
        return Settings.from_policy(svc.policy)

    runs = {
        "plain, WHERE": lambda: con.execute(bf.Q.format(t="tr", k=next(ctr))).fetchall(),
        "plain, no WHERE": lambda: con.execute(bf.Q0.format(t="tr")).fetchall(),
        "unit, WHERE, no store": dp(plain_svc, bf.Q),
        "unit, WHERE, SQL store": dp(store_svc, bf.Q),
        "unit, no WHERE, no store": dp(plain_svc, bf.Q0),
        "unit, no WHERE, SQL store": dp(store_svc, bf.Q0),
    }
    cpus: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.reps):
        for key, fn in runs.items():
            c = bf.cpu()
            fn()
            cpus[key].append(bf.cpu() - c)
    med = {k: statistics.median(v) for k, v in cpus.items()}
    for key in runs:
        base = med["plain, no WHERE" if "no WHERE" in key else "plain, WHERE"]
        print(f"{key:28s} {med[key] * 1e3:9.1f} ms CPU {med[key] / base:7.2f}x")
    print(f"load {' '.join(map(str, os.getloadavg()))}")
    plain_svc.close()
    store_svc.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
