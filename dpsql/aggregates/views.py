"""What an aggregate kind reads of a plan, as structural types.

The kinds (dpsql.aggregates) sit below the planner that uses them (dpsql.plan.values) and the
bound statements that name them (dpsql.frontend.statements): they read a plan's measures and an
output's formula, but import neither module, so no import cycle runs through them
(tests/test_layering.py). dpsql.plan.values's frozen ``Plan``, ``Measure`` and
``OutputAggregate`` and dpsql.frontend.statements' ``AggregateCall`` satisfy these protocols; mypy
checks that at every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class CallView(Protocol):
    """An aggregate call (dpsql.frontend.statements.AggregateCall)."""

    @property
    def kind(self) -> str: ...
    @property
    def column(self) -> str | None: ...
    @property
    def shown(self) -> str | None: ...
    @property
    def level(self) -> float | None: ...


class MeasureView(Protocol):
    """One exact aggregate of a plan and its mechanism (dpsql.plan.values.Measure)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def column(self) -> str | None: ...
    @property
    def granularity(self) -> float: ...
    @property
    def center(self) -> int: ...
    @property
    def lo(self) -> int: ...
    @property
    def hi(self) -> int: ...
    @property
    def scale(self) -> int: ...
    @property
    def count(self) -> str | None: ...
    @property
    def mechanism(self) -> Any: ...  # dpsql.privacy: Mechanism, or Unreleased (exact)


class OutputView(Protocol):
    """A released aggregate as a formula over measures (dpsql.plan.values.OutputAggregate)."""

    @property
    def call(self) -> CallView: ...
    @property
    def measures(self) -> tuple[str, ...]: ...
    @property
    def lower(self) -> float | None: ...
    @property
    def upper(self) -> float | None: ...


class PlanView(Protocol):
    """A finished plan's measures (dpsql.plan.annotated.Plan)."""

    @property
    def measures(self) -> Sequence[MeasureView]: ...
    def measure(self, name: str) -> MeasureView: ...
    def quantile_of(self, output: Any) -> Any: ...  # its histogram measure (targets, name)
