"""Post-processing: the SELECT list, HAVING, ORDER BY, windows and LIMIT of a DP query,
rewritten over its released table.

:class:`PostBuilder` rewrites each aggregate to a released column ``a<i>`` (bound through
:class:`AggregateBinder`), each GROUP BY key to ``k<i>``, the error-bar functions to their
interval columns and windows to windows over the released rows, and refuses anything that
would read a private row after release (a column outside an aggregate and the keys, a window
over private rows, a non-deterministic function).
"""

from __future__ import annotations

from collections.abc import Callable

from sqlglot import exp

from dpsql.aggregates import QUANTILE_KINDS
from dpsql.errors import (
    PrivacyError,
    ProgrammingError,
)
from dpsql.frontend.bind.calls import AggregateBinder
from dpsql.frontend.bind.scope import Scope
from dpsql.frontend.positions import position_of, snippet, written_name
from dpsql.frontend.statements import (
    AGGREGATE_KINDS,
    ERROR_BAR_FUNCTIONS,
    POST_WINDOW_FUNCTIONS,
    RELEASED,
    SCALAR_NODES,
    AggregateCall,
    GroupKey,
)


class PostBuilder:
    """The post-processing query of ``tree`` over its released table."""

    def __init__(self, scope: Scope, tree: exp.Select, calls: AggregateBinder) -> None:
        self.scope = scope
        self.tree = tree
        self.calls = calls

    def check_windows(self, tree: exp.Select) -> None:
        """Window functions are post-processing of a DP query's released rows, or refused.

        ``SUM(COUNT(*)) OVER (ORDER BY month)`` reads the released counts only, so it costs
        nothing beyond the measurement. A window in a query that aggregates nothing would read
        private rows (``SUM(cost) OVER ()``), and one in WHERE, GROUP BY or HAVING runs before
        (or beside) the aggregation: those are refused, free."""
        windows = list(tree.find_all(exp.Window))
        if not windows:
            return
        example = "SELECT k, COUNT(*), SUM(COUNT(*)) OVER (ORDER BY k) FROM t GROUP BY k"
        aggregates = any(
            node.find_ancestor(exp.Window) is None
            for item in (*tree.expressions, tree.args.get("having"), tree.args.get("order"))
            if item is not None
            for node in item.find_all(exp.AggFunc)
            if not isinstance(node.parent, exp.Window)
        )
        if tree.args.get("group") is None and not aggregates:
            raise self.scope.refuse(
                "window functions over private rows are not allowed: a window may only read "
                "a DP query's released aggregates and GROUP BY keys",
                windows[0],
                "aggregate first and window over the aggregates: " + example,
            )
        for clause in ("where", "group", "having"):
            node = tree.args.get(clause)
            window = node.find(exp.Window) if node is not None else None
            if window is not None:
                word = {"where": "WHERE", "group": "GROUP BY", "having": "HAVING"}[clause]
                raise self.scope.refuse(
                    f"window functions are not allowed in {word}",
                    window,
                    "use a window in the SELECT list or ORDER BY, or filter its result in an "
                    "outer query: SELECT * FROM (" + example + ") AS s WHERE ...",
                )

    def build(
        self,
        keys: list[GroupKey],
        key_nodes: list[exp.Expression],
        aggregates: list[AggregateCall],
    ) -> exp.Select:
        # each key's normal text: ``keys[i].expr`` is ``normalise_columns(key_nodes[i])``
        # (GroupByBinder.bind), whose rendering is ``normal_sql(key_nodes[i])`` by definition,
        # so the keys' own (cached) renderings are the texts; no node is rendered again
        key_sql = {k.sql: i for i, k in enumerate(keys)}
        # a subtree can only render as a key if it is of a key's node class: others are not
        # rendered at all (rendering every subtree was a tenth of planning)
        key_classes = {type(n) for n in key_nodes} | {type(k.expr) for k in keys}

        def rewrite(node: exp.Expression, clause: str) -> exp.Expression:
            def visit(n: exp.Expression) -> exp.Expression:
                if isinstance(n, exp.Anonymous) and n.name.lower() in ERROR_BAR_FUNCTIONS:
                    return self._error_bar(n, aggregates, aliases)
                if isinstance(n, exp.Window):
                    return self._post_window(n, lambda e: rewrite(e, clause))
                if isinstance(n, exp.AggFunc):
                    call = self.calls.aggregate(n, aggregates)
                    if call not in aggregates:
                        aggregates.append(call)
                    return exp.column(f"a{aggregates.index(call)}")
                # Keys hold no aggregate: skip copying and rendering such subtrees.
                if (
                    type(n) in key_classes
                    and isinstance(n, exp.Column | exp.Func | exp.Binary | exp.Case | exp.Paren)
                    and not n.find(exp.AggFunc)
                ):
                    normal = self.scope.resolved_sql(n)
                    if normal in key_sql:
                        return exp.column(f"k{key_sql[normal]}")
                if isinstance(n, exp.Column):
                    if clause == "ORDER BY" and not n.table and n.name.lower() in output_aliases:
                        return n
                    name = self.scope.column_name(n)
                    raise self.scope.refuse(
                        f"column {name!r} is used outside an aggregate and not in GROUP BY",
                        n,
                        f"aggregate it (e.g. COUNT({name})) or add it to GROUP BY",
                    )
                return n

            return node.transform(visit, copy=True)

        output_aliases = {
            e.alias.lower() for e in self.tree.expressions if isinstance(e, exp.Alias)
        }
        aliases = {
            e.alias.lower(): e.this for e in self.tree.expressions if isinstance(e, exp.Alias)
        }
        post = exp.Select()
        for i, item in enumerate(self.tree.expressions):
            inner = item.this if isinstance(item, exp.Alias) else item
            self._check_post(inner, "SELECT")
            name = item.alias if isinstance(item, exp.Alias) else default_name(inner, i)
            # the rewrite is a copy of the item already: aliased as it is, not copied again
            rewritten = rewrite(inner, "SELECT")
            post = post.select(exp.alias_(rewritten, name, quoted=True, copy=False), copy=False)
        # a built From (a string would be parsed: ~0.1 ms)
        released = exp.From(this=exp.Table(this=exp.Identifier(this=RELEASED, quoted=False)))
        post = post.from_(released, copy=False)
        having = self.tree.args.get("having")
        if having is not None:
            self._check_post(having.this, "HAVING")
            condition = having.this
            table_columns = self.scope.table.columns if self.scope.table is not None else {}

            def unalias(n: exp.Expression) -> exp.Expression:
                # HAVING may name a select alias (as DuckDB and PostgreSQL-style tools allow).
                if (
                    isinstance(n, exp.Column)
                    and not n.table
                    and n.name.lower() in aliases
                    and n.name.lower() not in table_columns
                ):
                    return aliases[n.name.lower()].copy()
                return n

            condition = condition.transform(unalias, copy=True)
            post = post.where(rewrite(condition, "HAVING"), copy=False)
        order = self.tree.args.get("order")
        if order is not None:
            ordered = []
            for o in order.expressions:
                self._check_post(o.this, "ORDER BY")
                ordered.append(rewrite(o, "ORDER BY"))
            post.set("order", exp.Order(expressions=ordered))
        if self.tree.args.get("distinct"):
            post.set("distinct", exp.Distinct())
        for arg in ("limit", "offset"):
            node = self.tree.args.get(arg)
            if node is not None:
                post.set(arg, self._row_count(arg, node))
        return post

    def _post_window(
        self, window: exp.Window, rewrite: Callable[[exp.Expression], exp.Expression]
    ) -> exp.Window:
        """``window`` over the released table: its function's arguments, PARTITION BY, ORDER
        BY and frame rewritten by ``rewrite`` (aggregates to a0.., keys to k0.., anything
        else refused), the function itself one of :data:`POST_WINDOW_FUNCTIONS`."""
        func = window.this
        hint = (
            "over released aggregates use SUM/AVG/MIN/MAX/COUNT, RANK, DENSE_RANK, ROW_NUMBER, "
            "PERCENT_RANK, CUME_DIST, NTILE, LAG, LEAD, FIRST_VALUE or LAST_VALUE"
        )
        if type(func) not in POST_WINDOW_FUNCTIONS:
            name = written_name(func).upper()
            raise self.scope.refuse(f"window function {name} is not supported", window, hint)
        if window.args.get("alias") is not None or func.find(exp.Distinct) is not None:
            raise self.scope.refuse(
                "named windows and DISTINCT inside a window function are not supported",
                window,
                "write the window inline: SUM(COUNT(*)) OVER (ORDER BY k)",
            )
        for inner in window.find_all(exp.Window):
            if inner is not window:
                raise self.scope.refuse("window functions cannot be nested", inner, hint)
        out = window.copy()
        new_func = out.this
        try:
            for name, value in list(new_func.args.items()):
                if isinstance(value, exp.Expression) and not isinstance(value, exp.Star):
                    new_func.set(name, rewrite(value))
                elif isinstance(value, list):
                    new_func.set(
                        name, [rewrite(v) if isinstance(v, exp.Expression) else v for v in value]
                    )
            partition = out.args.get("partition_by")
            if partition:
                out.set("partition_by", [rewrite(p) for p in partition])
            for name in ("order", "spec"):
                if out.args.get(name) is not None:
                    out.set(name, rewrite(out.args[name]))
        except PrivacyError as exc:
            raise self.scope.refuse(
                f"a window may only read released aggregates and GROUP BY keys: {exc.message}",
                window,
                "window over an aggregate (SUM(SUM(y)) OVER (...)) or a key in GROUP BY",
            ) from None
        return out

    def _row_count(self, arg: str, node: exp.Expression) -> exp.Expression:
        """LIMIT/OFFSET n: a whole, non-negative number (``CAST(5 AS INTEGER)``, as drivers
        bind ``LIMIT $1::INTEGER``, is 5)."""
        value = node.expression if node.expression is not None else node.this
        if isinstance(value, exp.Cast | exp.TryCast) and value.to.is_type(
            *exp.DataType.INTEGER_TYPES
        ):
            value = value.this
        negative = isinstance(value, exp.Neg)
        number = value.this if negative else value
        whole = (
            isinstance(number, exp.Literal)
            and not number.is_string
            and float(number.this).is_integer()
        )
        if not whole or negative:
            # PostgreSQL's classes: a negative row count (2201W), not a number (42804)
            raise ProgrammingError(
                f"{arg.upper()} must be a whole number >= 0",
                sqlstate="2201W" if whole else "42804",
                construct=snippet(node),
                position=position_of(node),
                hint=f"{arg.upper()} 10",
            )
        out = node.copy()
        out.set("expression" if node.expression is not None else "this", value.copy())
        return out

    def _error_bar(
        self,
        node: exp.Anonymous,
        aggregates: list[AggregateCall],
        aliases: dict[str, exp.Expression],
    ) -> exp.Expression:
        """dp_interval_low/high(agg or alias) and dp_suppression_probability()."""
        name = node.name.lower()
        if name == "dp_suppression_probability":
            if node.expressions:
                raise self.scope.refuse(f"{name}() takes no argument", node, f"{name}()")
            return exp.column("__suppressed")
        args = node.expressions
        target = args[0] if len(args) == 1 else None
        if isinstance(target, exp.Column) and not target.table:
            target = aliases.get(target.name.lower(), target)
        if not isinstance(target, exp.AggFunc):
            raise self.scope.refuse(
                f"{name} takes one aggregate or the alias of one",
                node,
                f"{name}(COUNT(*)) or {name}(n) where n is an aggregate's alias",
            )
        call = self.calls.aggregate(target, aggregates)
        if call not in aggregates:
            aggregates.append(call)
        suffix = "lo" if name == "dp_interval_low" else "hi"
        return exp.column(f"a{aggregates.index(call)}_{suffix}")

    def _check_post(self, node: exp.Expression, clause: str) -> None:
        """Post-processing may use aggregates, keys and deterministic scalar functions."""
        for sub in node.walk():
            if isinstance(sub, exp.AggFunc | exp.Star | exp.Distinct | exp.Column):
                continue
            if isinstance(sub, exp.Anonymous) and sub.name.lower() in ERROR_BAR_FUNCTIONS:
                continue
            if isinstance(sub, exp.Window):
                continue  # its function and clauses: _post_window
            if sub.find_ancestor(exp.Window) is not None and (
                isinstance(sub, exp.Order | exp.Ordered | exp.WindowSpec)
                or (isinstance(sub, POST_WINDOW_FUNCTIONS) and isinstance(sub.parent, exp.Window))
            ):
                continue
            if isinstance(sub, exp.Rand | exp.Anonymous) or not isinstance(sub, SCALAR_NODES):
                parent = sub.parent
                if isinstance(parent, exp.AggFunc | exp.Distinct) and isinstance(
                    sub, exp.Column | exp.Star
                ):
                    continue
                raise self.scope.not_allowed(sub, clause)


def is_star_item(node: exp.Expression) -> bool:
    return isinstance(node, exp.Star) or (
        isinstance(node, exp.Column) and isinstance(node.this, exp.Star)
    )


def default_name(node: exp.Expression, index: int) -> str:
    if isinstance(node, exp.Column):
        return node.name.lower()
    if isinstance(node, exp.AggFunc):
        kind = AGGREGATE_KINDS.get(type(node))
        return kind if kind in QUANTILE_KINDS else type(node).__name__.lower()
    return f"col{index + 1}"
