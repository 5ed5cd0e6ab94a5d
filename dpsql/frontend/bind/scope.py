"""The FROM's scope: which policy table a SELECT reads, how its names resolve, and which
scalar expressions it may use.

A :class:`Scope` is the binder's view of one flat SELECT (dpsql.frontend.bind): after the frontend
has resolved CTEs, derived tables and joins into one table, the scope checks the FROM, resolves
each column reference against the table's declared columns and qualifiers, and refuses any
construct that is not a deterministic scalar of the accepted grammar (grammar_notes.md). Every
refusal names the construct and its position in the analyst's text and is raised before any
data is read.
"""

from __future__ import annotations

import datetime as dt

from sqlglot import exp

from dpsql.errors import (
    DataError,
    PrivacyError,
    ProgrammingError,
    UndefinedColumnError,
    UndefinedTableError,
)
from dpsql.frontend.intervals import NotNumeric, value_range
from dpsql.frontend.positions import position_of, snippet, written_name
from dpsql.frontend.statements import (
    SCALAR_NODES,
    duckdb_sql,
)
from dpsql.policy import Policy, TablePolicy

FILE_READERS = (
    "read_csv",
    "read_csv_auto",
    "read_parquet",
    "parquet_scan",
    "read_json",
    "read_json_auto",
    "read_text",
    "read_blob",
    "glob",
    "sniff_csv",
    "read_ndjson",
    "iceberg_scan",
    "delta_scan",
)


def refusal(
    cls: type[ProgrammingError], message: str, node: exp.Expr | None, hint: str
) -> ProgrammingError:
    construct = snippet(node) if node is not None else None
    return cls(message, construct=construct, position=position_of(node), hint=hint)


