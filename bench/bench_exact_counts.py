"""Exact counts under ``bounding = "scale"`` (issue 31 item 3): count errors on PUMS.

Through ``dpsql.connect`` with a seeded exact noise source, no answer cache, on
``PUMS_pid.csv`` (one row per ``pid``, declared ``primary_key``: R = G = 1; educ 1..16 and
race 1..6 public, so every GROUP BY below has more bins than G and the plan scales groups):

- ``COUNT(*) BY educ``: mean absolute error over the 16 cells (the discrete Laplace optimum
  2p / (1 - p^2), p = e^(-ε_count), is printed beside it for the count's own ε);
- ``COUNT(*) BY educ, race``: mean absolute error over the 96 cells (small cells are clamped
  at 0, so it is below the optimum);
- ``AVG(income) BY educ``: mean relative error over the 16 groups.

At the session's defaults (``--bias off``: ``SET bias_estimate = off``; where the bounds cut
nothing, a declared primary key, no bias measure is planned and the two are the same).
Measure "before" by copying this file into an older tree (``git archive <commit> | tar -x
-C dir``) and running it there: it imports the dpsql of the tree it sits in.

    python bench/bench_exact_counts.py --reps 200 --epsilons 1 10
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import duckdb  # noqa: E402

import dpsql  # noqa: E402
from dpsql.privacy.ledger import MemoryLedger  # noqa: E402
from dpsql.privacy.samplers import SeededNoise  # noqa: E402

QUERIES = {
    "COUNT(*) BY educ (MAE)": "SELECT educ, COUNT(*) FROM pums GROUP BY educ",
    "COUNT(*) BY educ, race (MAE)": "SELECT educ, race, COUNT(*) FROM pums GROUP BY educ, race",
    "AVG(income) BY educ (mean rel. error)": "SELECT educ, AVG(income) FROM pums GROUP BY educ",
}


def policy(csv: Path, epsilon: float) -> dict:
    columns = {
        "pid": {"type": "int", "nullable": False},
        "educ": {"type": "int", "values": list(range(1, 17)), "nullable": False},
        "race": {"type": "int", "values": list(range(1, 7)), "nullable": False},
        "income": {"type": "float", "lower": 0, "upper": 500_000, "nullable": False},
    }
    return {
        "privacy": {
            "epsilon": epsilon,
            "delta": 1e-6,
            "budget_epsilon": 1e12,
            "budget_delta": 0.5,
        },
        "tables": {
            "pums": {
                "source": str(csv),
                "privacy_unit": "pid",
                "primary_key": "pid",
                "columns": columns,
            }
        },
    }


def truth(csv: Path, sql: str) -> dict[tuple, float]:
    con = duckdb.connect()
    con.execute(f"CREATE TABLE pums AS SELECT * FROM read_csv_auto('{csv}')")
    out = {tuple(r[:-1]): float(r[-1]) for r in con.execute(sql).fetchall()}
    con.close()
    return out


def count_optimum(conn, sql: str) -> float:
    """The discrete Laplace optimum E|X| = 2p / (1 - p^2), p = e^(-1/b), at the scale b (in
    rows) of the plan's row count: the least MAE of any count released with that noise."""
    from dpsql.frontend.bind import parse_statement

    service = conn.service
    plan = service.plan(parse_statement(sql, service.policy), conn._settings)
    (count,) = [m for m in plan.measures if m.kind == "rows"]
    b = count.mechanism.scale / count.scale  # type: ignore[union-attr]
    p = math.exp(-1.0 / b)
    return 2 * p / (1 - p * p)


def run(
    csv: Path, epsilon: float, reps: int, bias: bool, seed: int = 11
) -> dict[str, tuple[float, float | None]]:
    conn = dpsql.connect(
        policy=policy(csv, epsilon), ledger=MemoryLedger(), noise=SeededNoise(seed), cache=False
    )
    cur = conn.cursor()
    if not bias:
        cur.execute("SET bias_estimate = off")
    out: dict[str, tuple[float, float | None]] = {}
    for name, sql in QUERIES.items():
        # the plan's count before any release (a session's later plans may differ: cached
        # contribution bounds, a spent share)
        optimum = count_optimum(conn, sql) if name.startswith("COUNT(*) BY educ (") else None
        true = truth(csv, sql)
        errors = []
        for _ in range(reps):
            cur.execute(sql)
            released = {tuple(r[:-1]): r[-1] for r in cur.fetchall()}
            for key, value in true.items():
                got = released.get(key, 0.0)
                if "AVG" in name:
                    errors.append(abs(got - value) / abs(value))
                else:
                    errors.append(abs(got - value))
        out[name] = (float(np.mean(errors)), optimum)
    conn.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("/work/shared/datasets/pums"))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 10.0])
    parser.add_argument(
        "--bias",
        choices=["on", "off", "both"],
        default="on",
        help="bias_estimate: the default (on), off, or both",
    )
    args = parser.parse_args(argv)
    csv = args.data / "PUMS_pid.csv"
    start = time.time()
    load = os.getloadavg()[0]
    print(f"# {ROOT}  reps {args.reps}  load {load:.1f}")
    print("| ε | bias_estimate | query | error | discrete optimum (count's ε) |")
    print("|---|---|---|---:|---:|")
    for eps in args.epsilons:
        for bias in {"on": (True,), "off": (False,), "both": (True, False)}[args.bias]:
            for name, (err, optimum) in run(csv, eps, args.reps, bias).items():
                opt = "" if optimum is None else f"{optimum:.3f}"
                label = "on" if bias else "off"
                value = f"{100 * err:.2f}%" if "AVG" in name else f"{err:.3f}"
                print(f"| {eps:g} | {label} | {name} | {value} | {opt} |", flush=True)
    print(f"# {time.time() - start:.0f} s, load {load:.1f} -> {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
