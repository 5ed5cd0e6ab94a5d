"""Derived tables and CTEs: flatten row-level relations into one query over a policy table.

A row-level derived table (``FROM (SELECT cols, exprs FROM t WHERE c) AS x``) or CTE is a
*Project* over a *Filter* over a *Scan*: every output row is one input row, so one privacy
unit still owns exactly the rows it owned (stability 1; see dpsql/plan/relational.py). Such a
relation is inlined: the outer query's references to ``x.col`` become the inner expressions,
the inner WHERE is ANDed before the outer one, and the result is an ordinary single-table
query that the binder checks like any other -- the same whitelist, typing and bounds, so a
derived table can never express more than the flat query it stands for.

A derived table that aggregates (``GROUP BY``, ``COUNT(*)``) is a DP query of its own; the
outer query over it is post-processing of its released rows (:class:`Wrapped`).

Everything here is a pure AST -> AST function of the text and the policy: nothing reads data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from sqlglot import exp

from dpsql.errors import PrivacyError, ProgrammingError, UndefinedColumnError
from dpsql.frontend.logic import transform_clauses
from dpsql.frontend.per_unit import ROW_CHANGING_CLAUSES, per_unit_relation
from dpsql.frontend.positions import position_of, snippet
from dpsql.frontend.scopes import display_name
from dpsql.frontend.statements import DPQuery
from dpsql.policy import Policy, TablePolicy


@dataclass(frozen=True)
class Wrapped:
    """An outer query over a DP aggregate query: ``outer`` reads ``inner``'s released rows.

    ``outer`` is a SELECT whose FROM is the placeholder table :data:`INNER` (aliased as the
    analyst wrote it); the binder replaces it by the inner query's post-processing.
    """

    inner: exp.Select
    outer: exp.Select
    alias: str


INNER = "__dp_inner"


def is_aggregate(select: exp.Select) -> bool:
    """A SELECT that aggregates rows (and so is a DP query, not a row-level relation)."""
    if select.args.get("group") is not None or select.args.get("having") is not None:
        return True
    return any(item.find(exp.AggFunc) for item in select.expressions)


# The binder, passed in by it (dpsql.frontend.bind.bind_select): a per-unit relation is found by
# binding trial SELECTs, and this module sits below the binder (it imports no binder).
BindSelect = Callable[[exp.Select, Policy], DPQuery]


def flatten_relations(
    tree: exp.Select, policy: Policy, bind: BindSelect
) -> tuple[exp.Select | Wrapped, Policy]:
    """``tree`` with its CTEs and derived tables resolved (see the module docstring), and
    the policy with the per-unit tables it made (dpsql.frontend.per_unit): a derived table
    or CTE grouped by the privacy unit becomes a table of one row per unit (per key), which
    the outer query reads like any table."""
    flattener = _Flattener(policy, bind)
    flat = flattener.resolve(tree, {})
    if flattener.derived:
        policy = replace(policy, tables={**policy.tables, **flattener.derived})
    return flat, policy


def _no_binding(tree: exp.Select, policy: Policy) -> DPQuery:
    raise AssertionError("post-processing is inlined without binding")  # never called


class _Flattener:
    def __init__(self, policy: Policy, bind: BindSelect) -> None:
        self.policy = policy
        self.bind_select = bind
        self.derived: dict[str, TablePolicy] = {}  # per-unit tables made so far, by name

    def refuse(self, message: str, node: exp.Expression | None, hint: str) -> PrivacyError:
        return PrivacyError(
            message,
            construct=snippet(node) if node is not None else None,
            position=position_of(node),
            hint=hint,
        )

    # -- scopes -------------------------------------------------------------------------
    def resolve(self, select: exp.Select, ctes: dict[str, exp.Select]) -> exp.Select | Wrapped:
        with_ = select.args.get("with_") or select.args.get("with")
        if with_ is not None:
            if with_.args.get("recursive"):
                raise self.refuse(
                    "WITH RECURSIVE is not supported",
                    with_,
                    "write the CTE without RECURSIVE; recursion would revisit private rows",
                )
            ctes = dict(ctes)
            for cte in with_.expressions:
                cte_body = cte.this
                name = cte.alias_or_name.lower()
                if cte.args.get("alias") is not None and cte.args["alias"].columns:
                    raise self.refuse(
                        "column lists on a CTE name are not supported",
                        cte.args["alias"],
                        f"name the columns inside the CTE: WITH {display_name(name)} AS "
                        "(SELECT a AS x ...)",
                    )
                if not isinstance(cte_body, exp.Select):
                    raise self.refuse(
                        f"CTE {display_name(name)!r} must be one SELECT",
                        cte_body,
                        "send each SELECT separately; set operations are not supported",
                    )
                # A CTE sees the CTEs defined before it (not itself: no recursion).
                ctes[name] = _Scoped(cte_body, dict(ctes))  # type: ignore[assignment]
            select = select.copy()
            select.set("with_", None)
            select.set("with", None)
        from_ = select.args.get("from_") or select.args.get("from")
        if from_ is None:
            return select
        source = from_.this
        body: exp.Select | None = None
        scope = ctes
        alias = source.alias_or_name
        if isinstance(source, exp.Subquery):
            inner = source.this
            while isinstance(inner, exp.Subquery):  # FROM ((SELECT ...))
                inner = inner.this
            if not isinstance(inner, exp.Select):
                raise self.refuse(
                    "a derived table must be one SELECT",
                    inner,
                    "send each SELECT separately; set operations are not supported",
                )
            body = inner
            if not source.alias:
                alias = ""
            if source.args.get("alias") is not None and source.args["alias"].columns:
                raise self.refuse(
                    "column lists on a derived table's alias are not supported",
                    source.args["alias"],
                    "name the columns inside: (SELECT a AS x ...) AS t",
                )
        elif (
            isinstance(source, exp.Table)
            and isinstance(source.this, exp.Identifier)
            and not source.args.get("db")
            and source.name.lower() in ctes
        ):
            scoped = ctes[source.name.lower()]
            body, scope = scoped.body, scoped.scope  # type: ignore[attr-defined]
            alias = source.alias or source.name
        if body is None:
            self._check_no_cte_elsewhere(select, ctes)
            return select
        inner_resolved = self.resolve(body, scope)
        if isinstance(inner_resolved, Wrapped):
            # Post-processing over post-processing: the outer reads the wrapper's result.
            return Wrapped(
                inner_resolved.inner,
                _over_placeholder(select, inner_resolved.outer, alias),
                alias,
            )
        if is_aggregate(inner_resolved):
            per_unit = self._per_unit(inner_resolved, select)
            if per_unit is not None:  # one row per unit: read like a table
                return self._inline(select, per_unit, alias)
            return Wrapped(inner_resolved, _over_placeholder(select, None, alias), alias)
        return self._inline(select, inner_resolved, alias)

    def _per_unit(self, inner: exp.Select, outer: exp.Select) -> exp.Select | None:
        """A row-level SELECT over a per-unit table if ``inner`` groups a private table by its
        privacy unit (dpsql.frontend.per_unit), else None. Its table joins ``derived``."""
        from dpsql.frontend.private_joins import per_unit_source

        policy = replace(self.policy, tables={**self.policy.tables, **self.derived})

        def bind(trial: exp.Select) -> DPQuery:
            return self.bind_select(trial, policy)

        made = per_unit_relation(inner, outer, policy, bind=bind, make_source=per_unit_source)
        if made is None:
            return None
        relation, table = made
        self.derived[table.name] = table
        return relation

    def _check_no_cte_elsewhere(self, select: exp.Select, ctes: dict) -> None:
        """CTE names may appear only as the FROM source (a subquery elsewhere is refused by the
        binder; this names the CTE in the refusal instead of 'unknown table'). Without a CTE
        in scope no table can be one: nothing to walk."""
        if not ctes:
            return
        for table in select.find_all(exp.Table):
            if table.name.lower() in ctes and table is not _from_source(select):
                raise self.refuse(
                    f"CTE {display_name(table.name)!r} is used in a subquery or join",
                    table,
                    "use a CTE as the FROM source of one query",
                )

    # -- row-level inlining ---------------------------------------------------------------
    def _inline(
        self, outer: exp.Select, inner: exp.Select, alias: str, *, expand_star: bool = False
    ) -> exp.Select:
        """``outer`` over the row-level relation ``inner``, as one query over inner's source.

        ``expand_star`` (post-processing only) turns ``*`` into inner's columns; over private
        rows a star stays, for the binder to refuse.
        """
        # each would make the relation depend on other rows (DISTINCT merges rows, LIMIT keeps
        # a data-dependent subset, windows read other rows): not a per-row projection
        for arg, word in ROW_CHANGING_CLAUSES.items():
            if inner.args.get(arg):
                node = inner.args[arg]
                node = node[0] if isinstance(node, list) else node
                raise self.refuse(
                    f"{word} inside a derived table or CTE is not supported",
                    node if isinstance(node, exp.Expression) else inner,
                    "a derived table must keep every row (SELECT columns and expressions "
                    "FROM t WHERE ...); move the clause to the outer query",
                )
        for window in inner.find_all(exp.Window):
            raise self.refuse(
                "window functions are not allowed",
                window,
                "use GROUP BY with COUNT/SUM/AVG; windows would release individual rows",
            )
        columns = self._columns(inner)
        qualifiers = {alias.lower()} if alias else set()
        outer_aliases = {
            e.alias.lower() for e in outer.expressions if isinstance(e, exp.Alias) and e.alias
        }
        result = outer.copy()
        used: set[str] = set()
        order = result.args.get("order")
        order_nodes = {id(n) for n in order.walk()} if order is not None else set()

        def substitute(node: exp.Expression) -> exp.Expression:
            if not isinstance(node, exp.Column) or isinstance(node.this, exp.Star):
                return node
            qualifier = node.table.lower()
            if qualifier and qualifier not in qualifiers:
                return node  # the binder names the unknown qualifier
            name = node.name.lower()
            if name in columns:
                used.add(name)
                replacement = columns[name].copy()
                if not isinstance(replacement, exp.Column | exp.Literal | exp.Paren):
                    replacement = exp.Paren(this=replacement)
                return replacement
            if id(node) in order_nodes and not qualifier and name in outer_aliases:
                return node  # ORDER BY an output alias of the outer query
            raise ProgrammingError(
                f"{'derived table ' + repr(alias) if alias else 'the derived table'} has no "
                f"column {node.name!r}",
                sqlstate=UndefinedColumnError.sqlstate,
                construct=snippet(node),
                position=position_of(node),
                hint="its columns: " + ", ".join(columns),
            )

        # Keep output names: `SELECT dept FROM (SELECT department AS dept ...)` answers `dept`.
        items: list[exp.Expr] = []
        for item in result.expressions:
            if isinstance(item, exp.Column) and not isinstance(item.this, exp.Star):
                item = exp.alias_(item, item.name, quoted=item.this.args.get("quoted", False))
            elif expand_star and _is_star(item):
                items.extend(exp.alias_(exp.column(n), n, quoted=True) for n in columns)
                continue
            items.append(item)
        result.set("expressions", items)
        transform_clauses(result, substitute)
        inner_from = inner.args.get("from_") or inner.args.get("from")
        if inner_from is None:
            raise self.refuse(
                "a derived table or CTE without FROM has no rows to aggregate",
                inner,
                "select from a table declared in the policy inside it",
            )
        result.set("from_", inner_from.copy())
        # Columns the outer query never reads are still checked by the binder: a derived
        # table naming an unknown column or a refused function is an error, used or not.
        unused = [e for name, e in columns.items() if name not in used]
        result.meta["dp_unchecked"] = [*inner.meta.get("dp_unchecked", []), *unused]
        inner_where = inner.args.get("where")
        if inner_where is not None:
            outer_where = result.args.get("where")
            condition = inner_where.this.copy()
            if outer_where is not None:
                condition = exp.and_(exp.Paren(this=condition), exp.Paren(this=outer_where.this))
            result.set("where", exp.Where(this=condition))
        return result

    def _columns(self, inner: exp.Select) -> dict[str, exp.Expression]:
        """The row-level relation's columns: name -> expression over its source table."""
        source = _from_source(inner)
        out: dict[str, exp.Expression] = {}
        for item in inner.expressions:
            if isinstance(item, exp.Star) or (
                isinstance(item, exp.Column) and isinstance(item.this, exp.Star)
            ):
                table = self.policy.table(source.name) if isinstance(source, exp.Table) else None
                if table is None:
                    raise self.refuse(
                        "SELECT * in a derived table needs a table declared in the policy",
                        item,
                        "select the columns by name",
                    )
                for name in table.columns:
                    out[name] = exp.column(name)
                continue
            if isinstance(item, exp.Alias):
                name, expr = item.alias.lower(), item.this
            elif isinstance(item, exp.Column):
                name, expr = item.name.lower(), item
            else:
                raise self.refuse(
                    f"the derived table's column {snippet(item)} needs a name",
                    item,
                    f"name it: {snippet(item)} AS name",
                )
            if name in out:
                raise self.refuse(
                    f"the derived table has two columns named {name!r}",
                    item,
                    "give each column its own name",
                )
            out[name] = expr
        return out


