"""The ledger under contention and under SIGKILL.

Concurrency: 16 threads and 4 processes race for one budget in one ledger file; the total
charged must equal the sum of the charges the callers were told succeeded, and never exceed
the budget. Crash: a process killed inside an open charge transaction leaves nothing behind;
one killed after COMMIT keeps both the charge and its cached answer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from dpsql.errors import BudgetExhaustedError
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.sqlite_ledger import SQLiteLedger

# 2**-7 is exact in binary floating point, so 64 charges sum to exactly 0.5: the budget is
# exhausted after exactly 64 successes and every comparison below can be exact.
STEP = Cost(epsilon=2.0**-7)
BUDGET = Budget(epsilon=0.5, delta=0.0)
CAPACITY = 64
THREADS, PROCESSES, ATTEMPTS = 16, 4, 8  # 160 attempts for 64 slots
SPAWN = mp.get_context("spawn")


def _attempts(ledger: SQLiteLedger, who: str, start) -> int:
    """Try ATTEMPTS charges; return how many the ledger accepted."""
    start.wait(60)
    accepted = 0
    for i in range(ATTEMPTS):
        try:
            ledger.charge(
                "alice", "ds", STEP, BUDGET, query_text=f"{who} #{i}", plan_hash=who,
                cache_key=f"{who}/{i}", answer=f"[{i}]",
            )  # fmt: skip
        except BudgetExhaustedError:
            continue
        accepted += 1
    return accepted


def _process_worker(path: str, who: str, ready, start, results) -> None:
    ledger = SQLiteLedger(path)
    ready.put(who)
    results.put((who, _attempts(ledger, who, start)))
    ledger.close()


def _log_sums(path: Path) -> tuple[int, float, int]:
    conn = sqlite3.connect(path)
    try:
        n, eps = conn.execute(
            "SELECT COUNT(*), TOTAL(epsilon) FROM charge_log WHERE kind = 'charge'"
        ).fetchone()
        (answers,) = conn.execute("SELECT COUNT(*) FROM answers").fetchone()
    finally:
        conn.close()
    return n, eps, answers


def test_threads_and_processes_never_overspend(tmp_path: Path) -> None:
    path = tmp_path / "shared.ledger.sqlite"
    ready, results, start = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Event()
    procs = [
        SPAWN.Process(target=_process_worker, args=(str(path), f"p{k}", ready, start, results))
        for k in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    # Opened while the processes may be creating the file too: schema creation must be safe.
    ledger = SQLiteLedger(path)  # one instance shared by all threads: a connection per thread
    accepted: dict[str, int] = {}
    lock = threading.Lock()

    def thread_worker(who: str) -> None:
        n = _attempts(ledger, who, start)
        with lock:
            accepted[who] = n

    threads = [threading.Thread(target=thread_worker, args=(f"t{k}",)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for _ in procs:
        ready.get(timeout=60)  # every process has opened the ledger: release them all at once
    start.set()
    for t in threads:
        t.join(60)
    for _ in procs:
        who, n = results.get(timeout=60)
        accepted[who] = n
    for p in procs:
        p.join(60)
        assert p.exitcode == 0

    reported = sum(accepted.values())
    assert len(accepted) == THREADS + PROCESSES
    assert reported == CAPACITY  # more attempts than slots: the budget is used up exactly
    spent = ledger.spent("alice", "ds")
    assert spent == Cost(epsilon=reported * STEP.epsilon)  # exact: see STEP
    assert BUDGET.covers(spent)
    assert _log_sums(path) == (reported, spent.epsilon, reported)
    assert ledger.status("alice", "ds", BUDGET).charges == reported
    assert ledger.verify() == []
    ledger.close()


# -- crash tests ----------------------------------------------------------------------------

PRIOR = Cost(epsilon=0.125)
DOOMED = Cost(epsilon=0.25, rho=0.001)
# Charges that mix kinds share the zCDP filter (delta > 0): PRIOR + DOOMED is zrho 0.040,
# inside the cap of (2, 1e-7) (about 0.078).
MIXED = Budget(2.0, 1e-6)


def _charge_then_hang(path: str, stage: str | None, ready) -> None:
    """Charge DOOMED; hang at ``stage`` inside the transaction (None: after COMMIT)."""

    def hang(at: str) -> None:
        if at == stage:
            ready.set()
            time.sleep(120)

    ledger = SQLiteLedger(path, fault_hook=hang)
    ledger.charge(
        "alice", "ds", DOOMED, MIXED, query_text="doomed", plan_hash="h",
        cache_key="doomed-key", answer="[42]",
    )  # fmt: skip
    ready.set()
    time.sleep(120)


def _kill_while(path: Path, stage: str | None) -> None:
    ready = SPAWN.Event()
    child = SPAWN.Process(target=_charge_then_hang, args=(str(path), stage, ready))
    child.start()
    try:
        assert ready.wait(60), "the child never reached the hook"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.join(60)
    assert child.exitcode == -signal.SIGKILL


def _prepared(tmp_path: Path) -> Path:
    path = tmp_path / "crash.ledger.sqlite"
    with SQLiteLedger(path) as led:
        led.charge(
            "alice",
            "ds",
            PRIOR,
            MIXED,
            query_text="prior",
            plan_hash="p",
        )
    return path


@pytest.mark.parametrize("stage", ["logged", "written"])
def test_sigkill_inside_the_charge_transaction_charges_nothing(tmp_path: Path, stage) -> None:
    path = _prepared(tmp_path)
    _kill_while(path, stage)
    with SQLiteLedger(path, timeout=10) as led:
        assert led.verify() == []
        assert led.spent("alice", "ds") == PRIOR
        assert [e.query_text for e in led.entries()] == ["prior"]  # no half-written row
        assert led.cached("alice", "ds", "doomed-key") is None
        # The dead process's lock is gone: the ledger takes new charges at once.
        led.charge(
            "alice",
            "ds",
            DOOMED,
            MIXED,
            query_text="after",
            plan_hash="h",
        )
        assert led.spent("alice", "ds") == PRIOR + DOOMED
        assert led.verify() == []


def test_sigkill_after_commit_keeps_the_charge_and_the_answer(tmp_path: Path) -> None:
    path = _prepared(tmp_path)
    _kill_while(path, None)
    with SQLiteLedger(path, timeout=10) as led:
        assert led.verify() == []
        assert led.spent("alice", "ds") == PRIOR + DOOMED
        assert [e.query_text for e in led.entries()] == ["prior", "doomed"]
        # The answer was paid for: the same query gets it again, for free.
        assert led.cached("alice", "ds", "doomed-key") == "[42]"


def test_readers_are_not_blocked_by_a_hanging_charge(tmp_path: Path) -> None:
    path = _prepared(tmp_path)
    ready = SPAWN.Event()
    child = SPAWN.Process(target=_charge_then_hang, args=(str(path), "written", ready))
    child.start()
    try:
        assert ready.wait(60)
        with SQLiteLedger(path, timeout=10) as led:
            assert led.spent("alice", "ds") == PRIOR  # the uncommitted charge is invisible
            assert len(led.analysts("ds", MIXED)) == 1
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(60)
