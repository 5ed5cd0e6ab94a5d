"""The ``dpsql`` command. Each subsystem registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules exposing ``register(subparsers)``; each adds its subcommands with a handler in
# ``set_defaults(handler=fn)`` where fn(args) -> int exit status.
SUBCOMMAND_MODULES = (
    "dpsql.commands",
    "dpsql.privacy.ledger_cli",
    "dpsql.server.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpsql",
        description="Differentially private SQL over a privacy policy.",
    )
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
