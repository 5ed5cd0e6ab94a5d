"""The budget ledger interface, and an in-memory ledger for tests and ephemeral sessions.

A ledger keeps, per (analyst, dataset), the running total of privacy costs and a cache of
released answers. ``charge`` is atomic: it re-checks the budget and records the charge and the
answer together, *before* the caller releases anything.
"""

from __future__ import annotations

import threading
from typing import Protocol

from dpsql.errors import BudgetExhaustedError
from dpsql.privacy.accounting import Budget, Cost


class Ledger(Protocol):
    def budget(self, analyst: str, dataset: str, default: Budget) -> Budget:
        """The analyst's budget: an administrator's override, else ``default``."""
        ...

    def spent(self, analyst: str, dataset: str) -> Cost:
        """Everything charged so far."""
        ...

    def check(self, analyst: str, dataset: str, cost: Cost, default: Budget) -> None:
        """Raise :class:`BudgetExhaustedError` if ``cost`` would overspend. Writes nothing."""
        ...

    def charge(
        self,
        analyst: str,
        dataset: str,
        cost: Cost,
        default: Budget,
        *,
        query_text: str,
        plan_hash: str,
        cache_key: str | None = None,
        answer: str | None = None,
    ) -> None:
        """Atomically re-check, record the charge, and cache ``answer`` under ``cache_key``."""
        ...

    def cached(self, analyst: str, dataset: str, cache_key: str) -> str | None:
        """A previously released answer for the same normalised query, or None."""
        ...


def exhausted(analyst: str, budget: Budget, spent: Cost, cost: Cost) -> BudgetExhaustedError:
    eps_left, delta_left = budget.remaining(spent)
    return BudgetExhaustedError(
        f"privacy budget exhausted for analyst {analyst!r}: the query needs "
        f"epsilon={cost.epsilon:.6g}, delta={cost.delta:.3g}, rho={cost.rho:.6g}; remaining "
        f"epsilon={eps_left:.6g}, delta={delta_left:.3g}",
        construct="budget",
        hint="lower the query's epsilon (SET epsilon = ...), ask fewer aggregates, "
        "or ask an administrator to raise the budget",
    )


class MemoryLedger:
    """A thread-safe, non-durable ledger: for tests and throw-away sessions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spent: dict[tuple[str, str], Cost] = {}
        self._budgets: dict[tuple[str, str], Budget] = {}
        self._cache: dict[tuple[str, str, str], str] = {}
        self.log: list[tuple[str, str, Cost, str, str]] = []

    def budget(self, analyst: str, dataset: str, default: Budget) -> Budget:
        return self._budgets.get((analyst, dataset), default)

    def set_budget(self, analyst: str, dataset: str, budget: Budget) -> None:
        with self._lock:
            self._budgets[(analyst, dataset)] = budget

    def spent(self, analyst: str, dataset: str) -> Cost:
        return self._spent.get((analyst, dataset), Cost())

    def check(self, analyst: str, dataset: str, cost: Cost, default: Budget) -> None:
        budget = self.budget(analyst, dataset, default)
        spent = self.spent(analyst, dataset)
        if not budget.covers(spent + cost):
            raise exhausted(analyst, budget, spent, cost)

    def charge(
        self,
        analyst: str,
        dataset: str,
        cost: Cost,
        default: Budget,
        *,
        query_text: str,
        plan_hash: str,
        cache_key: str | None = None,
        answer: str | None = None,
    ) -> None:
        with self._lock:
            self.check(analyst, dataset, cost, default)
            self._spent[(analyst, dataset)] = self.spent(analyst, dataset) + cost
            self.log.append((analyst, dataset, cost, query_text, plan_hash))
            if cache_key is not None and answer is not None:
                self._cache[(analyst, dataset, cache_key)] = answer

    def cached(self, analyst: str, dataset: str, cache_key: str) -> str | None:
        return self._cache.get((analyst, dataset, cache_key))
