"""Throughput and latency of ``dpsql serve`` over many connections, and a budget soak.

Side by side in one run, on the same policy and data (a fresh copy, answer cache off):

0. ``engine``: the compiled engine SQL of the same DP queries (each with its own secret),
   run straight on the sealed DuckDB connection from N threads, with no Python pipeline at
   all: the ceiling of any front door on this machine for this plan and data;
1. ``direct``: the DB-API in this process, N threads, one connection each (the pipeline's
   ceiling on this machine);
2. ``server``: the same DP queries through the wire protocol, N connections to a
   ``dpsql serve`` subprocess, with the ratio server/direct;
3. ``protocol``: a statement that costs the pipeline almost nothing (SHOW epsilon), to show
   the front door's own ceiling;
4. ``soak``: many mixed queries (DP aggregates, refusals, catalog, SET/SHOW) over N connections,
   then the ledger total is compared with the sum of the charges the server reported to
   clients (NOTICE "charged epsilon=..."). Epsilons are dyadic, so the comparison is exact.

With ``--workers 2`` (or ``2,3``) a ``dpsql serve --workers N`` server runs next to the
single-process one (``--workers 1``), in alternating rounds, and each gets its own soak analyst,
so every ledger check is exact per server.

    python bench/bench_server.py --connections 16 --seconds 10 --soak 10000 --workers 2,3

Each server first runs ``--warmup`` seconds of the same DP queries (a line "warm wN", not in
the rounds): the figures are a running server's, whose analysts' text shapes are learned.
Every DP query of the rounds is charged (the answer cache is off): none is a cache replay.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
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
from dpsql.dbapi import connect_service
from dpsql.frontend.bind import parse_statement
from dpsql.lower.compile import compile_plan
from dpsql.pipeline import Settings
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


#: Each round's CPU ms a query by its name (bench_server_ab.py summarises them).
CPU_MS: dict[str, list[float]] = {}


def _report(
    name: str, count: int, elapsed: float, latencies: list[float], cpu: float | None = None
) -> float:
    rate = count / elapsed
    if cpu and count:
        CPU_MS.setdefault(name, []).append(1000 * cpu / count)
    # CPU per query depends much less on other jobs than q/s does: it shows whether N workers
    # do more work per query, and "cores" how much of the machine the server got.
    usage = f"   cpu {1000 * cpu / count:5.2f} ms/q {cpu / elapsed:4.2f} cores" if cpu else ""
    print(
        f"{name:<9} {count:>7} queries in {elapsed:6.1f} s = {rate:8.1f} q/s   "
        f"p50 {1000 * statistics.median(latencies):7.1f} ms   "
        f"p99 {1000 * _percentile(latencies, 0.99):7.1f} ms{usage}"
    )
    return rate


def _stat(pid: str) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a server process and its children (the workers); Linux."""
    ticks = 0
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        fields = _stat(entry.name) if entry.name.isdigit() else None
        if fields is not None and str(pid) in (entry.name, fields[1]):
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


# One connection's session: a function running query number k, and one closing it.
Session = tuple[Callable[[int], None], Callable[[], None]]


def _timed_threads(n: int, seconds: float, open_session: Callable[[int], Session]):
    """N threads, each opening its session and running queries k = i, i + 1, ... back to back
    until the deadline; returns (queries, elapsed seconds, per-query latencies)."""
    deadline = time.perf_counter() + seconds

    def worker(i: int) -> list[float]:
        run, close = open_session(i)
        out, k = [], i
        try:
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                run(k)
                out.append(time.perf_counter() - t0)
                k += 1
        finally:
            close()
        return out

    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(worker, range(n)))
    elapsed = time.perf_counter() - start
    latencies = [x for r in results for x in r]
    return len(latencies), elapsed, latencies


