"""A statement's answer as every door shows it: the released result, the budget left after its
charge, and the columns of its intervals.

The service's session (:mod:`dpsql.service.session`) returns an :class:`Answer`; the DB-API
cursor, the wire server and the command line each render the same one (PEP 249 rows, protocol
rows and NOTICEs, a table on a terminal), so none of them needs another to get at the warnings,
the intervals or the bias columns, and all of them say the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dpsql.service.results import Result
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


@dataclass(frozen=True)
class Answer:
    """One statement's result with what a door reports beside it.

    ``remaining`` is the analyst's budget read after a charge (None when nothing was charged,
    or when it could not be read: the paid answer is returned all the same) and
    ``budget_warning`` the low-budget warning it calls for, if any; ``confidence`` and
    ``bias_interval`` are the session's settings the statement ran under (the level of its
    intervals, and whether each is followed by its bias columns). A door reads these fields
    after the charge without calling into dpsql (only inside its own charged guard).
    """

    result: Result
    remaining: Remaining | None = None
    confidence: float = 0.95
    bias_interval: bool = False
    budget_warning: str | None = None

    @property
    def description(self) -> list[tuple[str, str]]:
        """(name, type code) of each column; empty for a statement that returns no rows."""
        return self.result.description

    @property
    def rows(self) -> list[tuple[Any, ...]]:
        return self.result.rows

    @property
    def intervals(self) -> list[tuple[tuple[float, float] | None, ...]]:
        return self.result.intervals

    @property
    def biases(self) -> list[tuple[tuple[float, float, float] | None, ...]]:
        """Per row, per column: (bias, low, high) of an aggregate whose bias is estimated."""
        return self.result.biases or [(None,) * len(r) for r in self.result.rows]

    @property
    def cost(self) -> Any:
        """The privacy cost charged (None if cached or free)."""
        return self.result.cost

    @property
    def cached(self) -> bool:
        return self.result.cached

    @property
    def status(self) -> str:
        return self.result.status

    @property
    def bias_notes(self) -> list[str]:
        """What the bounds cut from each released column, one line each (docs/bias.md)."""
        return list(self.result.bias_notes)

    @property
    def warnings(self) -> list[str]:
        """The statement's notes (e.g. why a rule list is short), then the low-budget warning
        when less than :data:`LOW_BUDGET` remains after its charge."""
        out = list(self.result.notes)
        if self.budget_warning is not None:
            out.append(self.budget_warning)
        return out

    @property
    def has_intervals(self) -> bool:
        return any(iv is not None for ivs in self.result.intervals for iv in ivs)

    def interval_columns(self) -> set[int]:
        """The columns with an interval in some row."""
        return {j for ivs in self.result.intervals for j, iv in enumerate(ivs) if iv is not None}

    def interval_description(self) -> list[tuple[str, str]]:
        """:attr:`description` with ``x_low``/``x_high`` after each column with intervals (and
        ``x_bias``, ``x_bias_low``, ``x_bias_high`` under ``SET bias_interval = on``)."""
        columns = self.interval_columns()
        taken = [n for n, _ in self.result.description]
        out: list[tuple[str, str]] = []
        for j, (name, code) in enumerate(self.result.description):
            out.append((name, code))
            if j in columns:
                out.extend((n, "DOUBLE") for n in interval_names(name, taken))
                if self.bias_interval:  # SET bias_interval = on (docs/bias.md)
                    out.extend((n, "DOUBLE") for n in bias_names(name, taken))
        return out

    def rows_with_intervals(self, start: int = 0, stop: int | None = None) -> list[tuple]:
        """Rows ``start:stop``, each released aggregate followed by its interval's low and high
        bound (and its bias columns under ``bias_interval``): :meth:`interval_description`."""
        rows = self.result.rows[start:stop]
        names = [n for n, _ in self.result.description]
        intervals = self.result.intervals[start : start + len(rows)]
        columns = self.interval_columns()
        _, flat = with_intervals(names, rows, intervals, columns)
        if self.bias_interval:  # each interval followed by the bias and its widened interval
            cut = self.biases[start : start + len(rows)]
            flat = [_with_bias(f, b, columns) for f, b in zip(flat, cut, strict=True)]
        return flat


def interval_names(name: str, taken: Sequence[str] = ()) -> tuple[str, str]:
    """The two columns holding ``name``'s interval: ``name_low`` and ``name_high``."""
    low, high = f"{name}_low", f"{name}_high"
    while low in taken or high in taken:  # never shadow a column the query itself returns
        low, high = low + "_", high + "_"
    return low, high


def bias_names(name: str, taken: Sequence[str] = ()) -> tuple[str, str, str]:
    """The columns of ``name``'s bias (``SET bias_interval = on``): the estimate and the
    interval widened by it (docs/bias.md)."""
    cols = (f"{name}_bias", f"{name}_bias_low", f"{name}_bias_high")
    while any(c in taken for c in cols):
        cols = (cols[0] + "_", cols[1] + "_", cols[2] + "_")
    return cols


def _with_bias(flat: tuple[Any, ...], biases: Sequence[Any], columns: set[int]) -> tuple[Any, ...]:
    """A row of :func:`with_intervals` with (bias, low, high) after each interval."""
    out: list[Any] = []
    i = 0
    for j, cut in enumerate(biases):
        if j in columns:
            out.extend(flat[i : i + 3])
            out.extend(cut if cut is not None else (None, None, None))
            i += 3
        else:
            out.append(flat[i])
            i += 1
    return tuple(out)


def with_intervals(
    names: Sequence[str],
    rows: Sequence[Sequence[Any]],
    intervals: Sequence[Sequence[tuple[float, float] | None]],
    columns: set[int] | None = None,
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Columns and rows with each released aggregate followed by its two interval bounds
    (``columns``: which columns have intervals; default, those with one in some row)."""
    if columns is None:
        columns = {j for ivs in intervals for j, iv in enumerate(ivs) if iv is not None}
    out_names: list[str] = []
    for j, name in enumerate(names):
        out_names.append(name)
        if j in columns:
            out_names.extend(interval_names(name, names))
    out_rows = []
    for row, ivs in zip(rows, intervals, strict=True):
        cells: list[Any] = []
        for j, value in enumerate(row):
            cells.append(value)
            if j in columns:
                interval = ivs[j]
                cells.extend(interval if interval is not None else (None, None))
        out_rows.append(tuple(cells))
    return out_names, out_rows
