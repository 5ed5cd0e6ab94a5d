"""Bounds for DuckDB statements an analyst shapes: result caps enforced while fetching, and a
deadline that interrupts the connection.

Catalog queries (:mod:`dpsql.server.catalog`) and post-processing
(:mod:`dpsql.engine.scratch`) run SQL an analyst wrote on DuckDB connections that other analysts
share. A result is counted chunk by chunk as it is fetched, so an oversized answer is refused
before it is held in full; a statement past its deadline is interrupted so it gives its thread
back.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# DuckDB result types whose values have no fixed width (everything else counts FIXED_WIDTH).
_VARIABLE = ("VARCHAR", "BLOB", "BIT", "JSON", "[", "STRUCT", "MAP", "UNION", "LIST")
FIXED_WIDTH = 16


@dataclass(frozen=True)
class ResultCaps:
    """The most rows and (roughly counted) bytes one statement may return."""

    max_rows: int
    max_bytes: int
    chunk: int = 256  # rows fetched between two checks


class LimitExceeded(Exception):
    """A result grew past a cap; ``kind`` is ``"rows"`` or ``"bytes"``."""

    def __init__(self, kind: str, limit: int) -> None:
        super().__init__(f"result exceeds {limit} {kind}")
        self.kind = kind
        self.limit = limit


def value_size(value: Any) -> int:
    """Roughly what a fetched value costs to hold and to send, in bytes."""
    kind = type(value)
    if kind is str or kind is bytes or kind is bytearray:
        return len(value)
    if kind is list or kind is tuple:
        return 8 + sum(value_size(v) for v in value)
    if kind is dict:
        return 8 + sum(value_size(k) + value_size(v) for k, v in value.items())
    return FIXED_WIDTH


def variable_columns(type_names: Sequence[str]) -> list[int]:
    """Indices of the columns whose values must be measured one by one."""
    return [
        i for i, name in enumerate(type_names) if any(part in name.upper() for part in _VARIABLE)
    ]


def fetch_capped(cursor: Any, caps: ResultCaps) -> list[tuple[Any, ...]]:
    """All rows of ``cursor``'s result, fetched ``caps.chunk`` at a time; raises
    :class:`LimitExceeded` as soon as the rows fetched so far pass a cap."""
    description = cursor.description or []
    variable = variable_columns([str(d[1]) for d in description])
    fixed = FIXED_WIDTH * (len(description) - len(variable))
    rows: list[tuple[Any, ...]] = []
    total = 0
    while True:
        chunk = cursor.fetchmany(caps.chunk)
        if not chunk:
            return rows
        rows.extend(chunk)
        if len(rows) > caps.max_rows:
            raise LimitExceeded("rows", caps.max_rows)
        total += fixed * len(chunk)
        for row in chunk:
            for i in variable:
                total += value_size(row[i])
        if total > caps.max_bytes:
            raise LimitExceeded("bytes", caps.max_bytes)


@dataclass(order=True)
class _Entry:
    deadline: float
    seq: int
    interrupt: Callable[[], None] = field(compare=False)
    done: bool = field(default=False, compare=False)
    fired: bool = field(default=False, compare=False)


class Deadline:
    """A running statement's deadline; ``expired`` tells whether it was interrupted for it."""

    def __init__(self, entry: _Entry) -> None:
        self._entry = entry

    @property
    def expired(self) -> bool:
        return self._entry.fired


class Watchdog:
    """Interrupts statements whose deadline passed, from one daemon thread.

    Cheaper than a ``threading.Timer`` (a thread) per statement on the post-processing path.
    An interrupt is only ever sent while its statement is still registered: the statement
    deregisters under the same lock, so a late interrupt cannot hit the next statement run on
    the same connection.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    @contextmanager
    def deadline(self, seconds: float, interrupt: Callable[[], None]) -> Iterator[Deadline]:
        entry = _Entry(time.monotonic() + seconds, next(self._seq), interrupt)
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="dpsql-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        try:
            yield Deadline(entry)
        finally:
            with self._cond:
                entry.done = True

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0].deadline - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                entry = heapq.heappop(self._heap)
                entry.fired = True
                with contextlib.suppress(Exception):  # a closed connection: nothing to stop
                    entry.interrupt()
