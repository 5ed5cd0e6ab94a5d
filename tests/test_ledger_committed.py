"""Two ledger reads a charged query saved (dpsql.privacy.ledger_standings): the budget left
that a charged answer reports is read off the charge's own transaction (committed_standing): it
must equal what a read right after the charge gives, belong to this thread's last committed
charge of that analyst and dataset only, and be absent after a refused charge. And the budget
check before a charge may be passed by the figures this process last committed, never
refused by them: stale figures (another process charged, an operator changed the budget) defer
to the charge's transaction, which refuses with nothing written."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from dpsql.errors import BudgetExhaustedError
from dpsql.pipeline import Service
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.sqlite_ledger import SQLiteLedger
from dpsql.service.session import Session

DEFAULT = Budget(1.0, 1e-5)
ROOT = Path(__file__).resolve().parent.parent


def _charge(ledger: SQLiteLedger, analyst: str, eps: float) -> None:
    ledger.charge(analyst, "d", Cost(eps, 0, 0), DEFAULT, query_text="q", plan_hash="h")


def test_committed_standing_is_the_read_after_the_charge(tmp_path: Path) -> None:
    ledger = SQLiteLedger(tmp_path / "l.sqlite")
    try:
        _charge(ledger, "a", 0.25)
        _charge(ledger, "a", 0.125)
        assert ledger.committed_standing("a", "d") == ledger.standing("a", "d", DEFAULT)
        assert ledger.committed_standing("a", "d") is None  # taken once
        _charge(ledger, "a", 0.125)
        assert ledger.committed_standing("b", "d") is None  # another analyst's: dropped
        assert ledger.committed_standing("a", "d") is None
    finally:
        ledger.close()


def test_refused_charge_and_other_threads_leave_nothing(tmp_path: Path) -> None:
    ledger = SQLiteLedger(tmp_path / "l.sqlite")
    try:
        _charge(ledger, "a", 0.75)
        with pytest.raises(BudgetExhaustedError):
            _charge(ledger, "a", 0.5)  # refused: the earlier charge's figures are gone too
        assert ledger.committed_standing("a", "d") is None
        _charge(ledger, "a", 0.125)
        seen: list[object] = []
        other = threading.Thread(target=lambda: seen.append(ledger.committed_standing("a", "d")))
        other.start()
        other.join()
        assert seen == [None]  # per thread
        _budget, spent = ledger.committed_standing("a", "d")  # type: ignore[misc]
        assert spent.exact_epsilon == ledger.spent("a", "d").exact_epsilon
    finally:
        ledger.close()


def test_session_reports_the_same_remaining(tmp_path: Path) -> None:
    """Through the service session: the NOTICE's figures equal a fresh read's."""
    import shutil

    from dpsql.policy import load_policy

    src = ROOT / "fixtures" / "visits.toml"
    shutil.copy(src, tmp_path / src.name)
    for table in load_policy(src).tables.values():
        if table.source_path is not None:
            shutil.copy(table.source_path, tmp_path / table.source_path.name)
    service = Service(tmp_path / src.name, cache=False)
    try:
        session = Session(service, "alice")
        session.execute("SET epsilon = 0.125")
        ledger = service.ledger
        reads: list[str] = []
        standing = ledger.standing

        def counted(*args: object) -> object:
            reads.append("standing")
            return standing(*args)  # type: ignore[arg-type]

        ledger.standing = counted  # type: ignore[method-assign]
        answer = session.execute("SELECT COUNT(*) FROM visits WHERE age > 30")
        assert reads == ["standing"]  # the budget check before the charge; none after it
        reads.clear()
        answer = session.execute("SELECT COUNT(*) FROM visits WHERE age > 31")
        assert reads == []  # checked on the figures the first charge committed
        ledger.standing = standing  # type: ignore[method-assign]
        assert answer.remaining == session.remaining()
        assert answer.remaining is not None
    finally:
        service.close()


def test_stale_figures_pass_the_check_and_the_charge_refuses(tmp_path: Path) -> None:
    ledger = SQLiteLedger(tmp_path / "l.sqlite")
    other = SQLiteLedger(tmp_path / "l.sqlite")  # another process, in effect
    try:
        _charge(ledger, "a", 0.25)
        _charge(other, "a", 0.625)  # 0.875 spent; this ledger still knows 0.25
        ledger.check("a", "d", Cost(0.25, 0, 0), DEFAULT)  # passed on its own figures
        with pytest.raises(BudgetExhaustedError):
            _charge(ledger, "a", 0.25)  # the charge re-reads the committed total
        assert ledger.spent("a", "d").exact_epsilon == other.spent("a", "d").exact_epsilon
        with pytest.raises(BudgetExhaustedError):  # after a refusal the check reads again
            ledger.check("a", "d", Cost(0.25, 0, 0), DEFAULT)
    finally:
        ledger.close()
        other.close()


def test_known_figures_never_refuse(tmp_path: Path) -> None:
    ledger = SQLiteLedger(tmp_path / "l.sqlite")
    other = SQLiteLedger(tmp_path / "l.sqlite")
    try:
        _charge(ledger, "a", 0.75)
        other.set_budget("a", "d", Budget(2.0, 1e-5))  # an operator raised it elsewhere
        ledger.check("a", "d", Cost(0.5, 0, 0), DEFAULT)  # not refused on the old figures
        _charge(ledger, "a", 0.5)
        assert ledger.spent("a", "d").exact_epsilon == 1.25
    finally:
        ledger.close()
        other.close()
