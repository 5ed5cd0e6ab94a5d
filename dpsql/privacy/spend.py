"""In-process estimators on the ledger: what a ``fit`` spends is charged, or said out loud.

The scikit-learn style estimators (``DPLinearRegression``, ``DPLogisticRegression``,
``DPGreedyRuleList``) run in the caller's process on data the caller already holds. The SQL
doors charge every release in the analyst's ledger; an estimator has no service around it, so
before this module its ε reached no ledger at all. Now:

- ``ledger=`` given (a dpsql connection, a service with ``analyst=``, or a
  :class:`LedgerAccount`): the fit's cost is checked and charged in that ledger *before* the
  fit reads X (pay before reading, as in the pipeline); a refusal
  (:class:`~dpsql.errors.BudgetExhaustedError`) spends nothing and fits nothing.
- no ledger: the fit runs and emits one :class:`UnrecordedSpendWarning` line naming the ε
  (and δ) spent and the fix. A fit that spends nothing (cost zero) says nothing.

Only duck typing on the door objects: this module sits under the privacy layer and imports no
front door (tests/test_layering.py).
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from typing import Any

from dpsql.errors import ProgrammingError
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.ledger import Ledger


class UnrecordedSpendWarning(UserWarning):
    """An in-process DP estimator spent privacy budget that no ledger records."""


@dataclass(frozen=True)
class LedgerAccount:
    """Where an in-process fit is charged: a ledger, the analyst, the dataset and the budget
    that applies when the ledger holds no override for the analyst (``Ledger.budget``)."""

    ledger: Ledger
    analyst: str
    dataset: str
    budget: Budget

    @classmethod
    def of(cls, door: Any, analyst: str | None = None) -> LedgerAccount:
        """The account of a dpsql connection (its analyst unless ``analyst`` is given) or of a
        Service (``analyst`` required)."""
        found = account(door, analyst)
        assert found is not None  # door is not None
        return found

    # A handle on a shared ledger: scikit-learn's clone deep-copies parameters, and a copy
    # would record a cloned fit's spend in a ledger nobody reads. Copies are the same account.
    def __copy__(self) -> LedgerAccount:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> LedgerAccount:
        return self


def _how() -> str:
    return (
        "pass ledger=<a dpsql connection> (its analyst and budget), ledger=<a Service> with "
        "analyst='name', or ledger=dpsql.privacy.spend.LedgerAccount(ledger, analyst, dataset, "
        "budget)"
    )


def account(ledger: Any, analyst: str | None) -> LedgerAccount | None:
    """The account an estimator's ``ledger=`` / ``analyst=`` arguments name, or None."""
    if ledger is None:
        if analyst is not None:
            raise ProgrammingError(
                "analyst= names whose budget to charge, but no ledger= was given",
                sqlstate="22023",
                construct="analyst",
                hint=_how(),
            )
        return None
    if isinstance(ledger, LedgerAccount):
        if analyst is not None and analyst != ledger.analyst:
            raise ProgrammingError(
                "analyst= differs from the LedgerAccount's analyst",
                sqlstate="22023",
                construct="analyst",
                hint="drop analyst= or make them agree",
            )
        return ledger
    service = getattr(ledger, "service", None)  # a DB-API connection
    if service is not None and hasattr(ledger, "analyst"):
        who = analyst if analyst is not None else ledger.analyst
        return LedgerAccount(service.ledger, who, service.policy.dataset, service.policy.budget)
    if hasattr(ledger, "ledger") and hasattr(ledger, "policy"):  # a Service
        if analyst is None:
            raise ProgrammingError(
                "ledger=<a Service> needs analyst= (whose budget to charge)",
                sqlstate="22023",
                construct="analyst",
                hint="pass analyst='name', or ledger=<a dpsql connection>",
            )
        return LedgerAccount(ledger.ledger, analyst, ledger.policy.dataset, ledger.policy.budget)
    raise ProgrammingError(
        f"ledger= must be a dpsql connection, a Service or a LedgerAccount, not "
        f"{type(ledger).__name__}",
        sqlstate="22023",
        construct="ledger",
        hint=_how(),
    )


def params_text(name: str, params: dict[str, Any]) -> str:
    """``Name(epsilon=1.0, …)`` without ``ledger``/``analyst``: the log entry's text."""
    shown = ", ".join(f"{k}={v!r}" for k, v in params.items() if k not in ("ledger", "analyst"))
    return f"{name}({shown})"


def describe(cost: Cost) -> str:
    """``ε = 1`` or ``ε = 1, δ = 1e-06`` (what a warning and a log entry name)."""
    text = f"ε = {cost.epsilon:.6g}"
    if cost.delta > 0:
        text += f", δ = {cost.delta:.3g}"
    return text


def charge(
    acct: LedgerAccount | None, cost: Cost, what: str, params: str, *, stacklevel: int = 3
) -> None:
    """Charge ``cost`` for ``what`` (e.g. ``DPLogisticRegression.fit``) before the fit reads
    its data, or warn that no ledger records it. ``params`` (the estimator's repr) goes into
    the log entry's text and plan hash, never any data. ``stacklevel``: the frame the warning
    names, the caller of ``fit`` by default (``fit`` calling this directly)."""
    if cost.is_zero:
        return
    text = f"{what}: {params}"
    if acct is None:
        warnings.warn(
            f"{what} spent {describe(cost)} that no ledger records; {_how()}",
            UnrecordedSpendWarning,
            stacklevel=stacklevel,
        )
        return
    plan_hash = hashlib.sha256(text.encode()).hexdigest()
    acct.ledger.charge(
        acct.analyst, acct.dataset, cost, acct.budget, query_text=text, plan_hash=plan_hash
    )


__all__ = [
    "LedgerAccount",
    "UnrecordedSpendWarning",
    "account",
    "charge",
    "describe",
    "params_text",
]
