"""Issue 28 item 3: one unit table's in-memory store, in a fresh process — its build's CPU
and wall time, the store's size and the process's peak RSS after connect, after the build
and after one query with and without a WHERE (bench_fast's data, policy and queries).

    python bench/bench_fast.py --rows 100000000 --memory   # makes the data (and plain's peak)
    /usr/bin/time -v python bench/bench_store_memory.py --rows 100000000
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_fast  # noqa: E402

from dpsql.pipeline import Service, Settings  # noqa: E402
from dpsql.privacy.ledger import MemoryLedger  # noqa: E402


def rss(tag: str) -> None:
    now = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{tag}: peak RSS {peak:.0f} MiB, now {now / 2**20:.0f} MiB", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--data-dir", type=Path, default=ROOT / "bench" / "data")
    args = ap.parse_args()
    db = args.data_dir / f"fast_{args.rows}.duckdb"
    bench_fast.generate(db, args.rows)
    policy = bench_fast.policy()
    del policy["tables"]["tr"]  # one store
    print(f"{args.rows:,} rows; load {' '.join(map(str, os.getloadavg()))}")
    rss("start")
    svc = Service(policy, str(db), ledger=MemoryLedger(), cache=False)
    rss("connected")
    cpu, wall = time.process_time(), time.perf_counter()
    svc.engine.wait_for_stores()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    rss(f"store ready ({cpu:.1f} s CPU, {cpu / args.rows * 1e6:.2f} µs a row; {wall:.1f} s wall)")
    store = svc.engine.columns["tu"]
    labels = sum(v.nbytes for v in (store.label_values or {}).values())
    codes = store.codes.nbytes if store.codes is not None else 0
    print(f"store: codes {codes / 2**20:.0f} MiB, distinct values {labels / 2**20:.0f} MiB")
    settings = Settings.from_policy(svc.policy)
    svc.execute(bench_fast.Q.format(t="tu", k=1), None, settings, "a")
    rss("query with a WHERE")
    svc.execute(bench_fast.Q0.format(t="tu"), None, settings, "a")
    rss("query without")
    svc.close()
    print(f"load {' '.join(map(str, os.getloadavg()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
