"""``dpsql query``, ``dpsql explain``, ``dpsql shell``, ``dpsql help`` and ``dpsql plot``.

SQL comes from the argument, ``-f FILE`` or standard input (several statements, separated by
semicolons, run in order and stop at the first error). Results go to stdout in one table
style (or CSV/JSON, with ``x_low``/``x_high`` interval fields); what a statement was charged,
what remains and any warning go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, TextIO

from dpsql.cli_output import error_text, print_rows, report, run_statement
from dpsql.errors import Error

if TYPE_CHECKING:
    from dpsql.service.session import Session

# Re-exported: the printing moved to dpsql.cli_output (shared with dpsql.shell).
__all__ = ["error_text", "print_rows", "report", "run_statement"]

TRUST_NOTE = (
    "Front doors and trust: `dpsql serve` authenticates each analyst (SCRAM passwords, "
    "`dpsql user add`). `dpsql query`, `explain`, `shell`, `plot`, dpsql.connect() and "
    "dpsql:// SQLAlchemy URLs run in the caller's process and trust the caller to name the "
    "analyst: whoever can read the policy's data and write its ledger can act as anyone. "
    "A policy's [privacy] analysts list restricts the names they accept."
)


def _common(p: argparse.ArgumentParser, *, explain: bool) -> None:
    p.add_argument("--policy", required=True, help="privacy policy (TOML)")
    p.add_argument("--database", default=":memory:", help="DuckDB file holding sources")
    p.add_argument(
        "--engine", choices=("duckdb", "spark"), help="engine (default: the policy's [engine])"
    )
    p.add_argument(
        "--analyst",
        default="default",
        help="whose remaining budget EXPLAIN checks (it spends nothing)"
        if explain
        else "whose budget to charge (trusted, not authenticated: see dpsql --help)",
    )
    p.add_argument("--epsilon", type=float, help="this session's epsilon per query")
    p.add_argument("--delta", type=float, help="this session's delta per query")
    p.add_argument("--mechanism", choices=("laplace", "gaussian"))
    p.add_argument("--confidence", type=float, help="level of the noise intervals (default 0.95)")
    p.add_argument(
        "--bias-estimate",
        choices=("on", "off"),
        help="measure what the bounds cut from a share of epsilon (default on; docs/bias.md)",
    )
    p.add_argument(
        "--bias-interval",
        choices=("on", "off"),
        help="with --intervals: add x_bias, x_bias_low, x_bias_high (the interval widened by it)",
    )
    p.add_argument(
        "--format", choices=("table", "csv", "json"), default="table", help="output format"
    )


def register(sub: argparse._SubParsersAction) -> None:
    __import__("dpsql.models.cli", fromlist=["register"]).register(sub)  # dpsql model ...
    for name, help_text in (
        ("query", "run DP queries and print the noisy result (spends budget)"),
        ("explain", "show a query's plan: sensitivities, noise, cost (spends nothing)"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=TRUST_NOTE)
        p.add_argument(
            "sql", nargs="?", help="the SQL statement(s) (quote them); else -f FILE or stdin"
        )
        p.add_argument(
            "-f", "--file", metavar="FILE", help="read the SQL from FILE ('-' for stdin)"
        )
        _common(p, explain=name == "explain")
        if name == "query":
            p.add_argument(
                "--intervals",
                action="store_true",
                help="add each aggregate's noise interval as x_low and x_high columns",
            )
        p.set_defaults(handler=_run, explain=name == "explain")

    p = sub.add_parser(
        "shell",
        help="an interactive SQL session with history (spends budget per query)",
        description="Read statements ending with ';' and run them; \\? lists the commands.",
        epilog=TRUST_NOTE,
    )
    _common(p, explain=False)
    p.add_argument("--intervals", action="store_true", help="show x_low/x_high columns")
    p.set_defaults(handler=_shell)

    from dpsql import helpdocs

    p = sub.add_parser(
        "help",
        help="print documentation that ships with dpsql (e.g. dpsql help grammar)",
        description="Print a document installed with dpsql; without TOPIC, list them.",
    )
    p.add_argument("topic", nargs="?", choices=sorted(helpdocs.topics()), help="the document")
    p.set_defaults(handler=_help)

    p = sub.add_parser(
        "schema",
        help="print the privacy policy's JSON Schema (for editors: dpsql help readme)",
        description="Print the JSON Schema of a privacy policy, generated from the model that "
        "validates it (dpsql.policy_schema; installed as dpsql/policy.schema.json). Editors "
        "that read TOML schemas (taplo, Even Better TOML) use it through a first line "
        "'#:schema ./policy.schema.json' in the policy.",
    )
    p.set_defaults(handler=_schema)

    p = sub.add_parser(
        "prepare",
        help="build (or reuse) each table's prepared store for its data version",
        description="Build the derived layout the bounded plans use (dpsql.engine.prepared; "
        "on Spark, Parquet sorted by unit: dpsql.engine.spark_store), on disk next to the "
        "ledger (or [engine] prepared_dir), and report its build time and size. Later "
        "processes with the same data version reuse it; nothing is released.",
    )
    p.add_argument("--policy", required=True, help="privacy policy (TOML)")
    p.add_argument("--database", default=":memory:", help="DuckDB file holding sources")
    p.add_argument(
        "--memory", action="store_true", help="build in memory only (to time it; kept nowhere)"
    )
    p.set_defaults(handler=_prepare)

    from dpsql import plots

    plots.register(sub)


# -- statements -------------------------------------------------------------------------------


def read_statements(args: argparse.Namespace, stdin: TextIO | None = None) -> list[str] | None:
    """The statements to run: the argument, -f FILE, or piped standard input."""
    from dpsql.frontend.sqltext import split_statements

    stdin = stdin or sys.stdin
    if args.sql is not None and args.file is not None:
        print("error: give the SQL as an argument or with -f, not both", file=sys.stderr)
        return None
    if args.sql is not None:
        text = args.sql
    elif args.file == "-" or (args.file is None and not stdin.isatty()):
        text = stdin.read()
    elif args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            print(f"error: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
            return None
    else:
        print(
            "error: no SQL: give it as an argument, with -f FILE, or on stdin "
            "(dpsql shell for an interactive session)",
            file=sys.stderr,
        )
        return None
    statements = [s.text.strip() for s in split_statements(text)]
    if not statements:
        print("error: the input holds no SQL statement", file=sys.stderr)
        return None
    return statements


def apply_options(session: Any, args: argparse.Namespace) -> None:
    """--epsilon, --delta, --mechanism, --confidence, --bias-estimate, --bias-interval as the
    session's SET statements."""
    words = ("mechanism", "bias_estimate", "bias_interval")
    for setting in ("epsilon", "delta", "mechanism", "confidence", *words[1:]):
        value = getattr(args, setting, None)
        if value is not None:
            literal = f"'{value}'" if setting in words else repr(value)
            session.execute(f"SET {setting} = {literal}")


