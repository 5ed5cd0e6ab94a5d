"""``dpsql check POLICY``: validate a policy against its sources, and say what it releases.

Errors (exit status 1): the policy does not load; a source cannot be read; a declared column
is missing; values do not convert to the declared type (a CSV then fails to load; a Parquet
file or database table would read them as NULL), or an int column holds fractions (they would
be rounded); the engine cannot load the table. Warnings: NULLs in a column declared
``nullable = false``, a column with a public domain whose ``nullable`` is not declared (it
releases no NULL group: the warning says whether NULLs occur), values outside declared bounds
(clamped) or outside a declared list of values, rows without a privacy unit. The counts are
read off the private data: this report is the operator's own view, never an analyst's.

Then, per table, what it will release: its privacy unit and bounds (R, G), the sensitivity of
a COUNT, each column's public facts, and which GROUP BY keys come from a public domain and
which need thresholding.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import duckdb

from dpsql.curation.source import (
    Source,
    SourceError,
    duckdb_type_family,
    quote_ident,
    sql_string,
)
from dpsql.policy import SQL_TYPES, ColumnPolicy, Policy, TablePolicy
from dpsql.sources import display_source, is_glob, is_postgres, is_remote


@dataclass
class Finding:
    level: str  # "error" | "warning" | "note"
    where: str  # tables.T or tables.T.columns.C
    text: str

    def __str__(self) -> str:
        return f"{self.level}: {self.where + ': ' if self.where else ''}{self.text}"


@dataclass
class TableCheck:
    name: str
    source: str
    rows: int | None = None
    findings: list[Finding] = field(default_factory=list)

    def add(self, level: str, column: str | None, text: str) -> None:
        where = f"tables.{self.name}" + (f".columns.{column}" if column else "")
        self.findings.append(Finding(level, where, text))


@dataclass
class Report:
    policy: Policy | None
    tables: list[TableCheck] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)  # policy-wide

    def all_findings(self) -> list[Finding]:
        return self.findings + [f for t in self.tables for f in t.findings]

    @property
    def errors(self) -> int:
        return sum(f.level == "error" for f in self.all_findings())

    @property
    def warnings(self) -> int:
        return sum(f.level == "warning" for f in self.all_findings())


def _literal(value: Any, col_type: str) -> str:
    if col_type == "text":
        return sql_string(str(value))
    if col_type == "date":
        return f"DATE {sql_string(value.isoformat() if isinstance(value, dt.date) else value)}"
    if col_type == "bool":
        return "true" if value else "false"
    return repr(value)


def check_policy(path: str | Path, database: str | None = None) -> Report:
    """Every finding about the policy at ``path`` and its sources."""
    from dpsql.errors import PolicyError
    from dpsql.policy import load_policy

    try:
        policy = load_policy(path)
    except PolicyError as exc:
        return Report(None, findings=[Finding("error", "", str(exc))])
    report = Report(policy)
    db = Path(database).resolve() if database and database != ":memory:" else None
    for table in policy.tables.values():
        report.tables.append(_check_table(policy, table, db))
    if report.errors == 0:
        report.findings += _engine_load(policy, database)
    return report


def _source_of(policy: Policy, table: TablePolicy, db: Path | None) -> Source | str:
    """The table's Source, or why it is not checked."""
    if is_postgres(table.source):
        return "a PostgreSQL table: read by the engine load below (docs/sources.md)"
    if is_remote(table.source) and policy.engine.name == "duckdb":
        return "a remote path: read by the engine load below (docs/sources.md)"
    if table.source_path is not None and is_glob(table.source):
        return "a glob of files: read by the engine load below (docs/sources.md)"
    if table.source_path is not None:
        if table.source_path.is_dir():
            return "a directory of part files (read by Spark): not checked here"
        return Source(path=table.source_path)
    if policy.engine.name == "spark" and "://" in table.source:
        return "a URI read by Spark: not checked here"
    if db is None:
        return ""
    return Source(table=table.source, database=db)


def _check_table(policy: Policy, table: TablePolicy, db: Path | None) -> TableCheck:
    src = _source_of(policy, table, db)
    if isinstance(src, str):
        shown = display_source(table.source)
        where = shown if src else f"table {table.source!r} of --database (not given)"
        tc = TableCheck(table.name, where)
        if src:
            tc.add("note", None, f"source {shown!r} is {src}")
        else:
            tc.add(
                "error",
                None,
                f"source {table.source!r} is not a CSV/Parquet file and no --database was given",
            )
        return tc
    tc = TableCheck(table.name, src.describe())
    try:
        con = src.connect()
    except (SourceError, duckdb.Error) as exc:
        tc.add("error", None, f"cannot read the source: {str(exc).splitlines()[0]}")
        return tc
    try:
        _check_columns(con, src, table, tc)
        if table.privacy_unit is not None and table.joined is None and tc.rows:
            _check_unit(con, src, table, tc)
    except duckdb.Error as exc:
        tc.add("error", None, f"cannot read the source: {str(exc).splitlines()[0]}")
    finally:
        con.close()
    return tc


