"""Exact budget totals, the private ledger file, reserve-then-remember, and defensive text."""

from __future__ import annotations

import dataclasses
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import warnings
from fractions import Fraction
from pathlib import Path

import pytest

from dpsql.errors import BudgetExhaustedError, InterfaceError, InternalError
from dpsql.privacy.accounting import SLACK, Budget, Cost, exact
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.ledger_file import SCHEMA_VERSION, LedgerPermissionWarning
from dpsql.privacy.sqlite_ledger import SQLiteLedger

ONE = Budget(epsilon=1.0, delta=1e-6)
TEN_MIXED = Budget(epsilon=10.0, delta=1e-6)
TINY = 2.0**-53


def charge(led, cost: Cost, budget: Budget = ONE, **kw) -> None:
    kw.setdefault("query_text", "SELECT COUNT(*) FROM t")
    kw.setdefault("plan_hash", "p1")
    led.charge("alice", "ds", cost, budget, **kw)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# -- Cost and Budget: exact arithmetic ------------------------------------------------------


def test_cost_keeps_what_was_typed_as_an_exact_rational() -> None:
    assert Cost(0.1).exact_epsilon == Fraction(1, 10)
    assert Cost(0.1) + Cost(0.2) == Cost(0.3)  # 0.1 + 0.2 != 0.3 in floats
    assert Cost(epsilon="1/3", delta=Fraction(1, 7), rho=2).parts == (
        Fraction(1, 3),
        Fraction(1, 7),
        Fraction(2),
    )
    cost = Cost(0.25, 1e-7, 0.001)
    assert isinstance(cost.epsilon, float) and cost.epsilon == 0.25  # float views for display
    assert f"{cost.delta:.3g}" == "1e-07"
    assert repr(cost) == "Cost(epsilon=0.25, delta=1e-07, rho=0.001)"
    assert -cost + cost == Cost() and (-cost).exact_rho == -Fraction(1, 1000)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cost.exact_epsilon = Fraction(0)  # type: ignore[misc]
    assert exact(TINY) > 0 and exact(3) == 3


def test_tiny_charges_are_never_lost_to_rounding() -> None:
    for n in (50, 10**4):
        total = Cost(1.0)
        for _ in range(n):
            total = total + Cost(TINY)
        assert total.exact_epsilon == 1 + n * exact(TINY) > 1
        assert total.epsilon > 1.0  # the float sum would still be 1.0


def test_shares_of_a_split_epsilon_add_up_to_it_exactly() -> None:
    exact_sums = 0
    for epsilon in (1.0, 0.1, 2.0**-10, 0.3, 5.0, 1e-3):
        for k in (2, 3, 6, 7, 12, 64):
            total = Cost()
            for _ in range(k):
                total = total + Cost(epsilon / k)
            if float(exact(epsilon) / k) == epsilon / k:  # the float share rounds ε/k
                assert total == Cost(epsilon), (epsilon, k)
                exact_sums += 1
            else:  # the float share was rounded off ε/k already: within its rounding
                assert abs(total.exact_epsilon - exact(epsilon)) <= k * exact(epsilon) / 2**52
    assert exact_sums >= 30
    assert exact(2.0**-10 / 3) == Fraction(1, 3072) and exact(0.1 / 3) == Fraction(1, 30)
    assert float(exact(0.1 / 7)) == 0.1 / 7  # never further than the float's own rounding


def test_totals_are_compared_with_the_budget_exactly_up_to_a_fixed_slack() -> None:
    assert ONE.covers(Cost(1.0, 9e-7)) and ONE.covers(Cost(1 + SLACK))
    assert not ONE.covers(Cost(1 + SLACK + Fraction(1, 10**30)))
    assert not ONE.covers(Cost(1.0 + 1e-9))
    assert not ONE.covers(Cost(delta=exact(9e-7) * (1 + 2 * SLACK)))
    assert ONE.exact_pure_delta == Fraction(9, 10**7)  # the thresholding share, exactly
    cap = ONE.exact_rho
    assert ONE.covers(Cost(rho=cap)) and not ONE.covers(Cost(rho=cap * (1 + 2 * SLACK)))
    assert ONE.covers(Cost(zrho=cap, epsilon=Fraction(1, 10)))  # zrho given by the planner
    assert not ONE.covers(Cost(float("nan")))
    assert not Budget(1.0, 0.0).covers(Cost(rho=Fraction(1, 10**30)))  # a zero cap: nothing


