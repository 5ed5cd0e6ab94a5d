"""Statement dialects: the grammar and semantics the analyst's SQL is read in.

Every door parses with sqlglot; the dialect decides what the text *means*:

- ``duckdb`` (the DB-API's and the CLI's default): DuckDB's grammar and semantics, e.g.
  ``7 / 2`` is 3.5.
- ``postgres`` (the wire server: its clients believe they talk to PostgreSQL): PostgreSQL's
  grammar, function names and semantics, e.g. ``7 / 2`` is 3 (integer division),
  ``TO_CHAR(d, 'YYYY-MM')``, ``date_part``, ``INITCAP``, ``$$...$$`` strings.

sqlglot's PostgreSQL reader maps PostgreSQL's spellings onto its own nodes (``TO_CHAR`` with a
date format is ``TimeToStr``, ``date_part`` is ``Extract``), which the binder's whitelist and
the DuckDB generator already know; this module then removes what only PostgreSQL's semantics
say and the bound tree would lose: a division sqlglot marks ``typed`` (PostgreSQL divides two
integers as integers) becomes DuckDB's integer division ``//`` (``exp.IntDiv``, which truncates
toward zero as PostgreSQL does) when both operands are integers by PostgreSQL's typing rules,
and a plain division otherwise. The decision is made on the parsed text and the policy's
declared column types, before binding, so every later step (intervals, domains, compiled
engine SQL, post-processing) sees an explicit node and no step can forget it.

This module imports only sqlglot: the policy's column types come in as a function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import sqlglot
from sqlglot import exp

if TYPE_CHECKING:  # this module imports only sqlglot at run time
    from dpsql.frontend.census import Census

DUCKDB = "duckdb"
POSTGRES = "postgres"
DIALECTS = (DUCKDB, POSTGRES)

# (table name or None for any table, column name) -> the declared types of that column
# ("int", "float", "text", ...): an empty set when no such column is declared.
ColumnTypes = Callable[[str | None, str], set[str]]

#: the integer SQL types (one set: interval arithmetic uses it too)
INTEGER_TYPES = {
    exp.DataType.Type.TINYINT,
    exp.DataType.Type.SMALLINT,
    exp.DataType.Type.INT,
    exp.DataType.Type.BIGINT,
    exp.DataType.Type.UTINYINT,
    exp.DataType.Type.USMALLINT,
    exp.DataType.Type.UINT,
    exp.DataType.Type.UBIGINT,
    exp.DataType.Type.INT128,
}


def check_dialect(name: str) -> str:
    """``name`` as a known dialect (lower case), else ValueError naming the choices."""
    lowered = str(name).strip().lower()
    if lowered in ("postgresql", "pg"):
        lowered = POSTGRES
    if lowered not in DIALECTS:
        raise ValueError(f"unknown SQL dialect {name!r}: use one of {', '.join(DIALECTS)}")
    return lowered


def reader(dialect: str) -> sqlglot.Dialect:
    return sqlglot.Dialect.get_or_raise(dialect)


def to_engine_semantics(
    tree: exp.Expr, dialect: str, column_types: ColumnTypes, census: Census | None = None
) -> exp.Expr:
    """``tree`` as parsed in ``dialect``, with its meaning made explicit for the DuckDB engine.

    In place where possible; returns the (possibly new) root. Every dialect: ``COUNT(DISTINCT
    (col))`` (Power BI writes ``count(distinct("col"))``) loses the parentheses around its
    argument, and ``$$...$$`` strings become plain string literals. PostgreSQL: each division
    sqlglot marked ``typed`` becomes ``//`` or ``/`` (see the module's docstring).

    ``census``: the classes of ``tree``'s nodes (dpsql.frontend.census), when known: a step
    whose nodes the tree has none of is skipped, not walked for.
    """
    if census is not None and census.root is not tree:
        census = None
    distincts: list[exp.Distinct] | None = (
        [] if census is not None and not census.has(exp.Distinct) else None
    )
    for distinct in list(tree.find_all(exp.Distinct)) if distincts is None else distincts:
        if isinstance(distinct.parent, exp.AggFunc):
            for item in list(distinct.expressions):
                inner = item
                while isinstance(inner, exp.Paren):
                    inner = inner.this
                if inner is not item:
                    item.replace(inner)
    raws: list[exp.RawString] | None = (
        [] if census is not None and not census.has(exp.RawString) else None
    )
    for raw in list(tree.find_all(exp.RawString)) if raws is None else raws:  # $$...$$ too
        literal = exp.Literal.string(raw.name)
        literal._meta = raw._meta
        if raw is tree:
            return literal
        raw.replace(literal)
    if dialect != POSTGRES or (census is not None and not census.has(exp.Div)):
        return tree
    typer = _Typer(tree, column_types)
    # innermost first: an outer division's operand may be an inner one (``a / b / c``)
    divisions = [d for d in tree.find_all(exp.Div) if d.args.get("typed")]
    for div in reversed(divisions):
        if typer.integer(div.this) and typer.integer(div.expression):
            node = exp.IntDiv(this=div.this, expression=div.expression)
            node._meta = div._meta
            if div is tree:
                tree = node
            else:
                div.replace(node)
        else:
            div.set("typed", None)
    return tree


def integer_typed(node: exp.Expr, column_types: ColumnTypes) -> bool:
    """Whether ``node`` has an integer type (by the rules of :class:`_Typer`, which DuckDB
    shares for these nodes); False when unknown."""
    return _Typer(node, column_types).integer(node)


class _Typer:
    """PostgreSQL's typing rules, as far as integer-ness goes: which expressions are of an
    integer type (int2/int4/int8). Unknown is "not an integer" (a plain division, DuckDB's
    meaning), so a mistake can only keep the old behaviour, never invent an integer."""

    def __init__(self, root: exp.Expr, column_types: ColumnTypes) -> None:
        self.root = root
        self.column_types = column_types
        self.ctes = {
            cte.alias_or_name.lower(): cte.this
            for cte in root.find_all(exp.CTE)
            if isinstance(cte.this, exp.Select)
        }
        self.visiting: set[int] = set()

    def integer(self, node: exp.Expr | None) -> bool:
        if node is None or id(node) in self.visiting:
            return False
        self.visiting.add(id(node))
        try:
            return self._integer(node)
        finally:
            self.visiting.discard(id(node))

    def _integer(self, node: exp.Expr) -> bool:
        if isinstance(node, exp.Paren | exp.Neg | exp.Abs):
            return self.integer(node.this)
        if isinstance(node, exp.Literal):
            return not node.is_string and node.is_int
        if isinstance(node, exp.Cast | exp.TryCast):
            to = node.args.get("to")
            return isinstance(to, exp.DataType) and to.this in INTEGER_TYPES
        if isinstance(node, exp.Add | exp.Sub | exp.Mul | exp.Mod | exp.IntDiv):
            return self.integer(node.this) and self.integer(node.expression)
        if isinstance(node, exp.Div):
            return bool(node.args.get("typed")) and (
                self.integer(node.this) and self.integer(node.expression)
            )
        if isinstance(node, exp.Length | exp.Count):
            return True
        if isinstance(node, exp.Sum | exp.Min | exp.Max):
            return self.integer(node.this)
        if isinstance(node, exp.Case):
            branches = [i.args.get("true") for i in node.args.get("ifs") or []]
            branches.append(node.args.get("default"))
            return self._all_integer(branches)
        if isinstance(node, exp.Coalesce | exp.Greatest | exp.Least):
            return self._all_integer([node.this, *node.expressions])
        if isinstance(node, exp.Nullif):
            return self.integer(node.this)
        if isinstance(node, exp.Column):
            return self._column(node)
        return False

    def _all_integer(self, nodes: list) -> bool:
        typed = [n for n in nodes if n is not None and not isinstance(n, exp.Null)]
        return bool(typed) and all(self.integer(n) for n in typed)

    def _column(self, col: exp.Column) -> bool:
        name = col.name.lower()
        select = col.find_ancestor(exp.Select)
        sources: list[exp.Expr] = []
        if select is not None:
            from_ = select.args.get("from_") or select.args.get("from")
            if from_ is not None:
                sources.append(from_.this)
            sources += [j.this for j in select.args.get("joins") or []]
            qualifier = col.table.lower() if col.table else None
            if qualifier:
                sources = [s for s in sources if _source_name(s) == qualifier] or sources
        types: set[str] = set()
        found = False
        for source in sources:
            inner: exp.Expr | None = None
            if isinstance(source, exp.Subquery):
                inner = source.this
            elif isinstance(source, exp.Table) and source.name.lower() in self.ctes:
                inner = self.ctes[source.name.lower()]
            if isinstance(inner, exp.Select):
                for item in inner.expressions:
                    if item.alias_or_name.lower() == name:
                        found = True
                        if not self.integer(item.unalias()):
                            return False
                        types.add("int")
                continue
            if isinstance(source, exp.Table):
                declared = self.column_types(source.name, name)
                if declared:
                    found = True
                    types |= declared
        if select is not None and not found:
            # an output alias of the same SELECT (ORDER BY / HAVING / post-processing)
            for item in select.expressions:
                if isinstance(item, exp.Alias) and item.alias.lower() == name:
                    return self.integer(item.this)
        if not found:
            types = self.column_types(None, name)
        return bool(types) and types <= {"int"}


def _source_name(source: exp.Expr) -> str:
    alias = source.args.get("alias")
    if alias is not None and alias.name:
        return alias.name.lower()
    return source.name.lower() if isinstance(source, exp.Table) else ""
