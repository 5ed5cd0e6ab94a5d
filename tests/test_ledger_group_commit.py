"""Group commit of charges (dpsql.privacy.ledger_group_commit): charges queued by several threads
while another batch commits share one transaction and one fsync, and each is exactly as strict
and as durable as a lone charge — checked against the running total including the batch's
earlier charges, refused alone (nothing of it written), returned only after the COMMIT that
holds it, and a batch that fails in SQLite fails every charge in it with nothing written. The
batches are made deterministic by holding the ledger's write lock while the threads queue.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dpsql.errors import BudgetExhaustedError, InterfaceError, LedgerUnavailableError
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.sqlite_ledger import SQLiteLedger

DEFAULT = Budget(1.0, 1e-5)
QUARTER = Cost(0.25, 0, 0)


def _batched(
    ledger: SQLiteLedger, charges: list[Callable[[], None]]
) -> tuple[list[BaseException | None], list[int]]:
    """Run ``charges`` from one thread each while the write lock is held, so that the first
    leads a batch of itself and the rest queue for the next batch; returns each charge's
    outcome (None: charged) and the sizes of the batches committed."""
    sizes: list[int] = []
    group = ledger._group_commit
    commit = group._commit_batch

    def counting(batch: list[Any]) -> None:
        sizes.append(len(batch))
        commit(batch)

    group._commit_batch = counting  # type: ignore[method-assign]
    outcomes: list[BaseException | None] = [None] * len(charges)

    def run(i: int) -> None:
        try:
            charges[i]()
        except BaseException as exc:  # the outcome under test
            outcomes[i] = exc

    ledger._write_lock.acquire()
    first = threading.Thread(target=run, args=(0,))
    first.start()
    while not group._leading or group._queue:  # the leader took its batch of one
        time.sleep(0.001)
    rest = [threading.Thread(target=run, args=(i,)) for i in range(1, len(charges))]
    for queued, t in enumerate(rest, 1):
        t.start()
        while len(group._queue) < queued:  # queued behind the leader, in order
            time.sleep(0.001)
    ledger._write_lock.release()
    for t in [first, *rest]:
        t.join(30)
    return outcomes, sizes


def _charge(ledger: SQLiteLedger, analyst: str = "a", cost: Cost = QUARTER) -> Callable[[], None]:
    return lambda: ledger.charge(analyst, "d", cost, DEFAULT, query_text="q", plan_hash="h")


def test_a_batch_checks_each_charge_against_the_ones_before_it(tmp_path: Path) -> None:
    ledger = SQLiteLedger(tmp_path / "l.sqlite")
    outcomes, sizes = _batched(ledger, [_charge(ledger) for _ in range(6)])
    assert sizes == [1, 5]
    charged = [o for o in outcomes if o is None]
    refused = [o for o in outcomes if o is not None]
    assert len(charged) == 4 and len(refused) == 2
    assert all(isinstance(o, BudgetExhaustedError) for o in refused)
    assert ledger.spent("a", "d") == Cost(1.0, 0, 0)
    assert ledger.verify() == []
    assert len(ledger.entries("d", analyst="a")) == 4  # nothing of a refused charge was written


def test_one_charge_failing_alone_leaves_the_others_charged(tmp_path: Path) -> None:
    """The third charge fails after writing its log row and total (its own failure, not
    SQLite's): undone to its savepoint, raised to it alone; the batch's others commit."""
    written = []

    def fault(stage: str) -> None:
        if stage == "written":
            written.append(stage)
            if len(written) == 3:  # the second charge of the second batch
                raise RuntimeError("this charge's own failure")

    ledger = SQLiteLedger(tmp_path / "l.sqlite", fault_hook=fault)
    outcomes, sizes = _batched(ledger, [_charge(ledger, f"a{i}") for i in range(4)])
    assert sizes == [1, 3]
    assert outcomes[0] is None and outcomes[1] is None and outcomes[3] is None
    assert isinstance(outcomes[2], RuntimeError)
    assert [ledger.spent(f"a{i}", "d") for i in range(4)] == [QUARTER, QUARTER, Cost(), QUARTER]
    assert len(ledger.entries("d", analyst="a2")) == 0
    assert ledger.verify() == []


def test_an_invalid_key_is_refused_alone(tmp_path: Path) -> None:
    ledger = SQLiteLedger(tmp_path / "l.sqlite")
    charges = [_charge(ledger), _charge(ledger, "b"), _charge(ledger, "bad\ud800"), _charge(ledger)]
    outcomes, sizes = _batched(ledger, charges)
    assert sizes == [1, 3]
    assert outcomes[0] is None and outcomes[1] is None and outcomes[3] is None
    assert isinstance(outcomes[2], InterfaceError)
    assert ledger.spent("a", "d") == Cost(0.5, 0, 0)
    assert ledger.verify() == []


def test_an_sqlite_failure_fails_the_whole_batch_and_writes_nothing(tmp_path: Path) -> None:
    calls = []

    def fault(stage: str) -> None:
        calls.append(stage)
        if stage == "logged" and len(calls) == 5:  # the second charge of the second batch
            raise sqlite3.OperationalError("disk I/O error")

    ledger = SQLiteLedger(tmp_path / "l.sqlite", fault_hook=fault)
    outcomes, sizes = _batched(ledger, [_charge(ledger, f"a{i}") for i in range(4)])
    assert sizes == [1, 3]
    assert outcomes[0] is None
    assert all(isinstance(o, LedgerUnavailableError) for o in outcomes[1:])
    assert "nothing was charged" in str(outcomes[1])
    assert ledger.spent("a0", "d") == QUARTER
    for i in (1, 2, 3):
        assert ledger.spent(f"a{i}", "d") == Cost()
    assert ledger.verify() == []


@pytest.mark.parametrize("threads", [8])
def test_many_threads_spend_exactly_the_budget(tmp_path: Path, threads: int) -> None:
    """Free-running threads (batches of whatever size the scheduling makes): the last ε is
    never given twice and the total equals the log."""
    ledger = SQLiteLedger(tmp_path / "l.sqlite")
    ok = []
    lock = threading.Lock()

    def run() -> None:
        for _ in range(3):
            try:
                ledger.charge("a", "d", Cost(0.125, 0, 0), DEFAULT, query_text="q", plan_hash="h")
            except BudgetExhaustedError:
                continue
            with lock:
                ok.append(1)

    pool = [threading.Thread(target=run) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)
    assert len(ok) == 8  # 24 tries, 8 fit
    assert ledger.spent("a", "d") == Cost(1.0, 0, 0)
    assert ledger.verify() == []