def _check_columns(
    con: duckdb.DuckDBPyConnection, src: Source, table: TablePolicy, tc: TableCheck
) -> None:
    relation = src.relation(as_engine=True)
    if src.kind == "csv":
        con.execute(f"CREATE TEMP TABLE data AS SELECT * FROM {relation}")
        relation = "data"
    described = con.execute(f"DESCRIBE SELECT * FROM {relation}").fetchall()
    present = {name.lower(): (name, sql_type) for name, sql_type, *_ in described}
    row = con.execute(f"SELECT count(*) FROM {relation}").fetchone()
    tc.rows = int(row[0]) if row else 0
    columns: list[tuple[ColumnPolicy, str, str]] = []
    for col in table.columns.values():
        if col.name not in present:
            tc.add("error", col.name, "declared but not in the source")
            continue
        name, sql_type = present[col.name]
        columns.append((col, name, sql_type))
    undeclared = sorted(n for k, (n, _) in present.items() if k not in table.columns)
    if undeclared:
        tc.add("note", None, f"source columns not declared (never read): {', '.join(undeclared)}")
    if not columns:
        return
    parts: list[str] = []
    plans: list[list[str]] = []
    for col, name, sql_type in columns:
        q = quote_ident(name)
        target = SQL_TYPES[col.type]
        cast = f"TRY_CAST({q} AS {target})"
        family = duckdb_type_family(sql_type)
        checks = {
            "failed": f"count(*) FILTER (WHERE {q} IS NOT NULL AND {cast} IS NULL)",
            "nulls": f"count(*) - count({cast})",
        }
        if col.type == "int" and family != "int":
            d = f"TRY_CAST({q} AS DOUBLE)"
            checks["fractions"] = f"count(*) FILTER (WHERE {d} IS NOT NULL AND {d} <> {cast})"
        if (col.type == "date" and family != "date") or sql_type.upper().startswith("TIMESTAMP"):
            ts = f"TRY_CAST({q} AS TIMESTAMP)"
            checks["times"] = (
                f"count(*) FILTER (WHERE {ts} IS NOT NULL AND {ts} <> CAST({cast} AS TIMESTAMP))"
            )
        if col.bounded:
            checks["below"] = f"count(*) FILTER (WHERE {cast} < {col.lower!r})"
            checks["above"] = f"count(*) FILTER (WHERE {cast} > {col.upper!r})"
        if col.values is not None:
            listed = ", ".join(_literal(v, col.type) for v in col.values)
            checks["outside"] = f"count(*) FILTER (WHERE {cast} NOT IN ({listed}))"
        plans.append(list(checks))
        parts += checks.values()
    row = con.execute(f"SELECT {', '.join(parts)} FROM {relation}").fetchone()
    assert row is not None
    values = list(row)
    for (col, _name, sql_type), plan in zip(columns, plans, strict=True):
        got = {k: int(values.pop(0)) for k in plan}
        _column_findings(tc, src, col, sql_type, got, public=table.public)


def _share(n: int, total: int | None) -> str:
    return f"{n} of {total} rows ({n / total:.2%})" if total else f"{n} rows"


def _column_findings(
    tc: TableCheck,
    src: Source,
    col: ColumnPolicy,
    sql_type: str,
    got: dict[str, int],
    *,
    public: bool = False,
) -> None:
    rows = tc.rows
    family = duckdb_type_family(sql_type)
    if got["failed"]:
        what = (
            "the CSV fails to load"
            if src.kind == "csv"
            else "they would be read as NULL (a lazily read source is cast with TRY_CAST)"
        )
        tc.add(
            "error",
            col.name,
            f"{_share(got['failed'], rows)} do not convert to {col.type} (source type "
            f"{sql_type}): {what}; fix the data or declare another type",
        )
    elif src.kind != "csv" and family != col.type:
        tc.add("note", col.name, f"source type {sql_type} is read as {col.type}")
    if got.get("fractions"):
        tc.add(
            "error",
            col.name,
            f"{_share(got['fractions'], rows)} are not whole numbers and would be rounded: "
            'declare type = "float"',
        )
    if got.get("times"):
        tc.add("warning", col.name, f"{_share(got['times'], rows)} have a time of day, dropped")
    _check_nullable(tc, col, got["nulls"], rows, public=public)
    if got.get("below") or got.get("above"):
        tc.add(
            "warning",
            col.name,
            f"{got.get('below', 0)} rows below lower = {col.lower:g} and "
            f"{got.get('above', 0)} above upper = {col.upper:g}: clamped to the bounds",
        )
    if got.get("outside"):
        tc.add(
            "warning",
            col.name,
            f"{_share(got['outside'], rows)} hold values outside the declared values: no "
            "released group holds them",
        )


