"""One analyst's session over the service: their settings, dialect and the statement running.

A session is what every front door opens, each over the service directly: the DB-API's
Connection, the wire server's connection (``dpsql.server``), the command line
(``dpsql.commands``, ``dpsql.shell``). It holds what is per analyst and per session (settings
and the defaults ``RESET`` returns to, the SQL dialect, the handle that cancels the running
statement) and runs statements through the service one at a time; the budget and the answer
cache are the service's, per analyst, so they are shared by all of an analyst's sessions.
:meth:`Session.execute` returns the :class:`~dpsql.service.answer.Answer` every door renders.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from dpsql.engine.api import QueryHandle
from dpsql.frontend.dialect import check_dialect
from dpsql.service.answer import LOW_BUDGET as LOW_BUDGET
from dpsql.service.answer import Answer, Remaining
from dpsql.service.results import Result
from dpsql.service.settings import ResetRequest, Settings, reset_setting

log = logging.getLogger("dpsql")


class Session:
    """One analyst's session over a shared service (``dpsql.pipeline.Service``)."""

    def __init__(
        self, service: Any, analyst: str, *, dialect: str = "duckdb", owns_service: bool = False
    ) -> None:
        self.service = service
        self.analyst = analyst
        self.owns_service = owns_service  # close() closes the service too (a one-session door)
        self.closed = False
        self.defaults = Settings.from_policy(service.policy)
        self.settings = Settings.from_policy(service.policy)
        # the SQL dialect statements are read in (dpsql.frontend.dialect); RESET keeps it
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
            except ResetRequest as reset:
                return reset_setting(self.settings, self.defaults, reset.name)

    def execute(self, sql: str, parameters: Sequence[Any] | None = None) -> Answer:
        """Run one statement and return its answer with the budget left after its charge (read
        only when it was charged) and the interval settings it ran under."""
        settings = self.settings
        confidence, bias_interval = settings.confidence, settings.bias_interval == "on"
        committed = getattr(self.service.ledger, "committed_standing", None)
        if committed is not None:  # drop what an earlier statement left in this thread
            committed(self.analyst, self.service.policy.dataset)
        result = self.run(sql, parameters)
        remaining, warning = None, None
        if result.cost is not None:
            # the answer was paid for and is returned whatever happens to this report about
            # it (like dpsql.boundary.remember_paid); the operator's log has the cause
            try:
                remaining = self.remaining(after_charge=True)
                warning = remaining.warning() if remaining.low else None
            except Exception:
                log.error("the budget left could not be read after a charged answer", exc_info=True)
                remaining, warning = None, None
        return Answer(result, remaining, confidence, bias_interval, warning)

    def describe(self, sql: str, parameters: Sequence[Any] | None = None) -> list[tuple[str, str]]:
        """A statement's result columns (name, type code), without running it or spending."""
        return self.service.describe(sql, self.settings, parameters, analyst=self.analyst)

    def interrupt(self) -> None:
        """Cancel the statement running in this session (from another thread)."""
        self._handle.interrupt()

    def remaining(self, *, after_charge: bool = False) -> Remaining:
        """What the analyst has left now (read after a charge: SHOW budget's figures).

        ``after_charge``: right after a statement that this thread charged, whose charge
        committed the analyst's budget and new total (``committed_standing``, where the
        ledger keeps them): those, without reading the ledger again."""
        service = self.service
        dataset = service.policy.dataset
        ledger, default = service.ledger, service.policy.budget
        committed = getattr(ledger, "committed_standing", None) if after_charge else None
        found = committed(self.analyst, dataset) if committed is not None else None
        standing = getattr(ledger, "standing", None)  # both at once, where the ledger can
        if found is not None:
            budget, spent = found
        elif standing is not None:
            budget, spent = standing(self.analyst, dataset, default)
        else:
            budget, spent = (
                ledger.budget(self.analyst, dataset, default),
                ledger.spent(self.analyst, dataset),
            )
        left_eps, left_delta = budget.remaining(spent)
        return Remaining(left_eps, left_delta, budget.epsilon, budget.delta)

    def close(self) -> None:
        """End the session (and the service, when the session owns it)."""
        if not self.closed:
            self.closed = True
            if self.owns_service:
                self.service.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
