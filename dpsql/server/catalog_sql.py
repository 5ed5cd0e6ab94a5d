"""PostgreSQL catalog SQL -> DuckDB SQL over the emulated catalog (sqlglot).

Clients write PostgreSQL (``pg_catalog.`` qualifiers, ``::regclass`` casts, ``OPERATOR(~)``,
``= ANY(array)``, array literals). :func:`rewrite` turns one statement into DuckDB SQL over the
shadow's ``pgc``/``infs`` schemas, substitutes per-session values (current_user,
current_database(), current_setting()) and names unaliased columns the way PostgreSQL does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import sqlglot
from sqlglot import exp

from dpsql.frontend.dialect import POSTGRES, to_engine_semantics
from dpsql.server import catalog_schema as cs
from dpsql.server import types as t
from dpsql.server.catalog_limits import CatalogLimits, check_statement
from dpsql.server.failures import ClientError

SERVER_VERSION = "16.0"
VERSION_STRING = f"PostgreSQL {SERVER_VERSION} (dpsql) on x86_64-pc-linux-gnu, 64-bit"

_REG_TYPES = {
    "regclass",
    "regtype",
    "regnamespace",
    "regproc",
    "regprocedure",
    "regrole",
    "regoper",
    "regoperator",
    "regconfig",
    "regdictionary",
    "regcollation",
}
_REG_KIND = {
    "regprocedure": "regproc",
    "regoper": "regproc",
    "regoperator": "regproc",
    "regconfig": "regproc",
    "regdictionary": "regproc",
    "regcollation": "regproc",
}
_TYPE_ALIASES = {
    "oid": "UINTEGER",
    "name": "VARCHAR",
    "char": "VARCHAR",
    "xid": "UINTEGER",
    "cid": "UINTEGER",
    "tid": "VARCHAR",
    "int2vector": "SMALLINT[]",
    "oidvector": "UINTEGER[]",
    "aclitem": "VARCHAR",
    "pg_node_tree": "VARCHAR",
    "regclass": "UINTEGER",
    "regtype": "UINTEGER",
    "bpchar": "VARCHAR",
}

_RENAMES = {
    "json_build_object": "json_object",
    "jsonb_build_object": "json_object",
    "json_agg": "json_group_array",
    "jsonb_agg": "json_group_array",
}

_OPERATOR = re.compile(r"OPERATOR\s*\(\s*pg_catalog\s*\.\s*([^\s)]+)\s*\)", re.IGNORECASE)
_COLLATE = re.compile(
    r"\s+COLLATE\s+(?:pg_catalog\s*\.\s*)?\"?(?:default|C|POSIX)\"?", re.IGNORECASE
)


class CatalogError(ClientError):
    """A catalog query that failed."""


@dataclass(frozen=True)
class SessionInfo:
    """Per-connection values substituted into catalog queries."""

    user: str
    database: str
    pid: int
    settings: Mapping[str, str]


def _lit(value: object) -> exp.Expression:
    if value is None:
        return exp.Null()
    if isinstance(value, bool):
        return exp.Boolean(this=value)
    if isinstance(value, int):
        return exp.Literal.number(value)
    return exp.Literal.string(str(value))


def _func_name(node: exp.Expr) -> str | None:
    if isinstance(node, exp.Anonymous):
        return str(node.this).lower()
    return None


def _rewrite_node(node: exp.Expr, info: SessionInfo) -> exp.Expr:
    # pg_catalog.f(...) -> f(...): our macros shadow DuckDB's via the search path.
    if (
        isinstance(node, exp.Dot)
        and isinstance(node.this, exp.Identifier)
        and node.this.name.lower() in ("pg_catalog", "information_schema")
        and isinstance(node.expression, exp.Func)
    ):
        return _rewrite_node(node.expression, info)
    if isinstance(node, exp.Table):
        db = node.args.get("db")
        dbname = db.name.lower() if db is not None else ""
        name = node.name.lower()
        if not isinstance(node.this, exp.Identifier):
            node.set("db", None)  # a table function such as pg_catalog.generate_series(...)
        elif dbname == "pg_catalog" or (not dbname and name in cs.PG_TABLES):
            node.set("db", exp.to_identifier("pgc"))
        elif dbname == "information_schema":
            node.set("db", exp.to_identifier("infs"))
        elif dbname in ("public", "main"):
            node.set("db", exp.to_identifier("public"))
        node.set("catalog", None)
        return node
    if isinstance(node, exp.Column) and node.args.get("db") is not None:
        # pg_catalog.pg_class.relname -> pg_class.relname (the table keeps its own name)
        if node.args["db"].name.lower() in ("pg_catalog", "information_schema", "public"):
            node.set("db", None)
            node.set("catalog", None)
        return node
    if isinstance(node, exp.CurrentUser | exp.SessionUser):
        return _lit(info.user)
    if (
        isinstance(node, exp.Column)
        and not node.table
        and node.name.lower()
        in (
            "user",
            "current_role",
            "current_user",
            "session_user",
        )
        and not node.this.quoted
    ):
        return _lit(info.user)
    if isinstance(node, exp.CurrentSchema):
        return _lit("public")
    if isinstance(node, exp.CurrentDatabase | exp.CurrentCatalog):
        return _lit(info.database)
    if isinstance(node, exp.CurrentVersion):
        return _lit(VERSION_STRING)
    func = _func_name(node)
    if func in _RENAMES:
        node.set("this", _RENAMES[func])
        return node
    if func == "version":
        return _lit(VERSION_STRING)
    if func == "pg_backend_pid":
        return _lit(info.pid)
    if func in ("current_setting", "dp_current_setting"):
        args = node.expressions
        first = args[0] if args else None
        while isinstance(first, exp.Cast):
            first = first.this
        if isinstance(first, exp.Literal):
            key = first.name.lower()
            if key in info.settings:
                return _lit(info.settings[key])
            missing_ok = len(args) > 1 and args[1].sql().lower() == "true"
            if missing_ok:
                return exp.Null()
            raise CatalogError(f'unrecognized configuration parameter "{first.name}"', "42704")
    if isinstance(node, exp.Collate):
        return node.this
    if isinstance(node, exp.Cast):
        to = node.args.get("to")
        full_name = to.sql(dialect="postgres").lower() if to else ""
        type_name = full_name.replace("pg_catalog.", "").strip('"')
        if type_name in _REG_TYPES:
            kind = _REG_KIND.get(type_name, type_name)
            operand = node.this
            if (isinstance(operand, exp.Literal) and operand.is_string) or isinstance(
                operand, exp.Parameter | exp.Placeholder
            ):
                return exp.Anonymous(this=f"dp_{kind}_oid", expressions=[operand])
            return exp.Anonymous(this=f"dp_{kind}_name", expressions=[operand])
        if type_name.endswith("[]") and (array := _array_literal(node.this)) is not None:
            node.set("this", array)
        if type_name in _TYPE_ALIASES:
            node.set("to", exp.DataType.build(_TYPE_ALIASES[type_name], dialect="duckdb"))
            return node
        if full_name != type_name:
            node.set("to", exp.DataType.build(type_name, dialect="postgres"))
            return node
    if isinstance(node, exp.EQ | exp.NEQ) and isinstance(node.expression, exp.Any | exp.All):
        target = node.expression.this
        if isinstance(target, exp.Paren):
            target = target.this
        if not isinstance(target, exp.Query | exp.Subquery):
            target = _array_literal(target) or target
            contains = exp.Anonymous(this="list_contains", expressions=[target, node.this])
            # x = ANY(list) is membership; x <> ALL(list) is its negation
            if isinstance(node, exp.EQ) and isinstance(node.expression, exp.Any):
                return contains
            if isinstance(node, exp.NEQ) and isinstance(node.expression, exp.All):
                return exp.Not(this=contains)
    return node


def _array_literal(node: exp.Expression) -> exp.Expression | None:
    """A PostgreSQL array literal string '{a,b}' as a DuckDB list, else None."""
    while isinstance(node, exp.Cast):
        node = node.this
    if not (isinstance(node, exp.Literal) and node.is_string and node.name.startswith("{")):
        return None
    try:
        items = t.parse_array_text(node.name)
    except t.ParameterError:
        return None
    return exp.Array(expressions=[_lit(v) for v in items])


def rewrite(
    sql: str,
    info: SessionInfo,
    *,
    source: str | None = None,
    max_series: int = CatalogLimits.max_series,
) -> str:
    """PostgreSQL catalog SQL -> DuckDB SQL over the emulated catalog (one statement).

    The result is checked against the catalog whitelist (:mod:`dpsql.server.catalog_limits`);
    a refusal's position is in ``source``, the client's text (``sql`` may have its parameters
    inlined).
    """
    text = _OPERATOR.sub(r"\1", sql)
    text = _COLLATE.sub("", text)
    try:
        tree = sqlglot.parse_one(text, read="postgres")
    except sqlglot.errors.ParseError as exc:
        raise CatalogError(f"syntax error: {_first_line(str(exc))}", "42601") from None
    if tree is None:
        raise CatalogError("empty statement", "42601")

    _name_columns(tree)
    # PostgreSQL's meaning for DuckDB (7 / 2 is 3, $$...$$): no policy column is read here,
    # so literals and casts decide which divisions are integer ones (dpsql.frontend.dialect)
    tree = to_engine_semantics(tree, POSTGRES, lambda _table, _column: set())

    def fix(node: exp.Expression) -> exp.Expression:
        new = _rewrite_node(node, info)
        # sqlglot does not descend into a replacement node: rewrite its subtree too.
        return new if new is node else new.transform(fix, copy=False)

    tree = tree.transform(fix, copy=False)
    for node in tree.walk():
        node.comments = None  # nothing but the checked tree reaches DuckDB
    check_statement(tree, text, source if source is not None else sql, max_series=max_series)
    return tree.sql(dialect="duckdb")


_FUNC_NAMES = {
    exp.CurrentUser: "current_user",
    exp.SessionUser: "session_user",
    exp.CurrentSchema: "current_schema",
    exp.CurrentDatabase: "current_database",
    exp.CurrentCatalog: "current_catalog",
    exp.CurrentVersion: "version",
}


def _pg_column_name(node: exp.Expr) -> str:
    """The name PostgreSQL gives an unaliased select-list item (FigureColname)."""
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Column):
        return node.name
    if isinstance(node, exp.Cast):
        inner = node.this
        if isinstance(inner, exp.Column | exp.Func | exp.Cast) and not isinstance(
            inner, exp.Literal
        ):
            return _pg_column_name(inner)
        to = node.args.get("to")
        return to.sql(dialect="postgres").lower().split(".")[-1].strip('"') if to else "?column?"
    if isinstance(node, exp.Dot) and isinstance(node.expression, exp.Func):
        return _pg_column_name(node.expression)
    for cls, name in _FUNC_NAMES.items():
        if isinstance(node, cls):
            return name
    if isinstance(node, exp.Anonymous):
        return str(node.this).lower()
    if isinstance(node, exp.Case):
        return "case"
    if isinstance(node, exp.Func) and not isinstance(node, exp.Binary | exp.Unary):
        return node.sql_name().lower()
    return "?column?"


def _name_columns(tree: exp.Expr) -> None:
    """Alias unaliased select items the way PostgreSQL names them (psql shows these names)."""
    select = tree
    while isinstance(select, exp.SetOperation):
        select = select.this
    if not isinstance(select, exp.Select):
        return
    items: list[exp.Expr] = []
    for item in select.expressions:
        if isinstance(item, exp.Alias | exp.Star) or (
            isinstance(item, exp.Column) and isinstance(item.this, exp.Star)
        ):
            items.append(item)
        else:
            items.append(exp.alias_(item, _pg_column_name(item), quoted=True))
    select.set("expressions", items)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text
