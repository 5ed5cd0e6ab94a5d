"""How the command line prints one statement's answer: its rows (table, CSV, JSON or
expanded) on stdout, and what it was charged, what remains and its notes on stderr; and an
error in the command's words.

Shared by ``dpsql query`` / ``dpsql explain`` (dpsql.commands) and ``dpsql shell``
(dpsql.shell), below both, so neither imports the other for it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from dpsql.errors import Error, door
from dpsql.tables import number, render, tidy

if TYPE_CHECKING:
    from dpsql.service.answer import Answer


@door
def run_statement(
    session: Any,
    sql: str,
    *,
    analyst: str,
    fmt: str,
    intervals: bool,
    out: TextIO,
    err: TextIO,
) -> None:
    """Run one statement on the analyst's session over the service
    (:class:`dpsql.service.session.Session`) and print its rows (out) and what it cost (err)."""
    answer = session.execute(sql)
    if answer.description:
        if intervals and answer.has_intervals:
            names = [name for name, _ in answer.interval_description()]
            rows = answer.rows_with_intervals()
        else:
            names = [name for name, _ in answer.description]
            rows = answer.rows
        if names == ["QUERY PLAN"] and fmt == "table":  # EXPLAIN (FORMAT TEXT): as written
            for (line,) in rows:
                print(line, file=out)
        else:
            print_rows(names, rows, fmt, out)
    report(answer, analyst, err)


def report(answer: Answer, analyst: str, err: TextIO) -> None:
    """The charge and what remains, a cached replay, notes and the low-budget warning."""
    if answer.cost is not None:
        c = answer.cost
        line = (
            f"-- charged epsilon={number(c.epsilon)} delta={number(c.delta)} "
            f"rho={number(c.rho)} to {analyst!r}"
        )
        if answer.remaining is not None:
            line += f"; {answer.remaining}"
        print(line, file=err)
    elif answer.cached:
        print("-- cached answer: nothing charged", file=err)
    for message in answer.warnings:
        print(f"-- warning: {message}", file=err)
    for note in answer.bias_notes:  # what the bounds cut (docs/bias.md)
        print(f"-- {note}", file=err)
    if answer.has_intervals and answer.confidence != 0.95:
        print(f"-- intervals at confidence {number(answer.confidence)}", file=err)


def print_rows(names: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str, out: TextIO) -> None:
    if fmt == "json":
        records = [dict(zip(names, map(tidy, r), strict=True)) for r in rows]
        print(json.dumps(records, default=str), file=out)
    elif fmt == "csv":
        import csv

        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(names)
        writer.writerows(["" if v is None else tidy(v) for v in r] for r in rows)
    elif fmt == "expanded":  # the shell's \x
        from dpsql.terminal import render_expanded

        render_expanded(names, rows, out, footer=True)
    elif _isatty(out):  # a person reads it: fit the terminal's width (dpsql.terminal)
        from dpsql.terminal import render_fit

        render_fit(names, rows, out, footer=True)
    else:
        render(names, rows, out, footer=True)


def _isatty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


def error_text(exc: Error) -> str:
    """The error as the command prints it; a hint naming the grammar notes says how to read
    them from the installed package."""
    text = f"error: {exc}"
    if "grammar_notes.md" in text:
        text += " (`dpsql help grammar` prints them)"
    return text
