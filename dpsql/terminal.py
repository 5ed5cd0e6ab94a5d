"""What a person sees in a terminal: tables fitted to its width, expanded rows (``\\x``), and
progress bars, drawn by rich.

Only for a terminal: piped output keeps the plain table style of :mod:`dpsql.tables` (stable
for scripts and diffs), and progress stays one line per step. Cells are formatted by
:func:`dpsql.tables.cell` either way, so numbers read the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

from dpsql.tables import all_numeric, cell


def _console(out: TextIO, width: int | None = None, terminal: bool | None = None) -> Any:
    from rich.console import Console

    return Console(
        file=out,
        width=width,
        force_terminal=terminal,
        highlight=False,
        emoji=False,
        markup=False,
        soft_wrap=False,
    )


def render_fit(
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    out: TextIO,
    *,
    footer: bool = False,
    width: int | None = None,
) -> None:
    """The rows as a table no wider than the terminal (or ``width``): rich shrinks the
    widest columns first and wraps their cells, numbers right-aligned."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    console = _console(out, width)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False)
    for i, name in enumerate(header):
        numeric = all_numeric([r[i] for r in rows])
        table.add_column(
            Text(str(name)),
            justify="right" if numeric else "left",
            overflow="fold",
            no_wrap=False,
        )
    for row in rows:
        table.add_row(*(Text(cell(v)) for v in row))
    console.print(table)
    if footer:
        console.print(Text(f"({len(rows)} row{'' if len(rows) == 1 else 's'})"))


def render_expanded(
    header: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO, *, footer: bool = False
) -> None:
    """One block per row, one line per column (psql's ``\\x``), for results too wide to read
    across."""
    width = max((len(str(h)) for h in header), default=0)
    for n, row in enumerate(rows, 1):
        print(f"-[ RECORD {n} ]" + "-" * max(3, width - 8), file=out)
        for name, value in zip(header, row, strict=True):
            print(f"{str(name).ljust(width)} | {cell(value)}", file=out)
    if footer:
        print(f"({len(rows)} row{'' if len(rows) == 1 else 's'})", file=out)


@contextmanager
def step_progress(
    err: TextIO, steps: Sequence[str], *, terminal: bool | None = None
) -> Iterator[Callable[[str], None]]:
    """A ``progress(text)`` callback for a build of ``steps`` (table names): in a terminal, a
    bar over the steps with the current message and the elapsed time (each message also
    printed above it); otherwise one ``[   t s] message`` line per message."""
    started = time.perf_counter()
    interactive = err.isatty() if terminal is None else terminal
    if not interactive:

        def line(text: str) -> None:
            print(f"[{time.perf_counter() - started:7.1f} s] {text}", file=err, flush=True)

        yield line
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    console = _console(err, terminal=True)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task("starting", total=max(1, len(steps)))
        seen: list[str] = []

        def update(text: str) -> None:
            step = next((s for s in steps if text.startswith(f"{s}:")), None)
            if step is not None and step not in seen:
                if seen:
                    bar.advance(task)
                seen.append(step)
            bar.console.print(f"[{time.perf_counter() - started:7.1f} s] {text}")
            bar.update(task, description=text if len(text) <= 60 else text[:59] + "…")

        yield update
        bar.update(task, completed=max(1, len(steps)), description="done")


@contextmanager
def fit_progress(total: int, description: str, enabled: bool) -> Iterator[Callable[[], None]]:
    """An ``advance()`` callback for a loop of ``total`` steps (a DP-SGD fit, a benchmark
    grid): a rich bar on stderr when ``enabled`` and stderr is a terminal, else a no-op."""
    import sys

    if not enabled or not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        description, BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)
