"""Unit tests of the budget ledgers: every operation, refusals write nothing, append-only log."""

from __future__ import annotations

import datetime as dt
import sqlite3
import threading
from fractions import Fraction
from pathlib import Path

import pytest

from dpsql.errors import BudgetExhaustedError, InterfaceError, InternalError, OperationalError
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.ledger_file import SCHEMA_VERSION
from dpsql.privacy.sqlite_ledger import SQLiteLedger, open_ledger

# delta > 0: pure and Gaussian charges share one zCDP filter (rho cap ~0.0202 at delta 1e-7),
# or the pure filter (sum of epsilon <= 1) while no Gaussian rho is spent.
BUDGET = Budget(epsilon=1.0, delta=1e-6)
MIXED = Budget(epsilon=8.0, delta=2e-6)  # room for the Gaussian charges of these tests


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "budget.ledger.sqlite"


@pytest.fixture
def ledger(path: Path):
    with SQLiteLedger(path) as led:
        yield led


def charge(led, cost: Cost, analyst: str = "alice", dataset: str = "ds", **kw) -> None:
    kw.setdefault("query_text", "SELECT COUNT(*) FROM t")
    kw.setdefault("plan_hash", "p1")
    mixed = cost.rho or led.spent(analyst, dataset).rho
    led.charge(analyst, dataset, cost, MIXED if mixed else BUDGET, **kw)


def state(led: SQLiteLedger) -> tuple:
    """Everything a refused operation must leave untouched."""
    conn = sqlite3.connect(led.path)
    try:
        return tuple(
            conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall()
            for t in ("totals", "budgets", "charge_log", "answers")
        )
    finally:
        conn.close()


# -- the Ledger protocol, both implementations ----------------------------------------------


def test_fresh_ledger_is_empty(any_ledger) -> None:
    assert any_ledger.spent("alice", "ds") == Cost()
    assert any_ledger.budget("alice", "ds", BUDGET) == BUDGET
    assert any_ledger.cached("alice", "ds", "k") is None
    any_ledger.check("alice", "ds", Cost(1.0), BUDGET)  # exactly the budget fits


def test_charges_add_up_per_analyst_and_dataset(any_ledger) -> None:
    charge(any_ledger, Cost(0.25, 1e-7, 0.001))
    charge(any_ledger, Cost(0.125, 0.0, 0.002))
    charge(any_ledger, Cost(0.5), analyst="bob")
    charge(any_ledger, Cost(0.5), dataset="other")
    assert any_ledger.spent("alice", "ds") == Cost(0.375, 1e-7, 0.003)
    assert any_ledger.spent("bob", "ds") == Cost(0.5)
    assert any_ledger.spent("alice", "other") == Cost(0.5)


def test_check_and_charge_refuse_overspending_with_the_remaining_budget(any_ledger) -> None:
    charge(any_ledger, Cost(0.75))
    with pytest.raises(BudgetExhaustedError) as info:
        any_ledger.check("alice", "ds", Cost(0.5), BUDGET)
    assert info.value.sqlstate == "53400"
    assert "remaining epsilon=0.25" in str(info.value)
    with pytest.raises(BudgetExhaustedError):
        charge(any_ledger, Cost(0.5), cache_key="k", answer="[1]")
    assert any_ledger.spent("alice", "ds") == Cost(0.75)
    assert any_ledger.cached("alice", "ds", "k") is None


def test_delta_and_rho_count_against_the_budget(any_ledger) -> None:
    with pytest.raises(BudgetExhaustedError):
        charge(any_ledger, Cost(delta=2e-6))
    # rho = 0.1 at the conversion delta 1e-7 amounts to epsilon ~2.2 > 1.
    with pytest.raises(BudgetExhaustedError):
        any_ledger.charge("alice", "ds", Cost(rho=0.1), BUDGET, query_text="q", plan_hash="p")
    any_ledger.charge("alice", "ds", Cost(rho=0.005), BUDGET, query_text="q", plan_hash="p")
    assert any_ledger.spent("alice", "ds") == Cost(rho=0.005)


def test_answer_cache_is_keyed_by_analyst_dataset_and_key(any_ledger) -> None:
    charge(any_ledger, Cost(0.1), cache_key="k", answer='[["x", 3]]')
    assert any_ledger.cached("alice", "ds", "k") == '[["x", 3]]'
    assert any_ledger.cached("bob", "ds", "k") is None
    assert any_ledger.cached("alice", "other", "k") is None
    assert any_ledger.cached("alice", "ds", "k2") is None


def test_charge_without_a_cache_key_caches_nothing(any_ledger) -> None:
    charge(any_ledger, Cost(0.1), answer="[1]")
    charge(any_ledger, Cost(0.1), cache_key="k")
    assert any_ledger.cached("alice", "ds", "k") is None


# -- SQLiteLedger ---------------------------------------------------------------------------


