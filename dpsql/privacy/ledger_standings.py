"""What this process's own charges committed, kept so that two ledger reads a query can go.

A charged query read the analyst's budget and total three times: the budget check before its
charge, the charge's transaction itself, and the budget left reported with the answer. The
charge's transaction holds the figures both others need, as of its COMMIT:

- **the report after the charge** (:meth:`CommittedStandings.take`): the figures the charge
  committed, per thread and taken once, are what a read right after the COMMIT would give;
- **the check before the next charge** (:meth:`CommittedStandings.fits`): the figures the
  analyst's last committed charge (or read) in this process left may only *pass* a check. They
  may be stale (another process charged, an operator changed the budget): a pass then defers
  to the charge, whose transaction re-reads the committed total and refuses with the same
  error, nothing written, before anything is read. A refusal is never decided on them: a check
  they do not pass reads the ledger, as before.
"""

from __future__ import annotations

import threading

from dpsql.privacy.accounting import Budget, Cost

#: analysts kept at most (all forgotten past it: the next check of each reads the ledger)
MAX_KEPT = 4096


class CommittedStandings:
    """Budgets and totals as this process last committed or read them (thread-safe)."""

    def __init__(self) -> None:
        self._thread = threading.local()  # (analyst, dataset, budget, total): last charge
        self._last: dict[tuple[str, str], tuple[Budget, Budget, Cost]] = {}
        self._lock = threading.Lock()

    def forget_thread(self) -> None:
        """Before a charge: whatever an earlier charge of this thread left is dropped."""
        self._thread.value = None

    def committed(self, analyst: str, dataset: str, default: Budget, standing: tuple) -> None:
        """A charge of this thread committed ``standing`` = (budget, total)."""
        budget, total = standing
        self._thread.value = (analyst, dataset, budget, total)
        self.read(analyst, dataset, default, budget, total)

    def read(
        self, analyst: str, dataset: str, default: Budget, budget: Budget, total: Cost
    ) -> None:
        """The ledger said (budget, total) for the analyst under ``default``."""
        with self._lock:
            if len(self._last) >= MAX_KEPT:
                self._last.clear()
            self._last[(analyst, dataset)] = (default, budget, total)

    def drop(self, analyst: str, dataset: str) -> None:
        """A charge of the analyst failed or was refused: their figures are read again."""
        with self._lock:
            self._last.pop((analyst, dataset), None)

    def take(self, analyst: str, dataset: str) -> tuple[Budget, Cost] | None:
        """This thread's last committed charge's (budget, total) for the analyst, once."""
        found, self._thread.value = getattr(self._thread, "value", None), None
        if found is None or found[:2] != (analyst, dataset):
            return None
        return found[2], found[3]

    def fits(self, analyst: str, dataset: str, default: Budget, cost: Cost) -> bool:
        """Whether the last known figures pass a check of ``cost`` (False: read and check)."""
        with self._lock:
            known = self._last.get((analyst, dataset))
        if known is None or known[0] != default:
            return False
        _default, budget, total = known
        return budget.covers(total + cost)
