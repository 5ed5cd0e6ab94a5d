"""The budget ledger interface, and an in-memory ledger for tests and ephemeral sessions.

A ledger keeps, per (analyst, dataset), the running total of privacy costs and a cache of
released answers. ``charge`` is atomic: it re-checks the budget and records the charge (and,
if given, the answer) together. The pipeline pays before reading: it charges with no answer
before the engine runs, then stores the released answer with ``remember``. Totals are exact
rationals (:class:`~dpsql.privacy.accounting.Cost`).
"""

from __future__ import annotations

import datetime as _dt
import threading
from dataclasses import dataclass
from typing import Protocol

from dpsql.errors import BudgetExhaustedError, InternalError
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.budget_rules import (
    BudgetRules,
    Clock,
    LimitStatus,
    exceeded,
    period_of,
    rules_of,
    stale,
    utc_now,
)


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
    """The refusal of the analyst's own budget: which limit the query would break and by how
    much (:meth:`Budget.refusal`), then the query's parts and what remains."""
    eps_left, delta_left = budget.remaining(spent)
    head = (
        f"the query does not fit the whole privacy budget of analyst {analyst!r}"
        if budget.too_large(cost)
        else f"privacy budget exhausted for analyst {analyst!r}"
    )
    return BudgetExhaustedError(
        f"{head}: {budget.refusal(spent, cost)}; the query needs "
        f"epsilon={cost.epsilon:.6g}, delta={cost.delta:.3g}, rho={cost.rho:.6g}; remaining "
        f"epsilon={eps_left:.6g}, delta={delta_left:.3g}",
        construct="budget",
        hint="lower the query's epsilon (SET epsilon = ...), ask fewer aggregates, "
        "or ask an administrator to raise the budget",
    )


def refuse_unless_fits(limits: list[LimitStatus], cost: Cost) -> None:
    """Raise for the first limit (the analyst's own, a group's, the dataset's) that ``cost``
    would overspend; the analyst's own refusal reads as it always has."""
    for limit in limits:
        if not limit.budget.covers(limit.spent + cost):
            if limit.kind == "analyst":
                raise exhausted(limit.name, limit.budget, limit.spent, cost)
            raise exceeded(limit, cost)


#: Nothing spent: one shared value (a Cost is immutable), not a new one each time a total is read.
_NOTHING = Cost()