def test_log_rows_record_time_query_and_plan(ledger: SQLiteLedger) -> None:
    before = dt.datetime.now(dt.UTC)
    charge(ledger, Cost(0.25, 1e-7, 0.001), query_text="SELECT 1", plan_hash="abc")
    (entry,) = ledger.entries("ds")
    assert (entry.analyst, entry.dataset, entry.kind) == ("alice", "ds", "charge")
    assert entry.cost == Cost(0.25, 1e-7, 0.001)
    assert (entry.query_text, entry.plan_hash) == ("SELECT 1", "abc")
    at = dt.datetime.fromisoformat(entry.at)
    assert at.utcoffset() == dt.timedelta(0)
    assert before <= at <= dt.datetime.now(dt.UTC)


def test_refused_charge_writes_nothing(ledger: SQLiteLedger) -> None:
    charge(ledger, Cost(0.75), cache_key="k1", answer="[1]")
    before = state(ledger)
    with pytest.raises(BudgetExhaustedError):
        charge(ledger, Cost(0.5), cache_key="k2", answer="[2]")
    with pytest.raises(BudgetExhaustedError):
        ledger.check("alice", "ds", Cost(0.5), BUDGET)
    assert state(ledger) == before


@pytest.mark.parametrize(
    "cost", [Cost(-0.1), Cost(float("nan")), Cost(rho=float("inf")), Cost(delta=-1e-9)]
)
def test_invalid_costs_are_refused_and_write_nothing(ledger: SQLiteLedger, cost: Cost) -> None:
    before = state(ledger)
    with pytest.raises(InternalError):
        charge(ledger, cost)
    assert state(ledger) == before


def test_an_exception_inside_the_transaction_rolls_everything_back(path: Path) -> None:
    def boom(stage: str) -> None:
        if stage == "written":
            raise RuntimeError("crash before commit")

    with SQLiteLedger(path, fault_hook=boom) as led:
        with pytest.raises(RuntimeError):
            charge(led, Cost(0.5), cache_key="k", answer="[1]")
        assert led.spent("alice", "ds") == Cost()
        assert led.entries() == []
        assert led.cached("alice", "ds", "k") is None


def test_zero_cost_charges_are_logged(ledger: SQLiteLedger) -> None:
    charge(ledger, Cost(), cache_key="k", answer="[]")
    assert [e.cost for e in ledger.entries()] == [Cost()]
    assert ledger.cached("alice", "ds", "k") == "[]"


def test_racing_identical_queries_are_both_charged_and_the_first_answer_stays(
    ledger: SQLiteLedger,
) -> None:
    charge(ledger, Cost(0.25), cache_key="k", answer="[1]")
    charge(ledger, Cost(0.25), cache_key="k", answer="[2]")
    assert ledger.spent("alice", "ds") == Cost(0.5)
    assert ledger.cached("alice", "ds", "k") == "[1]"


def test_log_is_append_only(ledger: SQLiteLedger) -> None:
    charge(ledger, Cost(0.5))
    conn = sqlite3.connect(ledger.path)
    try:
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute("UPDATE charge_log SET epsilon = 0")
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute("DELETE FROM charge_log")
        conn.rollback()
        assert conn.execute("SELECT epsilon FROM charge_log").fetchall() == [(0.5,)]
    finally:
        conn.close()


def test_state_survives_reopening(path: Path) -> None:
    with SQLiteLedger(path) as led:
        charge(led, Cost(0.25, 1e-7), cache_key="k", answer="[7]")
        led.set_budget("alice", "ds", Budget(3.0, 1e-5))
    with SQLiteLedger(path) as led:
        assert led.spent("alice", "ds") == Cost(0.25, 1e-7)
        assert led.cached("alice", "ds", "k") == "[7]"
        assert led.budget("alice", "ds", BUDGET) == Budget(3.0, 1e-5)
        assert len(led.entries()) == 2


def test_file_uses_wal_and_records_its_schema_version(ledger: SQLiteLedger) -> None:
    conn = sqlite3.connect(ledger.path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
            str(SCHEMA_VERSION),
        )
    finally:
        conn.close()