@pytest.mark.parametrize("part", ["epsilon", "rho"])
def test_tiny_charges_past_the_cap_overspend_at_most_cap_times_slack(part: str) -> None:
    budget = Budget(1.0, 1e-6, gaussian_share=1.0 if part == "rho" else 0.0)
    cap = Fraction(budget.rho) if part == "rho" else Fraction(1)
    led = MemoryLedger()
    led.charge("a", "d", Cost(**{part: cap}), budget, query_text="q", plan_hash="p")
    accepted = 0
    for _ in range(2**13 + 100):  # 2^-40 / 2^-53 = 2^13 of them could hide in the slack
        try:
            led.charge("a", "d", Cost(**{part: cap * TINY}), budget, query_text="q", plan_hash="p")
            accepted += 1
        except BudgetExhaustedError:
            break
    else:
        raise AssertionError("tiny charges were never refused")
    total = getattr(led.spent("a", "d"), f"exact_{part}")
    assert cap < total <= cap * (1 + SLACK)
    assert accepted <= 2**13


# -- both ledgers ---------------------------------------------------------------------------


def test_ten_charges_of_a_tenth_fill_a_budget_of_one_exactly(any_ledger) -> None:
    for _ in range(10):
        charge(any_ledger, Cost(0.1))
    spent = any_ledger.spent("alice", "ds")
    assert spent == Cost(1) and ONE.remaining(spent)[0] == 0.0
    with pytest.raises(BudgetExhaustedError):
        any_ledger.check("alice", "ds", Cost(0.1), ONE)
    with pytest.raises(BudgetExhaustedError):
        charge(any_ledger, Cost(0.1))
    assert any_ledger.spent("alice", "ds") == Cost(1)


def test_fifty_tiny_charges_move_the_total(any_ledger) -> None:
    budget = Budget(2.0, 1e-6)
    charge(any_ledger, Cost(1.0), budget)
    for _ in range(50):
        charge(any_ledger, Cost(TINY), budget)
    assert any_ledger.spent("alice", "ds").exact_epsilon == 1 + 50 * exact(TINY)


def test_remember_caches_the_answer_of_a_reserved_query_for_free(any_ledger) -> None:
    charge(any_ledger, Cost(0.25), plan_hash="k")  # the reservation: no answer yet
    assert any_ledger.cached("alice", "ds", "k") is None
    any_ledger.remember("alice", "ds", "k", "[1]")
    assert any_ledger.cached("alice", "ds", "k") == "[1]"
    any_ledger.remember("alice", "ds", "k", "[1]")  # idempotent
    any_ledger.remember("alice", "ds", "k", "[2]")  # the released answer stays
    assert any_ledger.cached("alice", "ds", "k") == "[1]"
    assert any_ledger.spent("alice", "ds") == Cost(0.25)
    assert any_ledger.cached("bob", "ds", "k") is None


def test_remember_without_any_charge_is_refused(any_ledger) -> None:
    with pytest.raises(InternalError):
        any_ledger.remember("alice", "ds", "k", "[1]")
    assert any_ledger.cached("alice", "ds", "k") is None


def test_query_text_that_is_not_valid_unicode_cannot_fail_the_charge(any_ledger) -> None:
    charge(any_ledger, Cost(0.5), query_text="SELECT 1 -- \udc80", plan_hash="h\ud800")
    any_ledger.remember("alice", "ds", "k", '["\udc80"]')
    assert any_ledger.spent("alice", "ds") == Cost(0.5)
    assert any_ledger.cached("alice", "ds", "k") is not None


# -- SQLiteLedger ---------------------------------------------------------------------------


