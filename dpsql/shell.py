"""``dpsql shell``: an interactive session over the service (dpsql.service.session).

Statements end with ``;`` and may span lines. Backslash commands: ``\\q`` quits, ``\\d`` lists
the policy's tables, ``\\d TABLE`` its columns, ``\\x`` toggles expanded rows, ``\\?`` lists the
commands. In a terminal the prompt is prompt_toolkit's: Tab completes the tables, columns and
functions this analyst may use (the policy's access rules decide, as in ``\\d``), and history
is kept in ``$DPSQL_HISTORY`` (default: ``shell_history`` in the user's data directory, from
platformdirs). Results are drawn to the terminal's width (dpsql.terminal). Piped input runs
the same loop, unprompted, with the plain table style.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from dpsql.errors import Error
from dpsql.frontend.sqltext import split_statements, strip_comments
from dpsql.tables import render

PROMPT, MORE = "dpsql> ", "  ...> "
HELP = """\
  SQL ending with ;   run it (SELECT ..., SET epsilon = 0.5, SHOW budget, EXPLAIN ...)
  \\d                  the policy's tables
  \\d TABLE            a table's columns, bounds and public domains
  \\x                  expanded rows on/off (one line per column, for wide results)
  \\q                  quit (or Ctrl-D)
  \\?                  this list
The SQL grammar: dpsql help grammar."""


# Completed besides the policy's names: dpsql's aggregates and functions, and SQL keywords.
FUNCTIONS = (
    "COUNT", "SUM", "AVG", "MIN", "MAX", "MEDIAN", "PERCENTILE_CONT", "PERCENTILE_DISC",
    "VARIANCE", "VAR_POP", "VAR_SAMP", "STDDEV", "STDDEV_POP", "STDDEV_SAMP", "HISTOGRAM",
    "dp_interval_low", "dp_interval_high", "dp_suppression_probability",
    "FLOOR", "CEIL", "ROUND", "ABS", "COALESCE", "CAST", "EXTRACT", "DATE_TRUNC",
)  # fmt: skip
KEYWORDS = (
    "SELECT", "FROM", "WHERE", "GROUP BY", "ORDER BY", "HAVING", "LIMIT", "AS", "AND", "OR",
    "NOT", "IN", "BETWEEN", "IS NULL", "CASE", "WHEN", "THEN", "ELSE", "END", "DISTINCT",
    "JOIN", "LEFT JOIN", "ON", "WITH", "EXPLAIN", "SET epsilon =", "SHOW budget",
)  # fmt: skip


def history_path() -> Path:
    """``$DPSQL_HISTORY``, else ``shell_history`` in the user's data directory."""
    if os.environ.get("DPSQL_HISTORY"):
        return Path(os.environ["DPSQL_HISTORY"])
    from platformdirs import user_data_path

    return user_data_path("dpsql", appauthor=False) / "shell_history"


def completion_words(session: Any) -> tuple[dict[str, list[str]], tuple[str, ...]]:
    """(table -> its columns, functions and keywords): what this analyst may name, as the
    policy's access rules show it (dpsql.access.visible_tables)."""
    from dpsql.access import visible_tables

    return visible_tables(session.service.policy, session.analyst), FUNCTIONS + KEYWORDS


def completer(session: Any) -> Any:
    """A prompt_toolkit completer of the tables, columns and functions ``session`` may use:
    ``TABLE.`` completes that table's columns; otherwise any name, case-insensitively."""
    from prompt_toolkit.completion import Completer, Completion

    tables, words = completion_words(session)
    columns = sorted({c for cols in tables.values() for c in cols})

    class PolicyCompleter(Completer):
        def get_completions(self, document: Any, complete_event: Any) -> Any:
            word = document.get_word_before_cursor(WORD=True)
            head, dot, partial = word.rpartition(".")
            if dot and head.lower() in tables:
                candidates: list[tuple[str, str]] = [
                    (c, f"{head.lower()} column") for c in tables[head.lower()]
                ]
            else:
                partial = word.lstrip("(,")
                candidates = [
                    *((t, "table") for t in tables),
                    *((c, "column") for c in columns),
                    *((w, "function" if w in FUNCTIONS else "keyword") for w in words),
                ]
            low = partial.lower()
            for text, meta in candidates:
                if text.lower().startswith(low) and text.lower() != low:
                    yield Completion(text, start_position=-len(partial), display_meta=meta)

    return PolicyCompleter()