def run_direct(policy: Path, connections: int, seconds: float) -> float:
    service = dpsql.Service(policy, cache=False)

    def open_session(i: int) -> Session:
        cur = connect_service(service, f"direct{i}").cursor()
        cur.execute(f"SET epsilon = {EPSILON}")
        return (lambda k: cur.execute(_query(k, False)).fetchall()), cur.close

    try:
        cpu = time.process_time()
        result = _timed_threads(connections, seconds, open_session)
        return _report("direct", *result, time.process_time() - cpu)
    finally:
        service.close()


def run_engine(policy: Path, connections: int, seconds: float) -> float:
    """The compiled SQL alone, through the engine's own run path (a fresh cursor per query, as
    in the pipeline): no bind, noise, ledger, post-processing or protocol."""
    service = dpsql.Service(policy, cache=False)
    settings = Settings.from_policy(service.policy)
    texts = []
    for k in range(4 * 90):
        plan = service.plan(parse_statement(_query(k, False), service.policy), settings)
        texts.append(compile_plan(plan, secrets.randbits(62)).render("duckdb"))

    def open_session(i: int) -> Session:
        def run(k: int) -> None:
            service.engine._run(texts[k % len(texts)], None, lambda cur: cur.fetchall())

        return run, lambda: None

    try:
        cpu = time.process_time()
        result = _timed_threads(connections, seconds, open_session)
        return _report("engine", *result, time.process_time() - cpu)
    finally:
        service.close()


def _client(port: int, user: str) -> RawClient:
    c = RawClient("127.0.0.1", port, timeout=120)
    reply = c.login(user, PASSWORD)
    if reply.status != "I":
        raise SystemExit(f"login failed: {reply.errors()}")
    c.query(f"SET epsilon = {EPSILON}")
    return c


def run_server(
    server: tuple[subprocess.Popen[str], int],
    connections: int,
    seconds: float,
    statement: str | None,
    name: str,
) -> float:
    proc, port = server

    def open_session(i: int) -> Session:
        c = _client(port, f"bench{i}")

        def run(k: int) -> None:
            reply = c.query(statement or _query(k, False))
            if reply.errors():
                raise SystemExit(f"query failed: {reply.errors()[0]}")

        return run, c.close

    cpu = _tree_cpu(proc.pid)
    result = _timed_threads(connections, seconds, open_session)
    return _report(name, *result, _tree_cpu(proc.pid) - cpu)


def run_soak(
    port: int, connections: int, total: int, ledger_path: Path, dataset: str, analyst: str = "soak"
) -> bool:
    charged: list[tuple[float, float, float]] = []
    lock = threading.Lock()
    counter = iter(range(total))

    def worker(i: int) -> int:
        c = _client(port, analyst)
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
    ledger = SQLiteLedger(ledger_path)
    spent = ledger.spent(analyst, dataset)
    problems = ledger.verify()
    ledger.close()
    eps = sum(c[0] for c in charged)
    delta = sum(c[1] for c in charged)
    rho = sum(c[2] for c in charged)
    ok = spent.epsilon == eps and spent.delta == delta and spent.rho == rho and not problems
    name = "soak" if analyst == "soak" else analyst.replace("soak_", "soak ")
    print(
        f"{name:<9} {done:>7} mixed queries in {elapsed:6.1f} s = {done / elapsed:8.1f} q/s; "
        f"{len(charged)} charged; reported epsilon {eps!r}, ledger {spent.epsilon!r} -> "
        f"{'EQUAL' if ok else 'MISMATCH'}{'; ledger.verify: ' + str(problems) if problems else ''}"
    )
    return ok


