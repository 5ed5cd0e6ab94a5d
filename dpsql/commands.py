"""``dpsql query`` and ``dpsql explain``: the pipeline from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from dpsql.errors import Error


def register(sub: argparse._SubParsersAction) -> None:
    __import__("dpsql.models.cli", fromlist=["register"]).register(sub)  # dpsql model ...
    for name, help_text in (
        ("query", "run a DP query and print the noisy result (spends budget)"),
        ("explain", "show a query's plan: sensitivities, noise, cost (spends nothing)"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("sql", help="the SQL statement (quote it)")
        p.add_argument("--policy", required=True, help="privacy policy (TOML)")
        p.add_argument("--database", default=":memory:", help="DuckDB file holding sources")
        p.add_argument(
            "--engine", choices=("duckdb", "spark"), help="engine (default: the policy's [engine])"
        )
        p.add_argument("--analyst", default="default", help="whose budget to charge")
        p.add_argument("--epsilon", type=float, help="this query's epsilon")
        p.add_argument("--delta", type=float, help="this query's delta")
        p.add_argument("--mechanism", choices=("laplace", "gaussian"))
        p.add_argument(
            "--format", choices=("table", "csv", "json"), default="table", help="output format"
        )
        if name == "query":
            p.add_argument(
                "--intervals", action="store_true", help="print 95%% noise intervals too"
            )
        p.set_defaults(handler=_run, explain=name == "explain")


def _run(args: argparse.Namespace) -> int:
    import dpsql

    try:
        with dpsql.connect(
            args.database, policy=args.policy, analyst=args.analyst, engine=args.engine
        ) as conn:
            cur = conn.cursor()
            for setting in ("epsilon", "delta", "mechanism"):
                value = getattr(args, setting)
                if value is not None:
                    literal = f"'{value}'" if setting == "mechanism" else repr(value)
                    cur.execute(f"SET {setting} = {literal}")
            sql = args.sql if not args.explain else "EXPLAIN " + args.sql
            cur.execute(sql)
            names = [d[0] for d in cur.description or []]
            rows = cur.fetchall() if cur.description else []
            intervals = cur.intervals if getattr(args, "intervals", False) else None
            _print(names, rows, intervals, args.format)
            if cur.cost is not None and not args.explain:
                c = cur.cost
                print(
                    f"-- charged epsilon={c.epsilon:.6g} delta={c.delta:.3g} rho={c.rho:.6g} "
                    f"to {args.analyst!r}",
                    file=sys.stderr,
                )
            elif cur.cached:
                print("-- cached answer: nothing charged", file=sys.stderr)
    except Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _print(names: Sequence[str], rows: Sequence[Sequence[Any]], intervals: Any, fmt: str) -> None:
    if intervals:
        names = [*names, "ci95"]
        rows = [
            (*row, "; ".join(f"[{lo:.6g}, {hi:.6g}]" for lo, hi in (iv for iv in ivs if iv)))
            for row, ivs in zip(rows, intervals, strict=True)
        ]
    if fmt == "json":
        print(json.dumps([dict(zip(names, r, strict=True)) for r in rows], default=str))
        return
    if fmt == "csv":
        import csv

        writer = csv.writer(sys.stdout)
        writer.writerow(names)
        writer.writerows(rows)
        return
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(n)] + [len(c[i]) for c in cells]) for i, n in enumerate(names)]
    print(" | ".join(n.ljust(w) for n, w in zip(names, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for c in cells:
        print(" | ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)))
    print(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
