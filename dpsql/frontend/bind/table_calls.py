"""SELECTs that are not a DP aggregate over a private table: a DP table function's call
(``FROM dp_rule_list('t', ...)``), a query over a public table alone, and a SELECT with no FROM.
"""

from __future__ import annotations

from typing import Any

from sqlglot import exp

from dpsql.errors import (
    ProgrammingError,
    UndefinedColumnError,
    UndefinedTableError,
)
from dpsql.frontend.bind.post import default_name, is_star_item
from dpsql.frontend.bind.scope import Scope, refusal
from dpsql.frontend.statements import (
    RELEASED,
    SCALAR_NODES,
    PublicSelect,
    RuleListCall,
    to_literal,
)
from dpsql.table_functions import result_columns


def rule_list_call(scope: Scope, tree: exp.Select, call: exp.Anonymous) -> RuleListCall:
    function = call.name.lower()
    args = call.expressions
    if not args or not (isinstance(args[0], exp.Literal) and args[0].is_string):
        raise scope.refuse(
            f"{function} needs the table name first",
            call,
            f"{function}('table', label => 'column', epsilon => 1.0, ...)",
        )
    table = scope.policy.table(args[0].this)
    if table is None:
        raise refusal(
            UndefinedTableError,
            f"unknown table {args[0].this!r}",
            args[0],
            "use a table declared in the policy: " + ", ".join(sorted(scope.policy.tables)),
        )
    arguments: dict[str, Any] = {}
    for arg in args[1:]:
        if (
            isinstance(arg, exp.Kwarg)
            and isinstance(arg.expression, exp.Array)
            and all(isinstance(e, exp.Literal) and e.is_string for e in arg.expression.expressions)
        ):
            # features => ['age', 'smoker']: a list of names
            arguments[arg.this.name.lower()] = [e.this for e in arg.expression.expressions]
            continue
        if not isinstance(arg, exp.Kwarg) or not isinstance(
            arg.expression, exp.Literal | exp.Boolean | exp.Neg
        ):
            raise scope.refuse(
                f"{function} arguments are name => literal",
                arg,
                "e.g. label => 'income', epsilon => 1.0, features => ['age', 'smoker']",
            )
        value_node = arg.expression
        if isinstance(value_node, exp.Neg) and not (
            isinstance(value_node.this, exp.Literal) and not value_node.this.is_string
        ):
            raise scope.refuse(
                f"{function} arguments are name => literal",
                arg,
                "a negative argument is a minus sign before a number, e.g. -1.5",
            )
        if isinstance(value_node, exp.Boolean):
            value: Any = value_node.this
        elif isinstance(value_node, exp.Neg):
            value = -float(value_node.this.this)
        elif value_node.is_string:
            value = value_node.this
        else:
            number = float(value_node.this)
            value = int(number) if number.is_integer() and "." not in value_node.this else number
        arguments[arg.this.name.lower()] = value
    if "label" not in arguments:
        raise refusal(
            ProgrammingError,
            f"{function} needs label => 'column'",
            call,
            f"{function}('{table.name}', label => 'column', epsilon => 1.0)",
        )
    for clause in ("group", "having"):
        if tree.args.get(clause):
            raise scope.refuse(
                f"{clause.upper()} is not supported on {function}",
                tree.args[clause],
                "select its columns, filter with WHERE, sort with ORDER BY",
            )
    names = [c for c, _ in result_columns(function)]
    post = tree.copy()
    post.set("from_", exp.From(this=exp.to_table(RELEASED)))
    for col in post.find_all(exp.Column):
        if col.name.lower() not in names and not any(
            isinstance(e, exp.Alias) and e.alias.lower() == col.name.lower()
            for e in tree.expressions
        ):
            raise refusal(
                UndefinedColumnError,
                f"{function} has no column {col.name!r}",
                col,
                "its columns: " + ", ".join(names),
            )
        col.set("table", None)
    for node in post.walk():
        if isinstance(node, exp.AggFunc | exp.Window | exp.Anonymous | exp.Subquery):
            raise scope.not_allowed(node, f"{function} query")
    return RuleListCall(scope.text, table, arguments, post, function)


def public_table_query(scope: Scope, tree: exp.Select) -> PublicSelect:
    """A query over a public table alone reads public data: answered exactly, free (its
    rows are evaluated here, in the policy's copy of the public table)."""
    assert scope.table is not None
    allowed: tuple[type[exp.Expr], ...] = (
        exp.Select, exp.From, exp.Where, exp.Group, exp.Having, exp.Order, exp.Ordered,
        exp.Limit, exp.Offset, exp.Table, exp.TableAlias, exp.Alias, exp.Star, exp.Distinct,
        exp.Min, exp.Max, exp.Count, exp.Sum, exp.Avg, *SCALAR_NODES,
    )  # fmt: skip
    outputs = {e.alias.lower() for e in tree.expressions if isinstance(e, exp.Alias)}
    for node in tree.walk():
        if isinstance(node, exp.Rand | exp.Anonymous) or not isinstance(node, allowed):
            raise scope.not_allowed(node, f"a query over public table {scope.table.name!r}")
        if (
            isinstance(node, exp.Column)
            and not isinstance(node.this, exp.Star)
            and not (not node.table and node.name.lower() in outputs)
        ):
            scope.column_name(node)
    from dpsql.frontend.joins import public_rows

    query = tree.copy()
    query.set("from_", exp.From(this=exp.to_table(scope.table.name)))
    for column in query.find_all(exp.Column):
        column.set("table", None)
    query.set(
        "expressions",
        [
            e if isinstance(e, exp.Alias) or is_star_item(e)
            else exp.alias_(e, default_name(e, i), quoted=True)
            for i, e in enumerate(query.expressions)
        ],
    )  # fmt: skip
    names, types, rows = public_rows(scope.table, query)
    index = exp.to_identifier("__i")
    selects = [
        exp.select(
            *(
                exp.alias_(exp.cast(to_literal(v), t), n, quoted=True)
                for v, t, n in zip(row, types, names, strict=True)
            ),
            exp.alias_(exp.Literal.number(i), index),
        )
        for i, row in enumerate(rows)
    ] or [
        exp.select(
            *(
                exp.alias_(exp.cast(exp.Null(), t), n, quoted=True)
                for t, n in zip(types, names, strict=True)
            ),
            exp.alias_(exp.Literal.number(0), index),
        ).where(exp.false())
    ]
    union: exp.Expression = selects[0]
    for part in selects[1:]:
        union = exp.union(union, part, distinct=False)
    post = exp.select(*(exp.column(n, quoted=True) for n in names)).from_(
        exp.Subquery(this=union, alias=exp.TableAlias(this=exp.to_identifier("__p")))
    )
    post = post.order_by(exp.column(index))
    return PublicSelect(scope.text, post)


def public_select(scope: Scope, tree: exp.Select) -> PublicSelect:
    for node in tree.walk():
        if isinstance(node, exp.Column):
            raise scope.refuse(
                f"unknown column {node.sql()!r} (no FROM clause)",
                node,
                "add FROM <table>",
            )
        if isinstance(node, exp.AggFunc):
            raise scope.refuse("aggregate without FROM", node, "add FROM <table>")
    for item in tree.expressions:
        scope.check_scalar(item.unalias() if isinstance(item, exp.Alias) else item, "SELECT")
    return PublicSelect(scope.text, tree.copy())
