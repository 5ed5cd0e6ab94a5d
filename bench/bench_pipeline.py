"""Where one DP query's CPU goes: the engine (DuckDB) and the Python pipeline around it.

One thread, the DB-API on the shipped fixture (20k rows, privacy unit patient_id), answer cache
off, the four DP templates of bench/bench_server.py. For each template: process CPU per query,
split into the engine's part (CPU while the compiled SQL runs, DuckDB's threads included) and
the pipeline's part (bind, plan, noise, ledger, post-processing: the rest). Two modes, side by
side: ``repeat`` (texts seen before: the plan cache hits) and ``distinct`` (every text new).

    python bench/bench_pipeline.py --n 200
    python bench/bench_pipeline.py --n 200 --engine-threads 1   # [engine] threads = 1
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dpsql
from dpsql.privacy.ledger import MemoryLedger

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = [
    "SELECT COUNT(*) FROM visits WHERE age > {i}",
    "SELECT department, COUNT(*) FROM visits WHERE age >= {i} GROUP BY department",
    "SELECT AVG(cost) FROM visits WHERE age < {j}",
    "SELECT SUM(age) FROM visits WHERE smoker AND age > {i}",
]


def _policy(engine_threads: int | None) -> Any:
    import tomllib

    policy = tomllib.loads((ROOT / "fixtures" / "visits.toml").read_text())
    policy["tables"]["visits"]["source"] = str(ROOT / "fixtures" / "visits.csv")
    policy["privacy"]["budget_epsilon"] = 1e9
    if engine_threads is not None:
        policy["engine"] = {"threads": engine_threads}
    return policy


def measure(n: int, engine_threads: int | None) -> dict[tuple[str, int], tuple[float, float]]:
    conn = dpsql.connect(policy=_policy(engine_threads), ledger=MemoryLedger(), cache=False)
    engine = conn.service.engine
    real_execute = engine.execute
    engine_cpu = [0.0]

    def timed_execute(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return real_execute(*args, **kwargs)
        finally:
            engine_cpu[0] += time.process_time() - start

    engine.execute = timed_execute  # type: ignore[method-assign]
    cur = conn.cursor()
    cur.execute("SET epsilon = 0.001")
    fresh = itertools.count(1)
    out = {}
    for mode in ("repeat", "distinct"):
        for t, template in enumerate(TEMPLATES):
            # The literals of bench_server.py (i in 0..89), so selectivities match; "distinct"
            # adds a unique fraction (age > 45.000123), which keeps them.
            if mode == "repeat":
                texts = [template.format(i=k % 90, j=10 + k % 90) for k in range(n)]
                for text in set(texts):  # warm the plan cache
                    cur.execute(text).fetchall()
            else:
                texts = []
                for k in range(n):
                    u = next(fresh) * 1e-9
                    texts.append(template.format(i=k % 90 + u, j=10 + k % 90 + u))
            engine_cpu[0] = 0.0
            start = time.process_time()
            for text in texts:
                cur.execute(text).fetchall()
            total = (time.process_time() - start) / n * 1e3
            eng = engine_cpu[0] / n * 1e3
            out[(mode, t)] = (total, eng)
    conn.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="queries per template and mode")
    ap.add_argument("--engine-threads", type=int, default=None, help="[engine] threads")
    args = ap.parse_args()
    print(
        f"dpsql pipeline bench: fixture, {args.n} queries per template and mode, "
        f"engine threads {args.engine_threads or 'default'}, load {os.getloadavg()[0]:.1f}"
    )
    out = measure(args.n, args.engine_threads)
    for mode in ("repeat", "distinct"):
        print(f"{mode} texts: CPU ms per query (total = engine + pipeline)")
        rows = []
        for t, template in enumerate(TEMPLATES):
            total, eng = out[(mode, t)]
            rows.append((total, eng))
            print(
                f"  total {total:6.2f}  engine {eng:6.2f}  pipeline {total - eng:6.2f}  "
                f"{template.format(i='i', j='j')}"
            )
        total = statistics.mean(r[0] for r in rows)
        eng = statistics.mean(r[1] for r in rows)
        print(
            f"  mean  {total:6.2f}  engine {eng:6.2f}  pipeline {total - eng:6.2f}  -> at most "
            f"{2000 / total:.0f} q/s on 2 cores, {1000 / max(total - eng, 1e-9):.0f} q/s of "
            "pipeline per GIL"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