def prompt_reader(session: Any, *, input: Any = None, output: Any = None) -> Callable[[str], str]:
    """``read(prompt)`` on a prompt_toolkit session: completion from the policy, a history
    file. Raises EOFError on Ctrl-D and KeyboardInterrupt on Ctrl-C, as input() does."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    history: Any
    try:
        path = history_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        history = FileHistory(str(path))
    except OSError:
        history = InMemoryHistory()
    reader: Any = PromptSession(
        completer=completer(session),
        history=history,
        complete_while_typing=False,
        input=input,
        output=output,
    )
    return lambda prompt: reader.prompt(prompt)


@contextlib.contextmanager
def _history(interactive: bool):
    """readline line editing and a history file, when both a terminal and readline exist."""
    if not interactive:
        yield
        return
    try:
        import readline
    except ImportError:  # no readline (Windows): plain input()
        yield
        return
    path = history_path()
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    readline.set_history_length(1000)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            readline.write_history_file(path)


def _complete(buffer: str) -> bool:
    """The buffer ends with a semicolon outside quotes and comments."""
    return strip_comments(buffer).rstrip().endswith(";") and _balanced(buffer)


def _balanced(text: str) -> bool:
    parts = split_statements(text + "\n;")  # an unclosed quote swallows the sentinel
    return bool(parts) and not strip_comments(parts[-1].text).strip().endswith(";")


def describe_tables(session: Any, name: str | None, out: TextIO) -> None:
    from dpsql.access import visible_tables

    policy = session.service.policy
    visible = visible_tables(policy, session.analyst)  # what this analyst may query ([access])
    if not name:
        tables = [
            (t.name, t.privacy_unit or "(each row)", len(visible[t.name]))
            for t in policy.tables.values()
            if t.name in visible
        ]
        render(("table", "privacy unit", "columns"), tables, out)
        return
    table = policy.table(name)
    if table is None or table.name not in visible:
        print(f"no table {name!r}; \\d lists them", file=out)
        return
    rows = []
    for c in table.columns.values():
        if c.name.lower() not in visible[table.name]:
            continue
        bounds = "" if c.lower is None else f"[{c.lower:g}, {c.upper:g}]"
        values = "" if c.values is None else ", ".join(map(str, c.values))
        rows.append((c.name, c.type, "yes" if c.nullable else "no", bounds, values))
    render(("column", "type", "nullable", "bounds", "public values"), rows, out)


def run(
    session: Any,
    args: argparse.Namespace,
    read: Callable[[str], str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """The read-run loop; returns 0 (errors are printed and the session goes on)."""
    from dpsql.cli_output import error_text, run_statement

    out, err = out or sys.stdout, err or sys.stderr
    interactive = read is None and sys.stdin.isatty()
    history = interactive
    if read is None and interactive and sys.stdout.isatty():
        read, history = prompt_reader(session), False  # prompt_toolkit keeps its own history
    elif read is None:
        read = input if interactive else _reader(sys.stdin)
    if interactive:
        print(f"dpsql shell as {session.analyst!r}: \\? for help, \\q to quit", file=err)
    buffer = ""
    expanded = False
    with _history(history):
        while True:
            try:
                line = read(MORE if buffer else PROMPT)
            except EOFError:
                if buffer.strip():
                    print("-- unfinished statement dropped (end it with ;)", file=err)
                return 0
            except KeyboardInterrupt:
                print(file=err)
                buffer = ""
                continue
            if not buffer and line.strip().startswith("\\"):
                word, _, rest = line.strip().partition(" ")
                if word in ("\\q", "\\quit"):
                    return 0
                if word == "\\d":
                    describe_tables(session, rest.strip() or None, out)
                elif word == "\\x":
                    expanded = {"on": True, "off": False}.get(rest.strip().lower(), not expanded)
                    print(f"Expanded display is {'on' if expanded else 'off'}.", file=out)
                else:
                    print(HELP, file=out)
                continue
            if not buffer and line.strip().lower() in ("quit", "exit"):
                return 0
            buffer += line + "\n"
            if not _complete(buffer):
                continue
            statements, buffer = split_statements(buffer), ""
            for statement in statements:
                try:
                    run_statement(
                        session,
                        statement.text.strip(),
                        analyst=session.analyst,
                        fmt="expanded" if expanded and args.format == "table" else args.format,
                        intervals=args.intervals,
                        out=out,
                        err=err,
                    )
                except Error as exc:
                    print(error_text(exc), file=err)
                    break


def _reader(stream: TextIO) -> Callable[[str], str]:
    def read(prompt: str) -> str:
        line = stream.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    return read