def start_server(policy: Path, workers: int) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpsql", "serve", "--policy", str(policy), "--port", "0",
         "--no-cache", "--workers", str(workers)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
    )  # fmt: skip
    line = proc.stdout.readline() if proc.stdout else ""
    m = re.search(r":(\d+)\s*$", line)
    if not m:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, int(m.group(1))


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default=str(ROOT / "fixtures" / "visits.toml"))
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--soak", type=int, default=10_000, help="mixed queries (0: skip)")
    parser.add_argument("--skip-direct", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument(
        "--engine-threads", type=int, default=None, help="[engine] threads = N in the policy"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating direct/server rounds")
    parser.add_argument(
        "--warmup",
        type=float,
        default=5.0,
        help="seconds of the DP queries on each server before the rounds (0: none), printed "
        "apart: each analyst's first texts of a shape are parsed, bound and verified before its "
        "text shapes serve the rest (dpsql.service.text_shapes), and a worker's first queries "
        "load its compiled kernels",
    )
    parser.add_argument(
        "--workers",
        default="1",
        help="worker counts to compare with the single-process server, e.g. 2 or 2,3",
    )
    args = parser.parse_args()
    counts = sorted({1, *(int(x) for x in args.workers.split(","))})

    src = Path(args.policy).resolve()
    with tempfile.TemporaryDirectory(prefix="dpsql-bench-") as tmp:
        policy = Path(tmp) / src.name
        shutil.copy(src, policy)
        if args.engine_threads is not None:  # the copied policy gets [engine] threads = N
            with policy.open("a") as fh:
                fh.write(f"\n[engine]\nthreads = {args.engine_threads}\n")
        for table in load_policy(src).tables.values():
            if table.source_path is not None:
                shutil.copy(table.source_path, Path(tmp) / table.source_path.name)
        loaded = load_policy(policy)
        users = UserStore(users_path(policy))
        soakers = {n: "soak" if counts == [1] else f"soak_w{n}" for n in counts}
        for name in [*soakers.values()] + [f"bench{i}" for i in range(args.connections)]:
            users.add(name, PASSWORD)

        print(
            f"policy {src.name} (engine threads {args.engine_threads or 'default'}), "
            f"{args.connections} connections, answer cache off, {_load()}"
        )
        servers: dict[int, tuple[subprocess.Popen[str], int]] = {}
        try:
            for n in counts:
                servers[n] = start_server(policy, n)
            for n, server in servers.items():  # steady state: not counted in the rounds
                if args.warmup > 0:
                    run_server(server, args.connections, args.warmup, None, f"warm w{n}")
            # Alternate them so that load from other jobs on the machine hits all alike.
            ratios: dict[int, list[float]] = {n: [] for n in counts}
            scaling: dict[int, list[float]] = {n: [] for n in counts if n > 1}
            for _ in range(args.rounds):
                if not args.skip_engine:
                    run_engine(policy, args.connections, args.seconds)
                direct = (
                    0.0 if args.skip_direct else run_direct(policy, args.connections, args.seconds)
                )
                rates = {}
                for n, server in servers.items():
                    name = "server" if counts == [1] else f"server w{n}"
                    rates[n] = run_server(server, args.connections, args.seconds, None, name)
                    if direct:
                        ratios[n].append(rates[n] / direct)
                for n in scaling:
                    scaling[n].append(rates[n] / rates[1])
                line = [f"w{n}/direct = {ratios[n][-1]:.2f}" for n in counts if direct]
                line += [f"w{n}/w1 = {scaling[n][-1]:.2f}" for n in scaling]
                if line:
                    print(f"ratio     {'   '.join(line)}")
            if args.rounds > 1:
                line = [f"w{n}/direct = {statistics.median(v):.2f}" for n, v in ratios.items() if v]
                line += [f"w{n}/w1 = {statistics.median(v):.2f}" for n, v in scaling.items()]
                if line:
                    print(f"ratio     median over {args.rounds} rounds: {'   '.join(line)}")
            for n, server in servers.items():
                name = "protocol" if counts == [1] else f"proto w{n}"
                run_server(server, args.connections, min(args.seconds, 5.0), "SHOW epsilon", name)
            ok = True
            if args.soak:
                assert loaded.ledger_path is not None
                for n, (_proc, port) in servers.items():
                    ok &= run_soak(port, args.connections, args.soak, loaded.ledger_path,
                                   loaded.dataset, soakers[n])  # fmt: skip
            print(_load())
        finally:
            for proc, _port in servers.values():
                proc.terminate()
            for proc, _port in servers.values():
                proc.wait(30)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
