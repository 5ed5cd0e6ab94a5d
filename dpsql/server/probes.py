"""Zero-row probes: queries that return no rows whatever the data holds.

BI tools learn a query's columns by running it with ``LIMIT 0`` or ``WHERE 1 = 0`` (Tableau,
Superset, JDBC ``ResultSetMetaData``). Such a query releases nothing about the private data,
so it is answered without the pipeline's charge: with the planned DP columns when the query is a
DP aggregate, else from the empty shadow tables (the schema is public). Recognition is purely
syntactic and conservative: a top-level ``LIMIT 0`` or a WHERE clause that is constant false.
"""

from __future__ import annotations

import re

import sqlglot
from sqlglot import exp

# Every probe has a top-level LIMIT 0 or a constant-false WHERE: the word FALSE or a comparison
# of two literals. Most DP queries have neither, and parsing costs milliseconds of the event
# loop's (GIL-held) time per query, so the text rules them out first. This is a superset of what
# the parser accepts (comments are stripped by the parser, so text with a comment is parsed).
_MAYBE = re.compile(r"limit\s+\d|false|[\d'.$]\s*(?:=|<>|!=)\s*[-+\w'.$]|--|/\*", re.IGNORECASE)


def _constant_false(node: exp.Expression | None) -> bool:
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Boolean):
        return node.this is False
    if isinstance(node, exp.EQ | exp.NEQ):
        left, right = node.this, node.expression
        if (
            isinstance(left, exp.Literal)
            and isinstance(right, exp.Literal)
            and left.is_string == right.is_string  # '1' = 1 is true in PostgreSQL: undecided
        ):
            try:
                same = (
                    left.this == right.this
                    if left.is_string
                    else float(left.this) == float(right.this)
                )
            except ValueError:
                return False
            return not same if isinstance(node, exp.EQ) else same
    if isinstance(node, exp.And):
        return _constant_false(node.this) or _constant_false(node.expression)
    return False


def may_be_probe(sql: str) -> bool:
    """False when ``sql`` cannot be a probe, judged from its text alone (cheap)."""
    return _MAYBE.search(sql) is not None


def probe_decision(sql: str) -> tuple[bool, bool]:
    """(is a zero-row probe, is a column probe) from one parse. The parse of a long text takes
    a second of GIL-held time, so the server runs this as the analyst's scheduled work, never on
    its event loop (which only applies the cheap :func:`may_be_probe`)."""
    if not may_be_probe(sql):  # also rules out column probes (its LIMIT \d covers LIMIT 1)
        return False, False
    tree = _parse(sql)
    if tree is None:
        return False, False
    column = _column_probe_tree(tree)
    return column or _probe_tree(tree), column


def is_zero_row_probe(sql: str) -> bool:
    # one parse for both decisions (each used to parse the text again)
    if not may_be_probe(sql):
        return False
    tree = _parse(sql)
    return tree is not None and (_probe_tree(tree) or _column_probe_tree(tree))


def _parse(sql: str) -> exp.Expr | None:
    try:
        return sqlglot.parse_one(sql, read="postgres")
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError):
        return None


COLUMN_PROBE_NOTICE = (
    "dpsql never releases rows: this row-level query is answered with its columns only "
    "(aggregate it to see data)"
)


def column_probe(sql: str) -> bool:
    """``SELECT * FROM … LIMIT 1`` over private tables (how Superset reads a virtual dataset's
    columns when it saves one): a tool reading the columns. dpsql never
    releases rows, so the server answers with the columns, no rows and a NOTICE saying so;
    in process the same query is refused."""
    if not _may_be_column_probe(sql):
        return False
    tree = _parse(sql)
    return tree is not None and _column_probe_tree(tree)


_LIMIT_1 = re.compile(r"limit\s+1\b", re.IGNORECASE)


def _may_be_column_probe(sql: str) -> bool:
    return _LIMIT_1.search(sql) is not None or "--" in sql or "/*" in sql  # cheap


def _column_probe_tree(tree: exp.Expr) -> bool:
    limit = tree.args.get("limit") if isinstance(tree, exp.Select) else None
    value = limit.expression if isinstance(limit, exp.Limit) else None
    if not (isinstance(value, exp.Literal) and value.this == "1"):
        return False  # a row preview (LIMIT 100) stays a clear refusal
    if not all(isinstance(item, exp.Star) for item in tree.expressions):
        return False
    # nothing aggregates anywhere (a wrapper over a DP subquery is a DP query), no table
    # function (dp_rule_list), no DISTINCT or GROUP BY (a key set is a DP query too)
    if tree.find(exp.AggFunc, exp.Group, exp.Distinct, exp.Anonymous) is not None:
        return False
    return (tree.args.get("from_") or tree.args.get("from")) is not None


def relation_probe(sql: str) -> bool:
    """A top-level ``LIMIT 0`` or ``LIMIT 1`` over a relation that aggregates nowhere: the
    pipeline answers such a probe from the relation's plan (dpsql.frontend.bind.parse_probe), or
    refuses it as it would refuse the relation; its refusal stands (no catalog fallback)."""
    tree = _parse(sql)
    if not isinstance(tree, exp.Select):
        return False
    limit = tree.args.get("limit")
    value = limit.expression if isinstance(limit, exp.Limit) else None
    if not (isinstance(value, exp.Literal) and not value.is_string and value.this in ("0", "1")):
        return False
    return tree.find(exp.AggFunc, exp.Group, exp.Having, exp.Distinct, exp.Anonymous) is None


def parsed_probe(sql: str) -> bool:
    """The decision itself, on sqlglot's parse tree."""
    tree = _parse(sql)
    return tree is not None and _probe_tree(tree)


def _probe_tree(tree: exp.Expr) -> bool:
    if not isinstance(tree, exp.Select):
        return False
    limit = tree.args.get("limit")
    if isinstance(limit, exp.Limit):
        value = limit.expression
        if isinstance(value, exp.Literal) and not value.is_string and value.this == "0":
            return True
    where = tree.args.get("where")
    # a constant-false WHERE on a grouped query still yields one row for a global aggregate
    grouped = tree.args.get("group") is not None or any(
        item.find(exp.AggFunc) for item in tree.expressions
    )
    return where is not None and not grouped and _constant_false(where.this)