class MemoryLedger:
    """A thread-safe, non-durable ledger: for tests and throw-away sessions.

    Enforces [budgets] (group and dataset-wide budgets, renewal) as SQLiteLedger does: one
    lock covers the check and the update of every total a charge touches.
    """

    def __init__(self, *, clock: Clock | None = None) -> None:
        self._clock: Clock = clock or utc_now
        # (pool key, dataset, period) -> (total, charges); (analyst, dataset) -> period
        self._pools: dict[tuple[str, str, str], tuple[Cost, int]] = {}
        self._periods: dict[tuple[str, str], str] = {}
        self._charges: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._spent: dict[tuple[str, str], Cost] = {}
        self._budgets: dict[tuple[str, str], Budget] = {}
        self._cache: dict[tuple[str, str, str], str] = {}
        self._charged: set[tuple[str, str]] = set()
        self.log: list[tuple[str, str, Cost, str, str]] = []
        # the last (budget, total spent, cost, new total) that fitted (_total_after)
        self._passed: tuple[Budget, Cost, Cost, Cost] | None = None

    def budget(self, analyst: str, dataset: str, default: Budget) -> Budget:
        return self._budgets.get((analyst, dataset), default)

    def set_budget(self, analyst: str, dataset: str, budget: Budget) -> None:
        with self._lock:
            self._budgets[(analyst, dataset)] = budget

    def spent(self, analyst: str, dataset: str) -> Cost:
        spent = self._spent.get((analyst, dataset))
        return _NOTHING if spent is None else spent

    def standing(self, analyst: str, dataset: str, default: Budget) -> tuple[Budget, Cost]:
        """The budget and the total spent together (SQLiteLedger reads both at once); a
        renewing budget's total of a period that has ended reads as zero."""
        rules = rules_of(default)
        if rules is not None and rules.renew is not None:
            own = self.limits(analyst, dataset, default)[0]
            return own.budget, own.spent
        return self.budget(analyst, dataset, default), self.spent(analyst, dataset)

    def check(self, analyst: str, dataset: str, cost: Cost, default: Budget) -> None:
        rules = rules_of(default)
        if rules is None:
            self._total_after(analyst, dataset, cost, default)
            return
        validate_cost(cost)
        with self._lock:
            limits, _ = self._limits(analyst, dataset, default, rules, self._clock())
        refuse_unless_fits(limits, cost)

    def limits(self, analyst: str, dataset: str, default: Budget) -> list[LimitStatus]:
        """Every budget a charge of ``analyst`` must fit (see SQLiteLedger.limits)."""
        rules = rules_of(default)
        with self._lock:
            if rules is None:
                spent = self.spent(analyst, dataset)
                budget = self.budget(analyst, dataset, default)
                charges = self._charges.get((analyst, dataset), 0)
                return [LimitStatus("analyst", analyst, budget, spent, "", charges)]
            return self._limits(analyst, dataset, default, rules, self._clock())[0]

    def pools(self, dataset: str, default: Budget) -> list[LimitStatus]:
        """Every group's and the dataset-wide budget with its spending this period."""
        rules = rules_of(default)
        if rules is None:
            return []
        now = self._clock()
        out = []
        with self._lock:
            for pool in rules.pools():
                period = period_of(pool.renew, now)
                spent, charges = self._pools.get((pool.key, dataset, period), (_NOTHING, 0))
                out.append(LimitStatus(pool.kind, pool.name, pool.budget, spent, period, charges))
        return out

    def _limits(
        self, analyst: str, dataset: str, default: Budget, rules: BudgetRules, now: _dt.datetime
    ) -> tuple[list[LimitStatus], bool]:
        """The limits, and whether the analyst's own total has renewed (caller holds the lock)."""
        budget = self.budget(analyst, dataset, default)
        spent = self.spent(analyst, dataset)
        charges = self._charges.get((analyst, dataset), 0)
        period = period_of(rules.renew, now)
        renewed = rules.renew is not None and stale(self._periods.get((analyst, dataset)), period)
        if renewed:
            spent, charges = _NOTHING, 0
        limits = [LimitStatus("analyst", analyst, budget, spent, period, charges)]
        for pool in rules.pools(analyst):
            p = period_of(pool.renew, now)
            total, n = self._pools.get((pool.key, dataset, p), (_NOTHING, 0))
            limits.append(LimitStatus(pool.kind, pool.name, pool.budget, total, p, n))
        return limits, renewed

    def _total_after(self, analyst: str, dataset: str, cost: Cost, default: Budget) -> Cost:
        """The total with ``cost`` added, or :class:`BudgetExhaustedError` if it overspends.

        A statement's check and its charge ask this of the same budget, total and cost: the
        charge takes the check's sum when all three are the very objects it passed with (all
        immutable, so the same total and the same verdict; held here, so no id is reused);
        any charge in between made a new total, and the sum is made again."""
        budget = self.budget(analyst, dataset, default)
        spent = self.spent(analyst, dataset)
        last = self._passed
        if last is not None and last[0] is budget and last[1] is spent and last[2] is cost:
            return last[3]
        validate_cost(cost)
        total = spent + cost
        if not budget.covers(total):
            raise exhausted(analyst, budget, spent, cost)
        self._passed = (budget, spent, cost, total)
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
        rules = rules_of(default)
        with self._lock:
            key = (analyst, dataset)
            if rules is None:
                self._spent[key] = self._total_after(analyst, dataset, cost, default)
                self._charges[key] = self._charges.get(key, 0) + 1
            else:
                validate_cost(cost)
                limits, _ = self._limits(analyst, dataset, default, rules, self._clock())
                refuse_unless_fits(limits, cost)
                own = limits[0]
                self._spent[key] = own.spent + cost
                self._charges[key] = own.charges + 1
                for pool, status in zip(rules.pools(analyst), limits[1:], strict=True):
                    pool_key = (pool.key, dataset, status.period)
                    self._pools[pool_key] = (status.spent + cost, status.charges + 1)
                if rules.renew is not None and own.period > self._periods.get(key, ""):
                    self._periods[key] = own.period
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