def _explainable(sql: str) -> bool:
    from dpsql.frontend.sqltext import keywords

    words = keywords(sql, 1)
    return bool(words) and words[0] in ("select", "with", "from")


# -- handlers -----------------------------------------------------------------------------------


def _connect(args: argparse.Namespace) -> Session:
    """The analyst's session over a service of its own for the policy (closed with it)."""
    from dpsql.service.opening import open_session

    return open_session(args.policy, args.database, analyst=args.analyst, engine=args.engine)


def _run(args: argparse.Namespace) -> int:
    statements = read_statements(args)
    if statements is None:
        return 2
    try:
        with _connect(args) as session:
            apply_options(session, args)
            for i, sql in enumerate(statements):
                if i:
                    print(file=sys.stdout)
                if args.explain and _explainable(sql):
                    # the readable plan in a terminal; the table of numbers as CSV/JSON
                    text = args.format == "table"
                    sql = ("EXPLAIN (FORMAT TEXT) " if text else "EXPLAIN ") + sql
                run_statement(
                    session,
                    sql,
                    analyst=args.analyst,
                    fmt=args.format,
                    intervals=getattr(args, "intervals", False),
                    out=sys.stdout,
                    err=sys.stderr,
                )
    except Error as exc:
        print(error_text(exc), file=sys.stderr)
        return 1
    return 0


def _shell(args: argparse.Namespace) -> int:
    from dpsql import shell

    try:
        with _connect(args) as session:
            apply_options(session, args)
            return shell.run(session, args)
    except Error as exc:
        print(error_text(exc), file=sys.stderr)
        return 1


def doc_text(topic: str) -> str:
    """A document shipped in the package (dpsql/docs), read through importlib.resources."""
    from dpsql import helpdocs

    return helpdocs.text(topic)


def _help(args: argparse.Namespace) -> int:
    from dpsql import helpdocs

    if args.topic is None:
        print("dpsql help TOPIC prints a document installed with dpsql:")
        for topic, doc in sorted(helpdocs.topics().items()):
            print(f"  {topic:14}  {helpdocs.title(doc)}")
        return 0
    sys.stdout.write(doc_text(args.topic))
    return 0


def _schema(args: argparse.Namespace) -> int:
    from dpsql.policy_schema import schema_text

    sys.stdout.write(schema_text())
    return 0


def _prepare(args: argparse.Namespace) -> int:
    """dpsql prepare: progress on stderr (a bar over the tables in a terminal, else one line
    per step: dpsql.terminal.step_progress), one line per store on stdout."""
    import dataclasses

    from dpsql.engine.duckdb_engine import DuckDBEngine
    from dpsql.policy import load_policy
    from dpsql.terminal import step_progress

    engine: Any
    try:
        policy = load_policy(args.policy)
        mode = "memory" if args.memory else "disk"
        policy = dataclasses.replace(
            policy, engine=dataclasses.replace(policy.engine, prepared=mode)
        )
        steps = [name for name, table in policy.tables.items() if not table.public]
        with step_progress(sys.stderr, steps) as progress:
            if policy.engine.name == "spark":  # Parquet next to the ledger, or a cached view
                from dpsql.engine.spark_engine import SparkEngine

                engine = SparkEngine(policy, progress=progress)
            else:
                engine = DuckDBEngine(policy, args.database, progress=progress)
    except Error as exc:
        print(error_text(exc), file=sys.stderr)
        return 1
    try:
        for info in engine.stores:
            where = info.path or "memory"
            state = "reused" if info.reused else "built"
            print(
                f"{info.table}\t{state}\t{info.rows} rows\t{info.bytes / 2**20:.1f} MiB\t"
                f"{info.build_seconds:.2f} s\t{where}"
            )
        skipped = [t for t in policy.tables if t not in {i.table for i in engine.stores}]
        for name in skipped:
            print(f"{name}\tno store (public table, or no data version for a disk store)")
    finally:
        engine.close()
    return 0
