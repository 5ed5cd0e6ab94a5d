"""The engine contract's data: what an engine returns and how a query is interrupted.

Engines (dpsql.engine.duckdb_engine, dpsql.engine.spark_engine) and the service both depend
on this module; the Engine protocol itself is in dpsql.engine.base.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from dpsql.errors import OperationalError


class Interruptible(Protocol):
    def interrupt(self) -> Any: ...


@dataclass(frozen=True)
class EngineResult:
    """Exact bounded aggregates: one row per present group."""

    key_rows: list[tuple[Any, ...]]
    measures: list[list[int]]  # per measure, per row (Python ints: exact)
    key_types: tuple[str, ...]
    # the plan's extra queries (CompiledQuery.extras): per quantile measure its bin counts, one
    # row per present (group keys..., bin), then per distinct-count measure (keys..., count)
    extras: tuple[EngineResult, ...] = ()


def with_extras(
    main: EngineResult, extras: tuple[Any, ...], execute: Callable[[Any], EngineResult]
) -> EngineResult:
    """``main`` with the results of the compiled query's extra queries (quantile bin counts,
    distinct counts), each run by ``execute``; they hold the main query's secret already
    (CompiledQuery.with_secret), so they bound the very same rows."""
    if not extras:
        return main
    return replace(main, extras=tuple(execute(query) for query in extras))


def canonical_rows(matrix: np.ndarray) -> np.ndarray:
    """The rows of an integer result in lexicographic order: the engine's (hash-table, thread-
    scheduled) row order depends on the data and the run, so nothing downstream (a learner's
    tie-breaks, the order of noise draws) may see it."""
    if matrix.ndim != 2 or len(matrix) < 2:
        return matrix
    return matrix[np.lexsort(matrix.T[::-1])]


class QueryHandle:
    """Lets another thread interrupt the engine query currently running for a connection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cursor: Interruptible | None = None
        self.interrupted = False

    def attach(self, cursor: Interruptible | None) -> None:
        with self._lock:
            self._cursor = cursor

    def interrupt(self) -> None:
        with self._lock:
            self.interrupted = True
            if self._cursor is not None:
                self._cursor.interrupt()


def cancel_check(handle: QueryHandle | None) -> Callable[[], None]:
    """A callable for Python work after the charge (rule-list learning, regression fitting,
    quantile releases) to run at each outer iteration: it raises the 57014 cancel once the
    handle was interrupted (a cancel request or statement_timeout both interrupt it), which
    dpsql.boundary.charged_boundary reports as the uniform charged cancel. A no-op without
    a handle."""
    if handle is None:
        return _never_cancelled

    def check() -> None:
        if handle.interrupted:
            raise OperationalError("query cancelled", sqlstate="57014")

    return check


def _never_cancelled() -> None:
    return None
