"""``dpsql init``, ``dpsql check`` and ``dpsql import-smartnoise``: the curator's commands."""

from __future__ import annotations

import argparse
from typing import Any

INIT = (
    "draft a commented policy from a CSV/Parquet file or a DuckDB table (reads the data: "
    "every suggestion is the curator's decision)"
)
CHECK = "validate a policy against its sources and print what each table will release"
IMPORT = "write a dpsql policy from a SmartNoise SQL metadata file (YAML)"


def register(sub: argparse._SubParsersAction) -> None:
    from dpsql.curation.options import check_arguments, init_arguments

    p = sub.add_parser(
        "init",
        help=INIT,
        description=INIT + ". Bounds, value lists and contribution limits become public when "
        "the policy is used: review each 'decide:' line before serving it.",
        epilog="examples: dpsql init data.csv -o policy.toml; "
        "dpsql init --database warehouse.duckdb --table visits -o policy.toml",
    )
    init_arguments(p)
    p.set_defaults(handler=_init)

    p = sub.add_parser(
        "check",
        help=CHECK,
        description=CHECK + ". Errors (an unreadable source, a missing column, values that do "
        "not convert to the declared type) make the exit status 1; NULLs in a column declared "
        "nullable = false and values outside declared bounds or domains are warnings. The "
        "report reads the private data: it is the operator's view, not for analysts.",
    )
    check_arguments(p)
    p.set_defaults(handler=_check)

    p = sub.add_parser(
        "import-smartnoise",
        help=IMPORT,
        description=IMPORT + ": the private_id column becomes privacy_unit, max_ids bounds "
        "both max_rows_per_unit and max_groups_per_unit, lower/upper/nullable carry over, and "
        "settings without a dpsql key are written as comments (dpsql.smartnoise_import).",
        epilog="example: dpsql import-smartnoise fixtures/pums_sample.yaml "
        "fixtures/pums_sample.csv --out pums.toml",
    )
    from dpsql import smartnoise_import

    smartnoise_import.add_arguments(p)
    p.set_defaults(handler=smartnoise_import.run)


def _init(args: Any) -> int:
    from dpsql.curation import init

    return init.run(args)


def _check(args: Any) -> int:
    from dpsql.curation import check

    return check.run(args)