def test_exact_totals_survive_reopening(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    with SQLiteLedger(path) as led:
        for _ in range(10):
            charge(led, Cost(0.1, rho=0))
        charge(led, Cost(delta=1e-7), Budget(1.0, 1e-6))
    with SQLiteLedger(path) as led:
        assert led.spent("alice", "ds") == Cost(1, Fraction(1, 10**7))
        assert led.entries()[0].cost.exact_epsilon == Fraction(1, 10)
        assert led.status("alice", "ds", ONE).spent == Cost(1, 1e-7)
        assert led.analysts("ds", ONE)[0].remaining == (0.0, pytest.approx(8e-7))
        with pytest.raises(BudgetExhaustedError):
            charge(led, Cost(1e-9))
        assert led.verify() == []
    conn = sqlite3.connect(path)  # the REAL columns stay readable for people
    try:
        row = conn.execute("SELECT epsilon, epsilon_exact FROM totals").fetchone()
    finally:
        conn.close()
    assert row == (1.0, "1")


def test_reset_releases_the_exact_total(tmp_path: Path) -> None:
    with SQLiteLedger(tmp_path / "l.sqlite") as led:
        for _ in range(3):
            charge(led, Cost(0.1))
        assert led.reset("alice", "ds") == Cost(0.3)
        assert led.entries()[-1].cost == Cost(-0.3)
        assert led.spent("alice", "ds").is_zero
        assert led.verify() == []


def test_remembered_answer_belongs_to_its_charge(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    with SQLiteLedger(path) as led:
        charge(led, Cost(0.25), plan_hash="k")
        charge(led, Cost(0.25), plan_hash="other")
        led.remember("alice", "ds", "k", "[1]")
        assert led.verify() == []
    conn = sqlite3.connect(path)
    try:
        ((charge_id, plan_hash),) = conn.execute(
            "SELECT c.id, c.plan_hash FROM answers AS a JOIN charge_log AS c ON c.id = a.charge_id"
        ).fetchall()
    finally:
        conn.close()
    assert plan_hash == "k" and charge_id == 1
    with SQLiteLedger(path) as led:  # committed: another instance sees it
        assert led.cached("alice", "ds", "k") == "[1]"


def test_lone_surrogates_are_stored_escaped(tmp_path: Path) -> None:
    with SQLiteLedger(tmp_path / "l.sqlite") as led:
        charge(led, Cost(0.5), query_text="SELECT 1 -- \udc80")
        (entry,) = led.entries()
        assert entry.query_text == "SELECT 1 -- \\udc80"
        with pytest.raises(InterfaceError, match="not valid Unicode"):
            led.check("\udc80", "ds", Cost(0.1), ONE)  # a key: refused before anything runs
        assert led.verify() == []


def _reserve_then_die(path: str) -> None:
    led = SQLiteLedger(path)
    led.charge("alice", "ds", Cost(0.25), ONE, query_text="q", plan_hash="k")
    os.kill(os.getpid(), signal.SIGKILL)  # the engine would run now: the answer is lost


def test_a_reservation_survives_sigkill_right_after_it(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    code = (
        "import sys; sys.path.insert(0, sys.argv[2]); "
        "from test_ledger_exact import _reserve_then_die; _reserve_then_die(sys.argv[1])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path), str(Path(__file__).parent)], check=False
    )
    assert proc.returncode == -signal.SIGKILL
    with SQLiteLedger(path) as led:
        assert led.spent("alice", "ds") == Cost(0.25)
        assert led.cached("alice", "ds", "k") is None
        assert led.verify() == []


# -- schema version 1 files -----------------------------------------------------------------

V1_SCHEMA = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE totals (analyst TEXT NOT NULL, dataset TEXT NOT NULL, "
    "epsilon REAL NOT NULL DEFAULT 0, delta REAL NOT NULL DEFAULT 0, "
    "rho REAL NOT NULL DEFAULT 0, charges INTEGER NOT NULL DEFAULT 0, "
    "updated_at TEXT NOT NULL, PRIMARY KEY (analyst, dataset))",
    "CREATE TABLE budgets (analyst TEXT NOT NULL, dataset TEXT NOT NULL, "
    "epsilon REAL NOT NULL, delta REAL NOT NULL, set_at TEXT NOT NULL, "
    "PRIMARY KEY (analyst, dataset))",
    "CREATE TABLE charge_log (id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT NOT NULL, "
    "analyst TEXT NOT NULL, dataset TEXT NOT NULL, kind TEXT NOT NULL, epsilon REAL NOT NULL, "
    "delta REAL NOT NULL, rho REAL NOT NULL, query_text TEXT NOT NULL, plan_hash TEXT NOT NULL)",
    "CREATE TRIGGER charge_log_no_update BEFORE UPDATE ON charge_log "
    "BEGIN SELECT RAISE(ABORT, 'the charge log is append-only'); END",
    "CREATE TABLE answers (analyst TEXT NOT NULL, dataset TEXT NOT NULL, "
    "cache_key TEXT NOT NULL, answer TEXT NOT NULL, charge_id INTEGER NOT NULL, "
    "stored_at TEXT NOT NULL, PRIMARY KEY (analyst, dataset, cache_key))",
)


def _v1_file(path: Path) -> None:
    """A version-1 ledger: bob charged 0.1 then reset; alice charged 0.1 and 0.2 (floats)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in V1_SCHEMA:
            conn.execute(statement)
        conn.execute("INSERT INTO meta VALUES ('schema_version', '1')")
        log = "INSERT INTO charge_log VALUES (NULL, 't', ?, 'ds', ?, ?, 0, 0, 'q', 'p')"
        conn.execute(log, ("bob", "charge", 0.1))
        conn.execute(log, ("bob", "reset", -0.1))
        conn.execute(log, ("alice", "charge", 0.1))
        conn.execute(log, ("alice", "charge", 0.2))
        conn.execute("INSERT INTO totals VALUES ('alice', 'ds', ?, 0, 0, 2, 't')", (0.1 + 0.2,))
        conn.execute("INSERT INTO totals VALUES ('bob', 'ds', 0, 0, 0, 0, 't')")
        conn.execute("INSERT INTO answers VALUES ('alice', 'ds', 'k', '[1]', 3, 't')")
    finally:
        conn.close()


def test_version_1_files_are_migrated_and_stay_readable(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    _v1_file(path)
    with pytest.warns(LedgerPermissionWarning, match="0644"):  # as version 1 created them
        led = SQLiteLedger(path)
    with led:
        assert led.spent("alice", "ds") == Cost(0.3)  # the exact sum of the logged charges
        assert led.spent("bob", "ds") == Cost()
        assert [e.cost for e in led.entries()] == [Cost(0.1), Cost(-0.1), Cost(0.1), Cost(0.2)]
        assert led.cached("alice", "ds", "k") == "[1]"
        assert led.verify() == []
        charge(led, Cost(0.7))
        assert led.spent("alice", "ds") == Cost(1)
        with pytest.raises(BudgetExhaustedError):
            charge(led, Cost(1e-9))
        assert led.verify() == []
    conn = sqlite3.connect(path)
    try:
        version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        assert version == (str(SCHEMA_VERSION),)
    finally:
        conn.close()
    with SQLiteLedger(path) as led:  # reopening a migrated file changes nothing
        assert led.spent("alice", "ds") == Cost(1) and led.verify() == []


# -- schema version 2 files (no zCDP sums) ------------------------------------------------

V2_COLUMNS = tuple(
    f"ALTER TABLE {table} ADD COLUMN {part}_exact TEXT"
    for table in ("totals", "charge_log")
    for part in ("epsilon", "delta", "rho")
)


def _v2_file(path: Path) -> None:
    """A version-2 ledger: alice charged 1/10 and 1/5 exactly (and a Gaussian 1/100)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in (*V1_SCHEMA, *V2_COLUMNS):
            conn.execute(statement)
        conn.execute("INSERT INTO meta VALUES ('schema_version', '2')")
        log = (
            "INSERT INTO charge_log VALUES (NULL, 't', 'alice', 'ds', 'charge', ?, 0, ?, 'q', "
            "'p', ?, '0', ?)"
        )
        conn.execute(log, (0.1, 0.0, "1/10", "0"))
        conn.execute(log, (0.2, 0.0, "1/5", "0"))
        conn.execute(log, (0.0, 0.01, "0", "1/100"))
        conn.execute(
            "INSERT INTO totals VALUES ('alice', 'ds', 0.3, 0, 0.01, 3, 't', '3/10', '0', '1/100')"
        )
    finally:
        conn.close()


def test_version_2_files_get_exact_zcdp_sums_from_their_log(tmp_path: Path) -> None:
    path = tmp_path / "v2.sqlite"
    _v2_file(path)
    with pytest.warns(LedgerPermissionWarning):
        led = SQLiteLedger(path)
    with led:
        spent = led.spent("alice", "ds")
        assert spent == Cost(Fraction(3, 10), 0, Fraction(1, 100))
        # Per charge: (1/10)²/2 + (1/5)²/2 + 1/100, not the looser (3/10)²/2 + 1/100.
        assert spent.exact_zrho == Fraction(1, 200) + Fraction(1, 50) + Fraction(1, 100)
        assert [e.cost.exact_zrho for e in led.entries()] == [
            Fraction(1, 200),
            Fraction(1, 50),
            Fraction(1, 100),
        ]
        assert led.verify() == []
        led.charge("alice", "ds", Cost(0.1), TEN_MIXED, query_text="q", plan_hash="p")
        assert led.spent("alice", "ds").exact_zrho == spent.exact_zrho + Fraction(1, 200)
        assert led.verify() == []
    conn = sqlite3.connect(path)
    try:
        version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        assert version == (str(SCHEMA_VERSION),) == ("3",)
    finally:
        conn.close()


def test_a_total_updated_by_a_version_2_process_gets_its_zrho_from_the_log(
    tmp_path: Path,
) -> None:
    """A version-2 process open before the migration writes rows and totals without zrho."""
    path = tmp_path / "v2.sqlite"
    with SQLiteLedger(path) as led:
        led.charge("alice", "ds", Cost(0.1), TEN_MIXED, query_text="q", plan_hash="p")
    conn = sqlite3.connect(path, isolation_level=None)
    try:  # what a version-2 charge of 0.2 writes
        conn.execute(
            "INSERT INTO charge_log (at, analyst, dataset, kind, epsilon, delta, rho, "
            "query_text, plan_hash, epsilon_exact, delta_exact, rho_exact) "
            "VALUES ('t', 'alice', 'ds', 'charge', 0.2, 0, 0, 'q', 'p', '1/5', '0', '0')"
        )
        conn.execute(
            "UPDATE totals SET epsilon = 0.3, epsilon_exact = '3/10', charges = 2, "
            "updated_at = 'later'"
        )
    finally:
        conn.close()
    with SQLiteLedger(path) as led:
        spent = led.spent("alice", "ds")
        assert spent == Cost(0.3)
        assert spent.exact_zrho == Fraction(1, 200) + Fraction(1, 50)  # never understated
        assert led.analysts("ds", TEN_MIXED)[0].spent.exact_zrho == spent.exact_zrho
        assert led.verify() == []


# -- file permissions -----------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_a_new_ledger_and_its_side_files_are_private_whatever_the_umask(
    tmp_path: Path, umask: int
) -> None:
    path = tmp_path / "l.sqlite"
    old = os.umask(umask)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with SQLiteLedger(path) as led:
                charge(led, Cost(0.1), cache_key="k", answer="[1]")
                side = [Path(f"{path}{s}") for s in ("-wal", "-shm")]
                assert all(p.exists() for p in side)
                assert [mode(p) for p in [path, *side]] == [0o600] * 3
    finally:
        os.umask(old)


def test_an_existing_readable_ledger_is_made_private_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    with SQLiteLedger(path) as led:
        charge(led, Cost(0.1))
    os.chmod(path, 0o644)
    with pytest.warns(LedgerPermissionWarning, match="made it private"):
        led = SQLiteLedger(path)
    with led:
        assert mode(path) == 0o600
        assert led.spent("alice", "ds") == Cost(0.1)
