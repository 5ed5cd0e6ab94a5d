"""An int column's sorted distinct values then None (NULL's label), held as one int64 array.

A store's coded int column (dpsql.engine.columnar.load_clustered) keeps its labels: the unit
column has one a unit. As a tuple of Python ints that was ~36 bytes a unit (an int object and
a tuple slot; 0.35 GiB at 100M rows of 10-row units), here 8. It behaves as the tuple
``(*values, None)`` wherever the store reads labels: its length, an index (a Python int, or
None for the last), ``[:-1]`` (the values alone, as a sequence of the same kind), iteration,
``bisect`` (exact comparisons of Python ints) and ``np.asarray`` (the int64 values, no copy).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np


class IntLabels(Sequence[Any]):
    """``values`` (int64, sorted, distinct), then None when ``null_last``."""

    __slots__ = ("null_last", "values")

    def __init__(self, values: np.ndarray, null_last: bool = True) -> None:
        self.values = np.ascontiguousarray(values, dtype=np.int64)
        self.values.setflags(write=False)
        self.null_last = null_last

    def __len__(self) -> int:
        return len(self.values) + int(self.null_last)

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            if self.null_last and index == slice(None, -1, None):  # the categories
                return IntLabels(self.values, null_last=False)
            return tuple(self)[index]
        n = len(self)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(index)
        return None if i == len(self.values) else int(self.values[i])

    def __iter__(self) -> Iterator[Any]:
        yield from self.values.tolist()
        if self.null_last:
            yield None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IntLabels):
            return self.null_last == other.null_last and np.array_equal(self.values, other.values)
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash((self.null_last, self.values.tobytes()))

    def __repr__(self) -> str:
        return f"IntLabels({len(self.values)} values, null_last={self.null_last})"

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """The values (without the None), for ``np.asarray`` / ``np.array``."""
        if self.null_last:
            raise TypeError("labels with NULL's None: take [:-1] first")
        return self.values if dtype is None else self.values.astype(dtype, copy=False)
