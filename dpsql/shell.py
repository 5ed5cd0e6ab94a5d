"""``dpsql shell``: an interactive session over one connection, with readline history.

Statements end with ``;`` and may span lines. Backslash commands: ``\\q`` quits, ``\\d`` lists
the policy's tables, ``\\d TABLE`` its columns, ``\\?`` lists the commands. History is kept in
``$DPSQL_HISTORY`` (default ``~/.dpsql_history``); piped input runs the same way, unprompted.
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
from dpsql.server.sqltext import split_statements, strip_comments
from dpsql.tables import render

PROMPT, MORE = "dpsql> ", "  ...> "
HELP = """\
  SQL ending with ;   run it (SELECT ..., SET epsilon = 0.5, SHOW budget, EXPLAIN ...)
  \\d                  the policy's tables
  \\d TABLE            a table's columns, bounds and public domains
  \\q                  quit (or Ctrl-D)
  \\?                  this list
The SQL grammar: dpsql help grammar."""


def history_path() -> Path:
    return Path(os.environ.get("DPSQL_HISTORY") or Path.home() / ".dpsql_history")


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


def describe_tables(conn: Any, name: str | None, out: TextIO) -> None:
    from dpsql.access import visible_tables

    policy = conn.service.policy
    visible = visible_tables(policy, conn.analyst)  # what this analyst may query ([access])
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
    conn: Any,
    args: argparse.Namespace,
    read: Callable[[str], str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """The read-run loop; returns 0 (errors are printed and the session goes on)."""
    from dpsql.commands import error_text, run_statement

    out, err = out or sys.stdout, err or sys.stderr
    interactive = read is None and sys.stdin.isatty()
    if read is None:
        read = input if interactive else _reader(sys.stdin)
    if interactive:
        print(f"dpsql shell as {conn.analyst!r}: \\? for help, \\q to quit", file=err)
    cur = conn.cursor()
    buffer = ""
    with _history(interactive):
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
                    describe_tables(conn, rest.strip() or None, out)
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
                        cur,
                        statement.text.strip(),
                        analyst=conn.analyst,
                        fmt=args.format,
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
