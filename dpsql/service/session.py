"""One analyst's session over the service: their settings, dialect and the statement running.

A session is what every front door opens: the DB-API's Connection, the wire server's
connection, the command line. It holds what is per analyst and per session (settings and the
defaults ``RESET`` returns to, the SQL dialect, the handle that cancels the running statement)
and runs statements through the service one at a time; the budget and the answer cache are the
service's, per analyst, so they are shared by all of an analyst's sessions.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dpsql.engine.api import QueryHandle
from dpsql.service.results import Result
from dpsql.service.settings import Settings, _ResetRequest, reset_setting
from dpsql.sql.dialect import check_dialect
from dpsql.tables import number

LOW_BUDGET = 0.10  # warn when less than this fraction of a budget remains


@dataclass(frozen=True)
class Remaining:
    """An analyst's budget left after a charge: (ε, δ) left and the totals they come from."""

    epsilon: float
    delta: float
    budget_epsilon: float
    budget_delta: float

    @property
    def low(self) -> bool:
        """Less than :data:`LOW_BUDGET` of the ε (or of a nonzero δ) budget remains."""
        eps_low = self.epsilon < LOW_BUDGET * self.budget_epsilon
        delta_low = self.budget_delta > 0 and self.delta < LOW_BUDGET * self.budget_delta
        return eps_low or delta_low

    def __str__(self) -> str:
        return (
            f"remaining epsilon={number(self.epsilon)} of {number(self.budget_epsilon)}, "
            f"delta={number(self.delta)} of {number(self.budget_delta)}"
        )

    def warning(self) -> str:
        return f"less than {LOW_BUDGET:.0%} of the privacy budget remains: {self}"


class Session:
    """One analyst's session over a shared service (``dpsql.pipeline.Service``)."""

    def __init__(self, service: Any, analyst: str, *, dialect: str = "duckdb") -> None:
        self.service = service
        self.analyst = analyst
        self.defaults = Settings.from_policy(service.policy)
        self.settings = Settings.from_policy(service.policy)
        # the SQL dialect statements are read in (dpsql.sql.dialect); RESET keeps it
        self.defaults.dialect = self.settings.dialect = check_dialect(dialect)
        self._handle = QueryHandle()
        self._lock = threading.Lock()

    def run(self, sql: str, parameters: Sequence[Any] | None = None) -> Result:
        """Run one statement (one at a time per session; a new handle for each)."""
        with self._lock:
            self._handle = QueryHandle()
            try:
                return self.service.execute(
                    sql, parameters, self.settings, self.analyst, self._handle
                )
            except _ResetRequest as reset:
                return reset_setting(self.settings, self.defaults, reset.name)

    def describe(self, sql: str, parameters: Sequence[Any] | None = None) -> list[tuple[str, str]]:
        """A statement's result columns (name, type code), without running it or spending."""
        return self.service.describe(sql, self.settings, parameters, analyst=self.analyst)

    def interrupt(self) -> None:
        """Cancel the statement running in this session (from another thread)."""
        self._handle.interrupt()

    def remaining(self) -> Remaining:
        """What the analyst has left now (read after a charge: SHOW budget's figures)."""
        service = self.service
        dataset = service.policy.dataset
        ledger, default = service.ledger, service.policy.budget
        standing = getattr(ledger, "standing", None)  # both at once, where the ledger can
        if standing is not None:
            budget, spent = standing(self.analyst, dataset, default)
        else:
            budget, spent = (
                ledger.budget(self.analyst, dataset, default),
                ledger.spent(self.analyst, dataset),
            )
        left_eps, left_delta = budget.remaining(spent)
        return Remaining(left_eps, left_delta, budget.epsilon, budget.delta)