def _is_star(item: exp.Expression) -> bool:
    return isinstance(item, exp.Star) or (
        isinstance(item, exp.Column) and isinstance(item.this, exp.Star)
    )


@dataclass(frozen=True)
class _Scoped:
    body: exp.Select
    scope: dict


def _from_source(select: exp.Select) -> exp.Expression | None:
    from_ = select.args.get("from_") or select.args.get("from")
    return from_.this if from_ is not None else None


def _over_placeholder(outer: exp.Select, inner_outer: exp.Select | None, alias: str) -> exp.Select:
    """``outer`` reading the placeholder :data:`INNER` (or a nested wrapper's outer query)."""
    result = outer.copy()
    result.set("with_", None)
    if inner_outer is None:
        source: exp.Expression = exp.Table(
            this=exp.to_identifier(INNER),
            alias=exp.TableAlias(this=exp.to_identifier(alias or "_")),
        )
    else:
        source = exp.Subquery(
            this=inner_outer, alias=exp.TableAlias(this=exp.to_identifier(alias or "_"))
        )
    result.set("from_", exp.From(this=source))
    return result


def compose_post(outer: exp.Select, inner_post: exp.Select, alias: str) -> exp.Select:
    """The outer query over a DP query's post-processing, as one query over the released table.

    When the inner post-processing keeps every released row (no ORDER BY/LIMIT/DISTINCT) and
    the outer query does not aggregate, the outer's columns are replaced by the inner's
    expressions, so picked aggregates keep their noise intervals. Otherwise the inner query
    is nested as a subquery (still post-processing of released values only).
    """
    for table in outer.find_all(exp.Table):
        if table.name != INNER:
            raise PrivacyError(
                f"the query over a DP subquery reads {snippet(table)}",
                construct=snippet(table),
                hint="an outer query may read only its DP subquery's released columns",
            )
    for sub in outer.find_all(exp.Subquery):
        if not isinstance(sub.this, exp.Select) or sub.this.find(exp.Table) is not None:
            raise PrivacyError(
                "subqueries are not supported over a DP subquery",
                construct=snippet(sub),
                hint="an outer query may read only its DP subquery's released columns",
            )
    keeps_rows = not any(inner_post.args.get(a) for a in ("order", "limit", "offset", "distinct"))
    # a window reads every released row: substituted into the outer query it would be computed
    # after the outer's WHERE (and the row-level inliner refuses windows), so it stays nested
    windowed = inner_post.find(exp.Window) is not None
    if keeps_rows and not windowed and not is_aggregate(outer) and not outer.args.get("distinct"):
        names = {item.alias.lower(): item.this for item in inner_post.expressions if item.alias}
        if all(
            c.name.lower() in names or c.table.lower() not in ("", (alias or "_").lower())
            for c in outer.find_all(exp.Column)
            if not _is_output_alias(c, outer)
        ):
            flat = _Flattener(_NO_POLICY, _no_binding)._inline(
                outer, inner_post, alias or "_", expand_star=True
            )
            flat.meta.pop("dp_unchecked", None)
            return flat
    result = outer.copy()
    # the released table's columns by name: a star is spelled out (the post step reads its
    # output columns from the select list, where a bare * would count as one column)
    if any(_is_star(item) for item in result.expressions):
        items: list[exp.Expression] = []
        for item in result.expressions:
            if _is_star(item):
                items += [exp.column(e.alias_or_name, quoted=True) for e in inner_post.expressions]
            else:
                items.append(item)
        result.set("expressions", items)
    result.set(
        "from_",
        exp.From(
            this=exp.Subquery(
                this=inner_post.copy(), alias=exp.TableAlias(this=exp.to_identifier(alias or "_"))
            )
        ),
    )
    return result


def _is_output_alias(column: exp.Column, outer: exp.Select) -> bool:
    order = outer.args.get("order")
    if order is None or column.table:
        return False
    aliases = {e.alias.lower() for e in outer.expressions if isinstance(e, exp.Alias)}
    return column.name.lower() in aliases and any(n is column for n in order.walk())


_NO_POLICY = Policy(path=None, tables={})
