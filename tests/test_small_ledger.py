"""SQLiteLedger.standing (the budget and total read in one statement, used by check and the
DB-API's remaining budget) equals budget() and spent() read apart, in every state of a row."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from dpsql.errors import BudgetExhaustedError
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.sqlite_ledger import SQLiteLedger

DEFAULT = Budget(1.0, 1e-5)


def _apart(ledger, analyst: str) -> tuple[Budget, Cost]:
    return ledger.budget(analyst, "d", DEFAULT), ledger.spent(analyst, "d")


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_standing_equals_budget_and_spent(tmp_path: Path, kind: str) -> None:
    ledger = SQLiteLedger(tmp_path / "l.sqlite") if kind == "sqlite" else MemoryLedger()
    assert ledger.standing("a", "d", DEFAULT) == _apart(ledger, "a") == (DEFAULT, Cost())
    ledger.set_budget("b", "d", Budget(2.0, 1e-6))  # an override without a charge
    assert ledger.standing("b", "d", DEFAULT) == _apart(ledger, "b")
    for analyst in ("a", "b"):
        for cost in (Cost(2.0**-10, 0, 0), Cost(0.0, 1e-7, 2.0**-14), Cost(2.0**-6, 0, 0)):
            ledger.charge(analyst, "d", cost, DEFAULT, query_text="q", plan_hash="h")
            assert ledger.standing(analyst, "d", DEFAULT) == _apart(ledger, analyst)
    assert ledger.standing("a", "other", DEFAULT) == (DEFAULT, Cost())
    with pytest.raises(BudgetExhaustedError):
        ledger.check("a", "d", Cost(5.0, 0, 0), DEFAULT)
    with pytest.raises(BudgetExhaustedError):
        ledger.charge("a", "d", Cost(5.0, 0, 0), DEFAULT, query_text="q", plan_hash="h")
    assert ledger.standing("a", "d", DEFAULT) == _apart(ledger, "a")


def test_standing_recomputes_a_legacy_zcdp_sum_like_spent(tmp_path: Path) -> None:
    """A total whose zCDP sum was not written with its last update (an older process) is read
    from the log, inside a transaction, as spent() reads it."""
    path = tmp_path / "l.sqlite"
    ledger = SQLiteLedger(path)
    for _ in range(3):
        ledger.charge("a", "d", Cost(0.01, 0, 2.0**-9), DEFAULT, query_text="q", plan_hash="h")
    con = sqlite3.connect(path)
    con.execute("UPDATE totals SET zrho_exact = '0', zrho_at = 'older'")
    con.commit()
    con.close()
    got = ledger.standing("a", "d", DEFAULT)
    assert got == _apart(ledger, "a")
    assert got[1].exact_zrho > 0
    ledger.charge("a", "d", Cost(0.01, 0, 0), DEFAULT, query_text="q", plan_hash="h")
    assert ledger.standing("a", "d", DEFAULT) == _apart(ledger, "a")


def test_a_charge_waits_for_another_writer_then_commits(tmp_path: Path) -> None:
    """BEGIN IMMEDIATE is polled (not SQLite's 1-100 ms sleeps): a charge waits while another
    process's writer holds the lock, commits once it is released, and gives up with the
    ledger's own "stayed busy" error after its timeout."""
    import threading

    from dpsql.errors import OperationalError

    path = tmp_path / "l.sqlite"
    ledger = SQLiteLedger(path, timeout=5.0)
    ledger.charge("a", "d", Cost(2.0**-10, 0, 0), DEFAULT, query_text="q", plan_hash="h")
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    released = threading.Event()

    def commit() -> None:
        released.set()
        other.execute("COMMIT")

    release = threading.Timer(0.3, commit)
    release.start()
    ledger.charge("a", "d", Cost(2.0**-10, 0, 0), DEFAULT, query_text="q", plan_hash="h")
    assert released.is_set()  # it could only begin once the other writer let go
    release.join()
    assert ledger.spent("a", "d") == Cost(2.0**-9, 0, 0)
    impatient = SQLiteLedger(path, timeout=0.2)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(OperationalError, match="stayed busy"):
            impatient.charge("a", "d", Cost(1.0, 0, 0), DEFAULT, query_text="q", plan_hash="h")
    finally:
        other.execute("COMMIT")
    assert ledger.spent("a", "d") == Cost(2.0**-9, 0, 0)  # the refused charge wrote nothing
    impatient.charge("a", "d", Cost(2.0**-10, 0, 0), DEFAULT, query_text="q", plan_hash="h")
    assert impatient._conn().execute("PRAGMA busy_timeout").fetchone()[0] == 200
    other.close()
