"""Throughput and latency of ``dpsql serve`` over many connections, and a budget soak.

Side by side in one run, on the same policy and data (a fresh copy, answer cache off):

1. ``direct``: the DB-API in this process, N threads, one connection each (the pipeline's
   ceiling on this machine);
2. ``server``: the same DP queries through the wire protocol, N connections to a
   ``dpsql serve`` subprocess, with the ratio server/direct;
3. ``protocol``: a statement that costs the pipeline almost nothing (SHOW epsilon), to show
   the front door's own ceiling;
4. ``soak``: many mixed queries (DP aggregates, refusals, catalog, SET/SHOW) over N connections,
   then the ledger total is compared with the sum of the charges the server reported to
   clients (NOTICE "charged epsilon=..."). Epsilons are dyadic, so the comparison is exact.

    python bench/bench_server.py --connections 16 --seconds 10 --soak 10000
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dpsql
from dpsql.policy import load_policy
from dpsql.privacy.sqlite_ledger import SQLiteLedger
from dpsql.server.testing import RawClient
from dpsql.server.users import UserStore, users_path

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "bench-password"
EPSILON = 2.0**-14  # dyadic: sums of charges are exact in any order

DP_QUERIES = [
    "SELECT COUNT(*) FROM visits WHERE age > {i}",
    "SELECT department, COUNT(*) FROM visits WHERE age >= {i} GROUP BY department",
    "SELECT AVG(cost) FROM visits WHERE age < {j}",
    "SELECT SUM(age) FROM visits WHERE smoker AND age > {i}",
]
MIXED_EXTRA = [
    "SELECT * FROM visits WHERE age = {i}",  # refused, free
    "SELECT relname FROM pg_catalog.pg_class WHERE relname = 'visits'",  # catalog, free
    "SHOW epsilon",
]
_CHARGED = re.compile(r"charged epsilon=([0-9.e+-]+) delta=([0-9.e+-]+) rho=([0-9.e+-]+)")


def _query(k: int, mixed: bool) -> str:
    pool = DP_QUERIES + MIXED_EXTRA if mixed else DP_QUERIES
    return pool[k % len(pool)].format(i=k % 90, j=10 + k % 90)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _report(name: str, count: int, elapsed: float, latencies: list[float]) -> float:
    rate = count / elapsed
    print(
        f"{name:<9} {count:>7} queries in {elapsed:6.1f} s = {rate:8.1f} q/s   "
        f"p50 {1000 * statistics.median(latencies):7.1f} ms   "
        f"p99 {1000 * _percentile(latencies, 0.99):7.1f} ms"
    )
    return rate


def _timed_threads(n: int, seconds: float, worker: Callable[[int, float], list[float]]):
    deadline = time.perf_counter() + seconds
    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda i: worker(i, deadline), range(n)))
    elapsed = time.perf_counter() - start
    latencies = [x for r in results for x in r]
    return len(latencies), elapsed, latencies


def run_direct(policy: Path, connections: int, seconds: float) -> float:
    service = dpsql.Service(policy, cache=False)

    def worker(i: int, deadline: float) -> list[float]:
        cur = service.connect(analyst=f"direct{i}").cursor()
        cur.execute(f"SET epsilon = {EPSILON}")
        out, k = [], i
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            cur.execute(_query(k, False))
            cur.fetchall()
            out.append(time.perf_counter() - t0)
            k += 1
        return out

    try:
        return _report("direct", *_timed_threads(connections, seconds, worker))
    finally:
        service.close()


def _client(port: int, user: str) -> RawClient:
    c = RawClient("127.0.0.1", port, timeout=120)
    reply = c.login(user, PASSWORD)
    if reply.status != "I":
        raise SystemExit(f"login failed: {reply.errors()}")
    c.query(f"SET epsilon = {EPSILON}")
    return c


def run_server(port: int, connections: int, seconds: float, statement: str | None) -> float:
    def worker(i: int, deadline: float) -> list[float]:
        c = _client(port, f"bench{i}")
        out, k = [], i
        try:
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                reply = c.query(statement or _query(k, False))
                out.append(time.perf_counter() - t0)
                if reply.errors():
                    raise SystemExit(f"query failed: {reply.errors()[0]}")
                k += 1
        finally:
            c.close()
        return out

    name = "protocol" if statement else "server"
    return _report(name, *_timed_threads(connections, seconds, worker))


def run_soak(port: int, connections: int, total: int, ledger_path: Path, dataset: str) -> bool:
    charged: list[tuple[float, float, float]] = []
    lock = threading.Lock()
    counter = iter(range(total))

    def worker(i: int) -> int:
        c = _client(port, "soak")
        done = 0
        try:
            while True:
                with lock:
                    k = next(counter, None)
                if k is None:
                    return done
                reply = c.query(_query(k, True))
                for notice in reply.notices():
                    m = _CHARGED.search(notice.get("M", ""))
                    if m:
                        with lock:
                            charged.append(tuple(float(x) for x in m.groups()))  # type: ignore[arg-type]
                done += 1
        finally:
            c.close()

    start = time.perf_counter()
    with ThreadPoolExecutor(connections) as pool:
        done = sum(pool.map(worker, range(connections)))
    elapsed = time.perf_counter() - start
    spent = SQLiteLedger(ledger_path).spent("soak", dataset)
    eps = sum(c[0] for c in charged)
    delta = sum(c[1] for c in charged)
    rho = sum(c[2] for c in charged)
    ok = spent.epsilon == eps and spent.delta == delta and spent.rho == rho
    print(
        f"soak      {done:>7} mixed queries in {elapsed:6.1f} s = {done / elapsed:8.1f} q/s; "
        f"{len(charged)} charged; reported epsilon {eps!r}, ledger {spent.epsilon!r} -> "
        f"{'EQUAL' if ok else 'MISMATCH'}"
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default=str(ROOT / "fixtures" / "visits.toml"))
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--soak", type=int, default=10_000, help="mixed queries (0: skip)")
    parser.add_argument("--skip-direct", action="store_true")
    parser.add_argument("--rounds", type=int, default=2, help="alternating direct/server rounds")
    args = parser.parse_args()

    src = Path(args.policy).resolve()
    with tempfile.TemporaryDirectory(prefix="dpsql-bench-") as tmp:
        policy = Path(tmp) / src.name
        shutil.copy(src, policy)
        for table in load_policy(src).tables.values():
            if table.source_path is not None:
                shutil.copy(table.source_path, Path(tmp) / table.source_path.name)
        loaded = load_policy(policy)
        users = UserStore(users_path(policy))
        for name in ["soak"] + [f"bench{i}" for i in range(args.connections)]:
            users.add(name, PASSWORD)

        print(f"policy {src.name}, {args.connections} connections, answer cache off")
        proc = subprocess.Popen(
            [sys.executable, "-m", "dpsql", "serve", "--policy", str(policy), "--port", "0",
             "--no-cache"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
        )  # fmt: skip
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            m = re.search(r":(\d+)\s*$", line)
            if not m:
                raise SystemExit(f"server did not start: {line!r}")
            port = int(m.group(1))
            # Alternate the two so that load from other jobs on the machine hits both alike.
            ratios = []
            for _ in range(args.rounds):
                direct = (
                    0.0 if args.skip_direct else run_direct(policy, args.connections, args.seconds)
                )
                server = run_server(port, args.connections, args.seconds, None)
                if direct:
                    ratios.append(server / direct)
                    print(f"ratio     server/direct = {ratios[-1]:.2f}")
            if len(ratios) > 1:
                median = statistics.median(ratios)
                print(f"ratio     median over {len(ratios)} rounds = {median:.2f}")
            run_server(port, args.connections, min(args.seconds, 5.0), "SHOW epsilon")
            ok = True
            if args.soak:
                assert loaded.ledger_path is not None
                ok = run_soak(port, args.connections, args.soak, loaded.ledger_path,
                              loaded.dataset)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(30)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
