"""A Service that records what it planned and what the engine computed, for the audits.

The privacy audits (tests/test_privacy_audit.py, tests/test_mode.py) compare the exact
aggregates and bin counts a plan computed on neighbouring datasets with the mechanism's
output distributions; they read them here instead of each wrapping the engine their own way.
"""

from __future__ import annotations

from typing import Any

from dpsql.pipeline import Service


class RecordingEngine:
    """The service's engine, appending every result it returns to ``results``."""

    def __init__(self, engine: Any, results: list[Any]) -> None:
        self._engine = engine
        self._results = results

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def execute(self, compiled: Any, handle: Any = None) -> Any:
        result = self._engine.execute(compiled, handle)
        self._results.append(result)
        return result


class RecordingService(Service):
    """Records each plan (after :meth:`adjust`, the hook a test breaks a plan with) and each
    exact engine result (a quantile's or MODE's bin counts are its extras)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plans: list[Any] = []
        self.results: list[Any] = []
        self.engine = RecordingEngine(self.engine, self.results)  # type: ignore[assignment]

    def adjust(self, plan: Any) -> Any:
        """The plan to run instead of ``plan`` (unchanged here)."""
        return plan

    def plan(self, query: Any, settings: Any, analyst: str = "") -> Any:
        plan = self.adjust(super().plan(query, settings, analyst))
        self.plans.append(plan)
        return plan
