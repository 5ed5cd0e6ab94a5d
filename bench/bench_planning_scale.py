"""Planning time against query size: IN lists of integers and strings, CASE chains.

Each statement is described (parse, bind, type, plan, shape cache: nothing read, nothing
spent) and then executed once on the shipped fixture, in a fresh process per size so no cache
is warm. Planning must grow near-linearly with the text (issue 29: a 100,000-value IN list
planned for 1,059 s)::

    python bench/bench_planning_scale.py                  # 1k, 10k, 100k; int, str, case
    python bench/bench_planning_scale.py --sizes 1000 10000 --kinds int
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def statement(kind: str, n: int) -> str:
    if kind == "int":
        values = ",".join(str(i) for i in range(1, n + 1))
        return f"SELECT COUNT(*) FROM visits WHERE age IN ({values})"
    if kind == "str":
        values = ",".join(f"'d{i}'" for i in range(n))
        return f"SELECT COUNT(*) FROM visits WHERE diagnosis IN ({values})"
    if kind == "case":
        whens = " ".join(f"WHEN age = {i} THEN {i % 7}" for i in range(n))
        return f"SELECT COUNT(*) FROM visits WHERE (CASE {whens} ELSE 0 END) > 3"
    raise ValueError(kind)


def one(kind: str, n: int) -> dict:
    import dpsql

    folder = Path(tempfile.mkdtemp())
    try:
        for name in ("visits.toml", "visits.csv"):
            shutil.copy(ROOT / "fixtures" / name, folder / name)
        policy = folder / "visits.toml"
        # room for the largest statements: 100k CASE branches are 400k terms (default 250k)
        policy.write_text(
            policy.read_text().replace("budget_epsilon = 10.0", "budget_epsilon = 1000.0")
            + "\n[limits]\nmax_expressions = 1000000\nmax_query_bytes = 16777216\n"
        )
        conn = dpsql.connect(policy=str(policy), analyst="bench")
        sql = statement(kind, n)
        t0 = time.perf_counter()
        conn.describe(sql)
        t1 = time.perf_counter()
        conn.cursor().execute(sql).fetchall()
        t2 = time.perf_counter()
        return {
            "kind": kind,
            "n": n,
            "bytes": len(sql),
            "describe_s": t1 - t0,
            "execute_s": t2 - t1,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    ap.add_argument("--kinds", nargs="+", default=["int", "str", "case"])
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per size (default 600)")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]))))
        return
    print(f"load: {os.getloadavg()}")
    for kind in args.kinds:
        for n in args.sizes:
            try:
                out = subprocess.run(
                    [sys.executable, __file__, "--one", kind, str(n)],
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                    check=True,
                )
                r = json.loads(out.stdout.strip().splitlines()[-1])
                print(
                    f"{kind:5} n={n:>7} {r['bytes']:>9} B  describe {r['describe_s']:8.3f} s  "
                    f"execute {r['execute_s']:8.3f} s",
                    flush=True,
                )
            except subprocess.TimeoutExpired:
                print(f"{kind:5} n={n:>7} over {args.timeout:.0f} s", flush=True)
            except subprocess.CalledProcessError as exc:
                print(f"{kind:5} n={n:>7} failed: {exc.stderr.strip().splitlines()[-1:]}")


if __name__ == "__main__":
    main()
