"""The arguments of ``dpsql init`` and ``dpsql check``, and init's defaults.

Apart from dpsql.curation.init and .check (which read data through DuckDB and load policies),
so that building the ``dpsql`` parser (``dpsql --help``, ``dpsql --version``) imports neither.
"""

from __future__ import annotations

import argparse

MAX_VALUES = 50  # list a public domain for columns with at most this many distinct values
RARE = 10  # values held by fewer rows (or units) than this are flagged in the draft
KEEP = 0.9  # suggested R and G keep at least this share of rows / (unit, group) pairs


def init_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", nargs="?", help="a CSV or Parquet file")
    p.add_argument("--database", metavar="FILE", help="a DuckDB database file holding --table")
    p.add_argument("--table", metavar="NAME", help="the table of --database to describe")
    p.add_argument("-o", "--output", metavar="FILE", help="write the policy here (default stdout)")
    p.add_argument("--force", action="store_true", help="overwrite an existing -o FILE")
    p.add_argument("--name", help="the table's name in the policy (default: from the source)")
    p.add_argument("--dataset", help="the ledger's dataset name (default: the table name)")
    unit = p.add_mutually_exclusive_group()
    unit.add_argument("--unit", metavar="COL", help="the privacy unit column (default: guessed)")
    unit.add_argument(
        "--no-unit", action="store_true", help="no privacy unit: every row is its own unit"
    )
    p.add_argument(
        "--max-values",
        type=int,
        default=MAX_VALUES,
        metavar="N",
        help=f"suggest a list of values for columns with at most N distinct ({MAX_VALUES})",
    )
    p.add_argument(
        "--keep",
        type=float,
        default=KEEP,
        metavar="SHARE",
        help=f"suggest the least R and G keeping this share of rows and groups ({KEEP})",
    )
    p.add_argument(
        "--rare",
        type=int,
        default=RARE,
        metavar="N",
        help=f"flag listed values held by fewer than N units (or rows) ({RARE})",
    )


def check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("policy", help="privacy policy (TOML)")
    p.add_argument("--database", help="the DuckDB database file holding table sources")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
