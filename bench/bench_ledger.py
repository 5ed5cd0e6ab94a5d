"""Charges per second of the durable SQLite ledger, side by side with the in-memory one.

Each configuration issues the same number of charges (each one a full BEGIN IMMEDIATE ...
COMMIT with fsync, synchronous=FULL) against a fresh ledger file, and the script prints
charges/second and the ratio to the in-memory ledger measured in the same run.

    python bench/bench_ledger.py --charges 2000 --threads 16 --processes 4
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.sqlite_ledger import SQLiteLedger

BUDGET = Budget(epsilon=1e12, delta=0.5)  # never refuses: we measure the write path
COST = Cost(epsilon=0.01)


LATENCIES: list[float] = []  # seconds per charge, of the configuration being run


class _NoQueue:
    """Stands in for the ledger's per-process writer lock: every writer goes straight to
    SQLite's lock and its busy handler (how the ledger worked before the queue)."""

    def acquire(self, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        pass


def _charge_n(ledger, who: str, n: int) -> None:
    for i in range(n):
        t0 = time.perf_counter()
        ledger.charge(
            f"analyst{hash(who) % 4}", "bench", COST, BUDGET,
            query_text=f"SELECT COUNT(*) FROM t -- {who} {i}", plan_hash="0" * 16,
            cache_key=f"{who}/{i}", answer='[["x", 1234]]',
        )  # fmt: skip
        LATENCIES.append(time.perf_counter() - t0)


def _process_main(path: str, who: str, n: int, start) -> None:
    ledger = SQLiteLedger(path)
    start.wait()
    _charge_n(ledger, who, n)
    ledger.close()


def _threads(ledger, workers: int, total: int) -> float:
    per = total // workers
    threads = [
        threading.Thread(target=_charge_n, args=(ledger, f"t{k}", per)) for k in range(workers)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return per * workers / (time.perf_counter() - t0)


def _processes(path: Path, workers: int, total: int) -> float:
    ctx = mp.get_context("spawn")
    per = total // workers
    start = ctx.Event()
    procs = [
        ctx.Process(target=_process_main, args=(str(path), f"p{k}", per, start))
        for k in range(workers)
    ]
    for p in procs:
        p.start()
    time.sleep(1.5)  # let the interpreters start; only the charging is timed
    t0 = time.perf_counter()
    start.set()
    for p in procs:
        p.join()
    return per * workers / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--charges", type=int, default=2000, help="charges per configuration")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="where to put the ledger files")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        files = iter(Path(tmp) / f"l{k}.sqlite" for k in range(10))

        def fresh() -> SQLiteLedger:
            return SQLiteLedger(next(files))

        def unqueued() -> SQLiteLedger:
            ledger = fresh()
            ledger._write_lock = _NoQueue()  # type: ignore[assignment]
            return ledger

        runs: list[tuple[str, Callable[[], float]]] = [
            ("memory ledger, 1 thread", lambda: _threads(MemoryLedger(), 1, args.charges)),
            ("sqlite ledger, 1 thread", lambda: _threads(fresh(), 1, args.charges)),
            (
                f"sqlite ledger, {args.threads} threads",
                lambda: _threads(fresh(), args.threads, args.charges),
            ),
            (
                f"sqlite, {args.threads} threads, no queue",
                lambda: _threads(unqueued(), args.threads, args.charges),
            ),
            (
                f"sqlite ledger, {args.processes} processes",
                lambda: _processes(next(files), args.processes, args.charges),
            ),
        ]
        results = []
        for name, fn in runs:
            LATENCIES.clear()
            rate = fn()
            lat = sorted(LATENCIES) or [float("nan")]  # processes record in their own memory
            pick = lambda q, lat=lat: 1e3 * lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
            results.append((name, rate, pick(0.5), pick(0.99), 1e3 * lat[-1]))
        base = results[0][1]
        with fresh() as led:
            _charge_n(led, "c", 200)
            t0 = time.perf_counter()
            for _ in range(10):
                for i in range(200):
                    led.cached("analyst0", "bench", f"c/{i}")
            lookups = 2000 / (time.perf_counter() - t0)

    print(f"{args.charges} charges per configuration (synchronous=FULL, WAL)")
    print(
        f"{'configuration':32} {'charges/s':>12} {'vs memory':>10}   latency per charge "
        "(p50 / p99 / max, ms)"
    )
    for name, rate, p50, p99, worst in results:
        latency = f"{p50:6.2f} / {p99:6.2f} / {worst:6.1f}"
        print(f"{name:32} {rate:12,.0f} {rate / base:10.4f}   {latency}")
    print(f"{'sqlite cache lookups, 1 thread':32} {lookups:12,.0f} {lookups / base:10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