def test_newer_schema_version_is_refused(path: Path) -> None:
    SQLiteLedger(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(OperationalError, match="schema version 99"):
        SQLiteLedger(path)


def test_missing_directory_is_an_operational_error(tmp_path: Path) -> None:
    with pytest.raises(OperationalError) as info:
        SQLiteLedger(tmp_path / "no" / "such" / "dir" / "l.sqlite")
    assert info.value.hint


def test_closed_ledger_refuses_use(path: Path) -> None:
    led = SQLiteLedger(path)
    led.close()
    led.close()  # idempotent
    with pytest.raises(InterfaceError):
        led.spent("alice", "ds")


def test_each_thread_gets_its_own_connection(ledger: SQLiteLedger) -> None:
    seen: list[int] = []

    def work() -> None:
        seen.append(id(ledger._conn()))
        charge(ledger, Cost(0.125))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 4
    assert ledger.spent("alice", "ds") == Cost(0.5)


def test_writer_busy_beyond_the_timeout_is_an_operational_error(path: Path) -> None:
    SQLiteLedger(path).close()
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        with SQLiteLedger(path, timeout=0.05) as led:
            assert led.spent("alice", "ds") == Cost()  # WAL: readers are not blocked
            with pytest.raises(OperationalError, match="busy"):
                charge(led, Cost(0.1))
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()


# -- administrator operations ----------------------------------------------------------------


def test_set_budget_raises_and_lowers_and_is_logged(ledger: SQLiteLedger) -> None:
    charge(ledger, Cost(0.75))
    ledger.set_budget("alice", "ds", Budget(2.0, 1e-6), actor="admin")
    assert ledger.budget("alice", "ds", BUDGET) == Budget(2.0, 1e-6)
    assert ledger.budget("bob", "ds", BUDGET) == BUDGET
    assert ledger.budget("alice", "other", BUDGET) == BUDGET
    charge(ledger, Cost(1.0))  # fits only under the raised budget
    ledger.set_budget("alice", "ds", Budget(0.5, 1e-6), actor="admin")
    with pytest.raises(BudgetExhaustedError):
        charge(ledger, Cost(0.01))
    events = [e for e in ledger.entries() if e.kind == "budget"]
    assert [e.cost for e in events] == [Cost(), Cost()]
    assert "epsilon=2" in events[0].query_text and "by admin" in events[0].query_text
    assert "was epsilon=2" in events[1].query_text


@pytest.mark.parametrize("budget", [Budget(0.0, 0.0), Budget(-1.0, 0.0), Budget(1.0, 1.0)])
def test_invalid_budgets_are_refused(ledger: SQLiteLedger, budget: Budget) -> None:
    with pytest.raises(InterfaceError):
        ledger.set_budget("alice", "ds", budget)
    assert ledger.entries() == []


def test_reset_is_an_event_and_deletes_nothing(ledger: SQLiteLedger) -> None:
    charge(ledger, Cost(0.1, 1e-7, 0.001), cache_key="k", answer="[1]")
    charge(ledger, Cost(0.05))
    released = ledger.reset("alice", "ds", actor="admin")
    assert released == Cost(0.15, 1e-7, 0.001)
    assert released.exact_zrho == Fraction(1, 1000) + Fraction(1, 200) + Fraction(1, 800)
    assert ledger.spent("alice", "ds") == Cost()
    kinds = [e.kind for e in ledger.entries()]
    assert kinds == ["charge", "charge", "reset"]
    assert ledger.entries()[-1].cost == Cost(-0.15, -1e-7, -0.001)
    assert ledger.entries()[-1].cost.exact_zrho == -released.exact_zrho
    assert ledger.cached("alice", "ds", "k") == "[1]"  # released answers stay released
    charge(ledger, Cost(1.0))  # the whole budget is available again
    assert ledger.verify() == []


def test_analysts_lists_spent_and_remaining(ledger: SQLiteLedger) -> None:
    charge(ledger, Cost(0.25), analyst="bob")
    charge(ledger, Cost(0.5), analyst="bob")
    charge(ledger, Cost(0.5), analyst="carol", dataset="other")
    ledger.set_budget("dave", "ds", Budget(4.0, 1e-5))
    statuses = {s.analyst: s for s in ledger.analysts("ds", BUDGET)}
    assert sorted(statuses) == ["bob", "dave"]
    bob, dave = statuses["bob"], statuses["dave"]
    assert (bob.spent, bob.charges, bob.overridden) == (Cost(0.75), 2, False)
    assert bob.remaining == pytest.approx((0.25, 9e-7))  # 1/10 of delta converts zCDP
    assert bob.epsilon_spent == 0.75
    assert (dave.spent, dave.budget, dave.overridden) == (Cost(), Budget(4.0, 1e-5), True)


def test_status_of_an_unknown_analyst(ledger: SQLiteLedger) -> None:
    s = ledger.status("zoe", "ds", BUDGET)
    assert (s.spent, s.budget, s.charges, s.overridden) == (Cost(), BUDGET, 0, False)


def test_entries_filter_and_limit_keep_chronological_order(ledger: SQLiteLedger) -> None:
    for i in range(5):
        charge(ledger, Cost(0.01), query_text=f"q{i}")
    charge(ledger, Cost(0.01), analyst="bob", query_text="b")
    charge(ledger, Cost(0.01), dataset="other", query_text="o")
    assert [e.query_text for e in ledger.entries("ds", limit=3)] == ["q3", "q4", "b"]
    assert [e.query_text for e in ledger.entries("ds", analyst="bob")] == ["b"]
    assert len(ledger.entries()) == 7
    assert ledger.entries("ds", limit=0) == []


def test_verify_detects_a_tampered_total(ledger: SQLiteLedger) -> None:
    charge(ledger, Cost(0.5))
    assert ledger.verify() == []
    conn = sqlite3.connect(ledger.path)
    conn.execute("UPDATE totals SET epsilon = 0")  # totals are not the audit trail: the log is
    conn.commit()
    conn.close()
    (problem,) = ledger.verify()
    assert "'alice'" in problem and "epsilon" in problem


def test_open_ledger_follows_the_policy_path(path: Path) -> None:
    assert isinstance(open_ledger(None), MemoryLedger)
    led = open_ledger(path)
    assert isinstance(led, SQLiteLedger)
    led.close()