def _check_nullable(
    tc: TableCheck, col: ColumnPolicy, nulls: int, rows: int | None, *, public: bool
) -> None:
    """Nullability, declared or not, against the NULLs observed (the curator's view only: an
    undeclared column is released the same whatever the data holds, docs/threat_model.md)."""
    domain = bool(col.values is not None or col.type == "bool" or col.bounded or col.date_range)
    if not col.may_hold_null and nulls:
        tc.add(
            "warning",
            col.name,
            f"declared nullable = false, but {_share(nulls, rows)} are NULL: "
            "they are not in the released domain; declare nullable = true or fill them",
        )
    elif public:
        return
    elif not col.nullable_declared and domain:
        seen = (
            f"{_share(nulls, rows)} are NULL and GROUP BY {col.name} drops them (no NULL "
            "group is released); declare nullable = true to release a NULL group"
            if nulls
            else "no NULL observed: treated as not nullable (GROUP BY releases no NULL group); "
            "declare nullable = false to make it explicit, or nullable = true if NULLs may come"
        )
        tc.add("warning", col.name, f"nullable is not declared; {seen}")
    elif not col.nullable_declared:
        tc.add(
            "note",
            col.name,
            "nullable is not declared: a NULL key is released only by thresholding, like "
            f"any key of a column without a public domain ({'NULLs' if nulls else 'no NULL'} "
            "observed)",
        )
    elif col.nullable and not nulls and domain:
        tc.add(
            "note",
            col.name,
            "declared nullable = true but no NULL observed: GROUP BY releases a NULL group "
            "(a noisy count of nothing while none occurs); nullable = false drops it",
        )


def _check_unit(con: duckdb.DuckDBPyConnection, src: Source, table: TablePolicy, tc: TableCheck):
    relation = "data" if src.kind == "csv" else src.relation(as_engine=True)
    u = quote_ident(table.privacy_unit or "")
    r = table.max_rows_per_unit
    row = con.execute(
        f"SELECT count(*), count(*) FILTER (WHERE n > {r}), coalesce(sum(n), 0), "
        f"coalesce(sum(least(n, {r})), 0) FROM (SELECT count(*) AS n FROM {relation} "
        f"WHERE {u} IS NOT NULL GROUP BY {u})"
    ).fetchone()
    nulls = con.execute(f"SELECT count(*) FROM {relation} WHERE {u} IS NULL").fetchone()
    assert row is not None and nulls is not None
    units, over, total, kept = (int(v) for v in row)
    if nulls[0]:
        tc.add(
            "warning",
            table.privacy_unit,
            f"{_share(int(nulls[0]), tc.rows)} have no privacy unit (NULL)",
        )
    if total:
        tc.add(
            "note",
            None,
            f"{units} units; {over} have more than max_rows_per_unit = {r} rows in all "
            f"(a query without GROUP BY keeps {kept / total:.1%} of rows' weight)",
        )


def _engine_load(policy: Policy, database: str | None) -> list[Finding]:
    """Load every table as the DuckDB engine does (no store, no ledger)."""
    from dpsql.errors import Error

    if policy.engine.name != "duckdb":
        return [Finding("note", "engine", f"engine {policy.engine.name}: load not tried here")]
    from dpsql.engine.duckdb_engine import DuckDBEngine

    quiet = dataclasses.replace(policy, engine=dataclasses.replace(policy.engine, prepared="off"))
    try:
        engine = DuckDBEngine(quiet, database or ":memory:")
    except Error as exc:
        return [Finding("error", "engine", f"the engine cannot load the tables: {exc}")]
    engine.close()
    return []


# -- what each table releases -------------------------------------------------------------------


def _num(x: float) -> str:
    return f"{x:g}"


def group_by(policy: Policy, col: ColumnPolicy) -> str:
    """How GROUP BY on the bare column is released."""
    from dpsql.plan.domains import column_size

    size = column_size(col)
    if size is not None and size <= policy.max_bins:
        what = "grid points" if col.type == "float" and col.values is None else "bins"
        return f"public domain ({size} {what}{', NULL included' if col.nullable else ''})"
    if policy.delta == 0:
        return "refused (no public domain and delta = 0)"
    return "thresholded (noisy unit count must pass tau; costs delta)"


