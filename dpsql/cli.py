"""The ``dpsql`` command. Each subsystem registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from typing import TextIO

# Modules exposing ``register(subparsers)``; each adds its subcommands with a handler in
# ``set_defaults(handler=fn)`` where fn(args) -> int exit status.
SUBCOMMAND_MODULES = (
    "dpsql.commands",
    "dpsql.privacy.ledger_cli",
    "dpsql.server.cli",
    "dpsql.curation.cli",
    "dpsql.admin.cli",
)


def build_parser() -> argparse.ArgumentParser:
    from dpsql import __version__
    from dpsql.commands import TRUST_NOTE

    parser = argparse.ArgumentParser(
        prog="dpsql",
        description="Differentially private SQL over a privacy policy.",
        epilog=TRUST_NOTE,
    )
    parser.add_argument("--version", action="version", version=f"dpsql {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(sub)
    return parser


def show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """A warning as the command says it: one line, ``warning: ...``, on stderr; never
    Python's ``file:line: Category: ...`` text. The low-budget BudgetWarning is left out:
    the command reports it in its own words after each charge (commands.report)."""
    from dpsql.errors import BudgetWarning

    if issubclass(category, BudgetWarning):
        return
    text = " ".join(str(message).split())
    print(f"warning: {text}", file=sys.stderr if file is None else file)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. A failure that is not dpsql's own, anywhere (the parser, a handler,
    the output), ends as the one uniform internal error line and exit status 1; the cause goes
    to the ``dpsql`` log (silent unless the operator configures it), never to the terminal."""
    try:
        return _main(argv)
    except (SystemExit, KeyboardInterrupt, BrokenPipeError):
        raise
    except Exception as exc:
        from dpsql.commands import error_text
        from dpsql.errors import Error, internal_error

        if not isinstance(exc, Error):
            logging.getLogger("dpsql").error("internal error in the command", exc_info=exc)
            exc = internal_error()
        print(error_text(exc), file=sys.stderr)
        return 1


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        with warnings.catch_warnings():
            warnings.showwarning = show_warning  # restored when the command ends
            code = int(handler(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (dpsql budget log | head): stop quietly, as cat does. Point
        # stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by the pipe
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
