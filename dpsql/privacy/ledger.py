"""The budget ledger interface, and an in-memory ledger for tests and ephemeral sessions.

A ledger keeps, per (analyst, dataset), the running total of privacy costs and a cache of
released answers. ``charge`` is atomic: it re-checks the budget and records the charge (and,
if given, the answer) together. The pipeline pays before reading: it charges with no answer
before the engine runs, then stores the released answer with ``remember``. Totals are exact
rationals (:class:`~dpsql.privacy.accounting.Cost`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from dpsql.errors import BudgetExhaustedError, InternalError
from dpsql.privacy.accounting import Budget, Cost


class EphemeralBudgetWarning(UserWarning):
    """The budget lives in memory: it is forgotten when the process ends."""


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
        """Atomically re-check, record the charge, and cache ``answer`` under ``cache_key``.

        Durable when it returns (for a durable ledger): a charge made before the engine runs
        survives a crash of the caller, so a lost answer never means a lost charge.
        """
        ...

    def remember(self, analyst: str, dataset: str, cache_key: str, answer: str) -> None:
        """Cache ``answer`` of a query already charged; costs nothing; idempotent.

        The first answer stored under a key stays (a replay must be the answer released).
        """
        ...

    def cached(self, analyst: str, dataset: str, cache_key: str) -> str | None:
        """A previously released answer for the same normalised query, or None."""
        ...


@dataclass(frozen=True)
class LogEntry:
    """One row of the append-only charge log.

    ``kind`` is "charge" (a query), "reset" (an administrator released the spending: its cost is
    the negated total, so the log always sums to the running total) or "budget" (an
    administrator set the budget: zero cost, the new budget in ``query_text``).
    """

    id: int
    at: str  # ISO 8601, UTC
    analyst: str
    dataset: str
    kind: str
    cost: Cost
    query_text: str
    plan_hash: str


@dataclass(frozen=True)
class AnalystStatus:
    """What one analyst has spent on one dataset, against which budget."""

    analyst: str
    dataset: str
    spent: Cost
    budget: Budget
    overridden: bool  # the budget is an administrator's override, not the policy default
    charges: int  # charges since the last reset

    @property
    def epsilon_spent(self) -> float:
        """The ε the spent (ε, δ, ρ) amounts to under the budget's δ."""
        return self.budget.epsilon_of(self.spent)

    @property
    def remaining(self) -> tuple[float, float]:
        return self.budget.remaining(self.spent)


class AdminLedger(Ledger, Protocol):
    """Administrator operations; the query pipeline never calls these."""

    def set_budget(self, analyst: str, dataset: str, budget: Budget) -> None:
        """Override the policy's default budget for one analyst (raise or lower it)."""
        ...

    def reset(self, analyst: str, dataset: str) -> None:
        """Release everything the analyst has spent, recorded as an event in the log."""
        ...

    def analysts(self, dataset: str, default: Budget) -> list[AnalystStatus]:
        """Every analyst with charges or a budget override on ``dataset``."""
        ...

    def entries(
        self, dataset: str | None = None, *, analyst: str | None = None, limit: int | None = None
    ) -> list[LogEntry]:
        """The most recent ``limit`` log rows, oldest first."""
        ...


def validate_cost(cost: Cost) -> None:
    """Refuse a cost that is not finite and >= 0 in every part (a caller's bug)."""
    if not (cost.is_finite and all(p >= 0 for p in cost.parts)):
        raise InternalError(
            f"refusing to charge an invalid privacy cost {cost!r}",
            construct="cost",
            hint="every part of a cost must be finite and >= 0; this is a bug in the caller",
        )


def not_charged(analyst: str, dataset: str) -> InternalError:
    return InternalError(
        f"refusing to cache an answer for analyst {analyst!r} on {dataset!r}: "
        "nothing was charged for it",
        construct="ledger",
        hint="charge the query before storing its answer; this is a bug in the caller",
    )


def exhausted(analyst: str, budget: Budget, spent: Cost, cost: Cost) -> BudgetExhaustedError:
    eps_left, delta_left = budget.remaining(spent)
    return BudgetExhaustedError(
        f"privacy budget exhausted for analyst {analyst!r}: the query needs "
        f"epsilon={cost.epsilon:.6g}, delta={cost.delta:.3g}, rho={cost.rho:.6g}; remaining "
        f"epsilon={eps_left:.6g}, delta={delta_left:.3g} ({budget.refusal_reason(spent + cost)})",
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
        self._charged: set[tuple[str, str]] = set()
        self.log: list[tuple[str, str, Cost, str, str]] = []

    def budget(self, analyst: str, dataset: str, default: Budget) -> Budget:
        return self._budgets.get((analyst, dataset), default)

    def set_budget(self, analyst: str, dataset: str, budget: Budget) -> None:
        with self._lock:
            self._budgets[(analyst, dataset)] = budget

    def spent(self, analyst: str, dataset: str) -> Cost:
        return self._spent.get((analyst, dataset), Cost())

    def standing(self, analyst: str, dataset: str, default: Budget) -> tuple[Budget, Cost]:
        """The budget and the total spent together (SQLiteLedger reads both at once)."""
        return self.budget(analyst, dataset, default), self.spent(analyst, dataset)

    def check(self, analyst: str, dataset: str, cost: Cost, default: Budget) -> None:
        self._total_after(analyst, dataset, cost, default)

    def _total_after(self, analyst: str, dataset: str, cost: Cost, default: Budget) -> Cost:
        """The total with ``cost`` added, or :class:`BudgetExhaustedError` if it overspends."""
        validate_cost(cost)
        budget = self.budget(analyst, dataset, default)
        spent = self.spent(analyst, dataset)
        total = spent + cost
        if not budget.covers(total):
            raise exhausted(analyst, budget, spent, cost)
        return total

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
            self._spent[(analyst, dataset)] = self._total_after(analyst, dataset, cost, default)
            self.log.append((analyst, dataset, cost, query_text, plan_hash))
            self._charged.add((analyst, dataset))
            if cache_key is not None and answer is not None:
                self._cache.setdefault((analyst, dataset, cache_key), answer)

    def remember(self, analyst: str, dataset: str, cache_key: str, answer: str) -> None:
        with self._lock:
            if (analyst, dataset) not in self._charged:
                raise not_charged(analyst, dataset)
            self._cache.setdefault((analyst, dataset, cache_key), answer)

    def cached(self, analyst: str, dataset: str, cache_key: str) -> str | None:
        return self._cache.get((analyst, dataset, cache_key))