class Scope:
    """One SELECT's table and qualifiers (set by :meth:`bind_from`), and its checks."""

    def __init__(self, text: str, policy: Policy) -> None:
        self.text = text
        self.policy = policy
        self.table: TablePolicy | None = None
        self.qualifiers: set[str] = set()

    def refuse(self, message: str, node: exp.Expr | None, hint: str) -> PrivacyError:
        return refusal(PrivacyError, message, node, hint)  # type: ignore[return-value]

    def bind_from(self, source: exp.Expression) -> None:
        if isinstance(source, exp.Table) and source.args.get("sample") is not None:
            raise self.refuse(
                "TABLESAMPLE is not supported",
                source.args["sample"],
                "filter rows with WHERE; sampling would need its own privacy analysis",
            )
        if isinstance(source, exp.Table):
            # Anything but [db.]name [AS alias] (time travel AT (...), hints, ONLY, column
            # aliases) would be silently ignored by the compiled query: refuse it instead.
            plain = ("this", "db", "catalog", "alias")
            extra = [k for k, v in source.args.items() if v and k not in plain]
            alias = source.args.get("alias")
            if extra or (alias is not None and alias.columns):
                node = source.args[extra[0]] if extra else alias
                node = node[0] if isinstance(node, list) else node
                raise self.refuse(
                    "table modifiers and column aliases are not supported",
                    node if isinstance(node, exp.Expression) else source,
                    f"write FROM {source.name} [AS alias] and name the policy's columns",
                )
        if isinstance(source, exp.Subquery):
            raise self.refuse(
                "subqueries are not supported (for now)", source, "query one table directly"
            )
        if not isinstance(source, exp.Table) or not isinstance(source.this, exp.Identifier):
            name = snippet(source)
            reader = any(r in name.lower() for r in FILE_READERS)
            raise self.refuse(
                ("file readers are not allowed" if reader else "table functions are not allowed")
                + f": {name}",
                source,
                "query a table declared in the privacy policy by its name",
            )
        schema = source.args.get("db")
        catalog = source.args.get("catalog")
        schemas = {"main", "public"} | (
            {self.policy.schema.lower()} if self.policy.schema else set()
        )
        if (catalog is not None and catalog.name.lower() != self.policy.dataset.lower()) or (
            schema is not None and schema.name.lower() not in schemas
        ):
            raise refusal(
                UndefinedTableError,
                f"unknown table {source.sql()!r}",
                source,
                "query a table declared in the policy: " + ", ".join(sorted(self.policy.tables)),
            )
        table = self.policy.table(source.name)
        if table is None:
            raise refusal(
                UndefinedTableError,
                f"unknown table {source.name!r}",
                source,
                "query a table declared in the policy: " + ", ".join(sorted(self.policy.tables)),
            )
        self.table = table
        self.qualifiers = {source.name.lower()}
        if schema is not None:  # SELECT pums.age FROM pums.pums: both spellings qualify
            self.qualifiers.add(f"{schema.name.lower()}.{source.name.lower()}")
        if source.alias:
            self.qualifiers.add(source.alias.lower())

    def column_name(self, col: exp.Column) -> str:
        assert self.table is not None
        if col.table and col.table.lower() not in self.qualifiers:
            raise refusal(
                UndefinedColumnError,
                f"unknown table or alias {col.table!r} in {col.sql()!r}",
                col,
                f"qualify columns with {self.table.name!r} or its alias, or not at all",
            )
        name = col.name.lower()
        if name not in self.table.columns:
            raise refusal(
                UndefinedColumnError,
                f"unknown column {col.name!r} in table {self.table.name!r}",
                col,
                "columns declared in the policy: " + ", ".join(self.table.columns),
            )
        return name

    def normalise_columns(self, node: exp.Expression) -> exp.Expression:
        """Copy of ``node`` with columns unqualified and lower-cased."""

        def fix(n: exp.Expression) -> exp.Expression:
            if isinstance(n, exp.Column):
                return exp.column(self.column_name(n))
            return n

        return node.transform(fix, copy=True)

    def normal_sql(self, node: exp.Expression) -> str:
        """The DuckDB text of :meth:`_normalise_columns` (``node``); without the copy when its
        columns are already as that would make them (unqualified, unquoted, lower-case,
        declared): the same text, and no deep copy of the subtree and its positions."""
        assert self.table is not None
        for col in node.find_all(exp.Column):
            ident = col.this
            if (
                col.table
                or not isinstance(ident, exp.Identifier)
                or ident.quoted
                or ident.name != ident.name.lower()
                or ident.name not in self.table.columns
            ):
                # a fresh copy, read by nothing else: rendered as it is
                return duckdb_sql(self.normalise_columns(node), copy=False)
        return duckdb_sql(node)

    def resolved_sql(self, node: exp.Expression) -> str | None:
        """:meth:`normal_sql` of ``node``, or None where it would refuse a column (one that
        :meth:`column_name` does not resolve), without building that refusal: its position
        and snippet render and tokenize the subtree, for a question whose answer is "no"
        (the post-processing asks it of each select item that might be a key)."""
        assert self.table is not None
        columns = self.table.columns
        for col in node.find_all(exp.Column):
            qualifier = col.table
            if (qualifier and qualifier.lower() not in self.qualifiers) or (
                col.name.lower() not in columns
            ):
                return None
        return self.normal_sql(node)

    def check_scalar(self, node: exp.Expr, clause: str) -> None:
        for sub in node.walk():
            if isinstance(sub, exp.AggFunc):
                raise self.refuse(
                    f"aggregate {snippet(sub)} is not allowed in {clause}",
                    sub,
                    "filter groups on noisy aggregates with HAVING",
                )
            if isinstance(sub, exp.Column):
                if self.table is not None:
                    self.column_name(sub)
                continue
            if isinstance(sub, exp.Rand | exp.Anonymous) or not isinstance(sub, SCALAR_NODES):
                raise self.not_allowed(sub, clause)
            if isinstance(sub, exp.TimeToStr) and self.table is not None:
                self.check_date_format(sub)

    def check_date_format(self, node: exp.TimeToStr) -> None:
        """TO_CHAR / strftime formats a date or timestamp: PostgreSQL's TO_CHAR of a number
        (``TO_CHAR(cost, '999')``) is another function, refused by the name it was written."""
        assert self.table is not None
        try:
            value_range(node.this, self.table)
        except NotNumeric:
            return
        raise self.refuse(
            f"{written_name(node)} of a number is not supported",
            node,
            "TO_CHAR formats a date or timestamp here; CAST a number AS VARCHAR, or ROUND it",
        )

    def check_literal_types(self, node: exp.Expression) -> None:
        """A string literal compared with a non-text column must convert to its type.

        The engine evaluates WHERE under TRY, so a bad literal would otherwise filter out
        every row silently; this error depends on the query text and policy only.
        """
        assert self.table is not None
        for cmp in node.find_all(
            exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE, exp.In, exp.Between
        ):
            column = cmp.this if isinstance(cmp.this, exp.Column) else None
            if isinstance(cmp, exp.In | exp.Between):
                others = cmp.expressions or [cmp.args.get("low"), cmp.args.get("high")]
            else:
                others = [cmp.expression]
                if column is None and isinstance(cmp.expression, exp.Column):
                    column, others = cmp.expression, [cmp.this]
            if column is None or column.name.lower() not in self.table.columns:
                continue
            spec = self.table.columns[column.name.lower()]
            for other in others:
                if (
                    isinstance(other, exp.Literal)
                    and other.is_string
                    and not _converts(other.this, spec.type)
                ):
                    raise DataError(
                        f"invalid {spec.type} value {other.this!r} for column {column.name!r}",
                        sqlstate="22P02",
                        construct=snippet(other),
                        position=position_of(other),
                        hint=f"compare {column.name} with a literal of type {spec.type}",
                    )

    def not_allowed(self, node: exp.Expr, clause: str) -> PrivacyError:
        # the function's name as the analyst wrote it (TO_CHAR, not the DuckDB it maps to)
        name = written_name(node) if isinstance(node, exp.Func) else ""
        kind = "function" if isinstance(node, exp.Func) else "construct"
        lowered = name.lower()
        if lowered in FILE_READERS:
            return self.refuse(
                f"file reader {name} is not allowed", node, "query tables declared in the policy"
            )
        if isinstance(node, exp.Rand | exp.CurrentDate | exp.CurrentTimestamp) or lowered in (
            "now",
            "random",
            "uuid",
            "gen_random_uuid",
            "current_setting",
            "setseed",
        ):
            return self.refuse(
                f"non-deterministic or system function {snippet(node)} is not allowed in {clause}",
                node,
                "use literal values (e.g. DATE '2025-01-01') instead",
            )
        label = name or f"`{snippet(node)}`"
        return self.refuse(
            f"{kind} {label} is not allowed in {clause}",
            node,
            "see `dpsql help grammar` for the accepted functions and operators",
        )


def _converts(text: str, col_type: str) -> bool:
    """Whether a string literal converts to a column type (as DuckDB's implicit cast would)."""
    value = text.strip()
    try:
        if col_type == "int":
            return float(value).is_integer()
        if col_type == "float":
            float(value)
        elif col_type == "date":
            dt.date.fromisoformat(value)
        elif col_type == "bool":
            return value.lower() in ("true", "false", "t", "f", "1", "0", "yes", "no", "y", "n")
    except ValueError:
        return False
    return True