def facts(col: ColumnPolicy) -> str:
    out = []
    if col.bounded:
        out.append(f"[{_num(col.lower or 0)}, {_num(col.upper or 0)}]")  # type: ignore[arg-type]
    if col.date_range is not None:  # a date column's declared days
        out.append(f"[{col.date_range[0]}, {col.date_range[1]}]")
    if col.type == "float" and col.bounded:
        out.append(f"granularity {_num(col.granularity)}")
    if col.values is not None:
        shown = ", ".join(str(v) for v in col.values[:6])
        more = f", … ({len(col.values)})" if len(col.values) > 6 else ""
        out.append(f"values {shown}{more}")
    if col.clip == "auto":
        out.append("clip auto")
    return "; ".join(out) or "-"


def releases(policy: Policy, table: TablePolicy) -> list[str]:
    """What the table releases, as lines of text."""
    out = []
    if table.public:
        out.append(
            f"  public table: {len(table.rows or ())} rows read at connect, no privacy unit, "
            "never charged; its values are public domains"
        )
    else:
        if table.privacy_unit is None:
            unit = "none (each row is its own unit)"
        elif table.joined is not None:
            unit = f"{table.privacy_unit}, reached by {table.joined.description}"
        else:
            unit = table.privacy_unit
        g, r = table.max_groups_per_unit, table.max_rows_per_unit
        out.append(f"  privacy unit: {unit}")
        out.append(
            f"  bounds: R = {r} rows per unit per group, G = {g} groups per unit "
            f"(bounding = {table.bounding})"
        )
        if table.auto_bounds:  # the int fields hold the cap: say what is chosen, and where not
            r_join, g_join = table.unchosen_bounds()
            out.append(
                f"  {' and '.join('R' if b == 'rows' else 'G' for b in table.auto_bounds)} "
                '"auto": chosen per analyst and data version from a DP histogram (at most '
                f"{r if 'rows' in table.auto_bounds else g}, figures below at that cap); joins "
                f"on the unit and per-unit relations plan R = {r_join}, G = {g_join}"
            )
        out.append(
            f"  one unit changes a COUNT by at most G·R = {g * r} in total (L1; L2 "
            f"√G·R = {math.sqrt(g) * r:.3g}); a SUM over [L, U] by R·max(|L|, |U|) per group"
        )
    rows = [("column", "type", "null", "public facts", "GROUP BY")]
    for col in table.columns.values():
        if col.name == table.privacy_unit:
            rows.append((col.name, col.type, "no", "privacy unit", "-"))
            continue
        rows.append(
            (
                col.name,
                col.type,
                ("yes" if col.nullable else "no")
                + ("" if col.nullable_declared else " (not declared)"),
                facts(col),
                group_by(policy, col),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        cells = [row[i].ljust(widths[i]) for i in range(4)]
        out.append("    " + "  ".join(cells) + "  " + row[4])
    return out


def print_report(report: Report, out: TextIO) -> None:
    policy = report.policy
    for f in report.findings:
        print(f, file=out)
    if policy is None:
        print(f"{report.errors} error(s)", file=out)
        return
    budget = policy.budget
    print(
        f"policy {policy.path}: dataset {policy.dataset!r}, per query epsilon = "
        f"{_num(policy.epsilon)}, delta = {_num(policy.delta)}, {policy.mechanism}; each "
        f"analyst's budget epsilon = {_num(budget.epsilon)}, delta = {_num(budget.delta)}",
        file=out,
    )
    print(f"ledger: {policy.ledger_path}", file=out)
    by_name = {t.name: t for t in report.tables}
    for table in policy.tables.values():
        tc = by_name[table.name]
        print(file=out)
        private = "" if table.public else " (private: for the operator)"
        rows = f", {tc.rows} rows{private}" if tc.rows is not None else ""
        print(f"table {table.name}: {tc.source}{rows}", file=out)
        for f in tc.findings:
            print(f"  {f}", file=out)
        for line in releases(policy, table):
            print(line, file=out)
    print(file=out)
    verdict = "FAILED" if report.errors else "ok"
    print(f"{verdict}: {report.errors} error(s), {report.warnings} warning(s)", file=out)


def run(args: argparse.Namespace) -> int:
    report = check_policy(args.policy, args.database)
    print_report(report, sys.stdout)
    if report.errors or (args.strict and report.warnings):
        return 1
    return 0
