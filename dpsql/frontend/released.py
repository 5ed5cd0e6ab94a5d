"""Relational post-processing over released tables: several DP queries, then SQL over their
released (noisy) rows.

    SELECT department, COUNT(*) AS n FROM visits WHERE smoker GROUP BY department
    UNION ALL
    SELECT 'TOTAL', COUNT(*) FROM visits

is two measurements (each branch a DP query of its own) and one post-processing step, a
``UNION ALL`` of their released tables. The same holds for ``UNION`` / ``INTERSECT`` /
``EXCEPT``, for CTE chains where a CTE filters or ranks another CTE's released rows, for joins
between released results and for scalar subqueries over a released result: every DP query
(an aggregating SELECT over private rows) is cut out and becomes measurement ``__m<i>``; what
is left (the *post* tree) reads only those released tables, its own CTEs over them, and
constants. Post-processing of released values is free (it reads nothing private); the
measurements are charged together in one reservation (dpsql.service.postprocess).

A query that reads private rows outside a DP query (``SELECT age FROM visits UNION ...``, a
join of a released result with a private table) is refused here, free, from the text alone.

This module only recognises the shape: nothing here reads data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlglot import exp

from dpsql.errors import PrivacyError
from dpsql.frontend.positions import position_of, snippet
from dpsql.frontend.statements import DIALECT


class Policy(Protocol):
    """What this module reads of dpsql.policy.Policy (not imported: this module stays below
    the binder in the import graph)."""

    @property
    def tables(self) -> Any: ...

    def table(self, name: str) -> Any: ...


#: The released table of measurement i in the post tree: ``__m0``, ``__m1``, ...
MEASURED = "__m"

# What a relation is, from the text and the policy alone.
DP = "dp"  # an aggregating SELECT over private rows: a measurement
POST = "post"  # a SELECT or set operation over released relations (and constants)
PRIVATE = "private"  # private rows (a policy table, a row-level relation over one)
PUBLIC = "public"  # a public policy table, or a relation over public tables only
CONSTANT = "constant"  # reads no table (SELECT 'TOTAL', 0)
MIXED = "mixed"  # private rows next to a released relation (a DP subquery filter, or refused)

RELEASED_KINDS = (DP, POST)


@dataclass(frozen=True)
class ReleasedTables:
    """``post`` reads the released tables ``__m0..`` of ``measurements`` (each a standalone DP
    SELECT, with the row-level CTEs it reads attached) and nothing else."""

    measurements: tuple[exp.Select, ...]
    names: tuple[str, ...]  # how EXPLAIN names each: "UNION branch 2", "CTE a", ...
    post: exp.Query
    operations: tuple[str, ...] = field(default=())  # what post-processing does, for EXPLAIN


@dataclass
class _Cte:
    body: exp.Expression
    scope: dict[str, _Cte]
    kind: str


def is_aggregate(select: exp.Select) -> bool:
    """A SELECT that aggregates rows (dpsql.frontend.inline's rule; kept here so this module
    stays below the binder in the import graph)."""
    if select.args.get("group") is not None or select.args.get("having") is not None:
        return True
    return any(item.find(exp.AggFunc) for item in select.expressions)


def _unwrap(node: exp.Expression) -> exp.Expression:
    """A parenthesised query without an alias: the query itself."""
    while isinstance(node, exp.Subquery | exp.Paren) and not node.alias:
        node = node.this
    return node


def _with(node: exp.Expression) -> exp.With | None:
    return node.args.get("with_") or node.args.get("with")


def _own_queries(node: exp.Expression) -> list[exp.Expression]:
    """The queries nested directly in ``node`` (subqueries in any clause, set operation
    branches), not those nested inside them, and not its CTE bodies."""
    found: list[exp.Expression] = []
    with_ = _with(node)
    for child in node.iter_expressions():
        if child is with_:
            continue
        if isinstance(child, exp.Select | exp.SetOperation):
            found.append(child)
            continue
        for sub in child.walk(prune=lambda n: isinstance(n, exp.Select | exp.SetOperation)):
            if isinstance(sub, exp.Select | exp.SetOperation) and sub is not child:
                found.append(sub)
    return found


def _sources(select: exp.Select) -> list[exp.Expression]:
    from_ = select.args.get("from_") or select.args.get("from")
    sources = [from_.this] if from_ is not None else []
    return sources + [j.this for j in select.args.get("joins") or []]


class _Classifier:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def refuse(self, message: str, node: exp.Expression, hint: str) -> PrivacyError:
        return PrivacyError(message, construct=snippet(node), position=position_of(node), hint=hint)

    def scope(self, node: exp.Expression, ctes: dict[str, _Cte]) -> dict[str, _Cte]:
        """``ctes`` with ``node``'s own CTEs added (each seeing the ones before it)."""
        with_ = _with(node)
        if with_ is None or with_.args.get("recursive"):
            return ctes
        ctes = dict(ctes)
        for cte in with_.expressions:
            body = _unwrap(cte.this)
            ctes[cte.alias_or_name.lower()] = _Cte(body, ctes, self.kind(body, ctes))
        return ctes

    def per_unit(self, select: exp.Select) -> bool:
        """Grouped by a privacy unit: a per-unit relation (one row per unit,
        dpsql.frontend.per_unit), read by a DP query like a row-level one, never a DP query
        of its own."""
        group = select.args.get("group")
        if group is None:
            return False
        units = {
            t.privacy_unit.lower()
            for t in self.policy.tables.values()
            if getattr(t, "privacy_unit", None)
        }
        return any(isinstance(g, exp.Column) and g.name.lower() in units for g in group.expressions)

    def source_kind(self, source: exp.Expression, ctes: dict[str, _Cte]) -> str:
        if isinstance(source, exp.Subquery):
            return self.kind(_unwrap(source.this), ctes)
        if isinstance(source, exp.Table) and isinstance(source.this, exp.Identifier):
            if not source.args.get("db") and source.name.lower() in ctes:
                return ctes[source.name.lower()].kind
            table = self.policy.table(source.name)
            if table is not None and table.public:
                return PUBLIC
        return PRIVATE  # a policy table, or unknown (the binder names it)

    def kind(self, node: exp.Expression, ctes: dict[str, _Cte]) -> str:
        node = _unwrap(node)
        if isinstance(node, exp.SetOperation):
            ctes = self.scope(node, ctes)
            kinds = {self.kind(node.this, ctes), self.kind(node.expression, ctes)}
            if kinds <= {CONSTANT}:
                return CONSTANT
            if kinds <= {DP, POST, CONSTANT}:
                return POST
            return MIXED if kinds & {DP, POST} else PRIVATE
        if not isinstance(node, exp.Select):
            return PRIVATE
        ctes = self.scope(node, ctes)
        kinds = {self.source_kind(s, ctes) for s in _sources(node)}
        if not kinds:
            nested = {self.kind(q, ctes) for q in _own_queries(node)}
            if nested - {DP, POST, CONSTANT}:
                return MIXED  # a subquery over private (or public) rows
            return POST if nested & {DP, POST} else CONSTANT
        if kinds & {DP, POST}:
            return POST if kinds <= {DP, POST, CONSTANT} else MIXED
        if PRIVATE in kinds:
            return DP if is_aggregate(node) and not self.per_unit(node) else PRIVATE
        return PUBLIC


def split_released_tables(tree: exp.Expression, policy: Policy) -> ReleasedTables | None:
    """The released-tables shape of ``tree``, or None when the one-query path takes it (a DP
    query, a chain of queries over one DP query, a DP subquery filter): see the module
    docstring. Refuses (free) a set operation over private rows."""
    classifier = _Classifier(policy)
    kind = classifier.kind(tree, {})
    if isinstance(_unwrap(tree), exp.SetOperation) and kind != POST:
        node = _unwrap(tree)
        word = type(node).__name__.upper()
        raise classifier.refuse(
            f"{word} of queries that read private rows directly is not supported: each side "
            "must be a DP query (with an aggregate) or a constant row",
            node,
            "SELECT k, COUNT(*) FROM t GROUP BY k UNION ALL SELECT 'TOTAL', COUNT(*) FROM t",
        )
    top = _unwrap(tree)
    if kind == MIXED and isinstance(top, exp.Select) and _sources(top) and not is_aggregate(top):
        raise classifier.refuse(
            "a join of a released result with private rows is not supported",
            top,
            "join released results with each other (WITH a AS (SELECT k, COUNT(*) ...), "
            "b AS (...) SELECT ... FROM a JOIN b ON a.k = b.k), or filter a DP query by a DP "
            "subquery (JOIN (SELECT k AS k__ ...) s ON k = k__ ... GROUP BY k)",
        )
    if kind == DP and isinstance(top, exp.Select):
        return _with_scalars(top, classifier)
    if kind != POST:
        return None
    split = _Splitter(classifier)
    post = split.query(_unwrap(tree), {}, "")
    if len(split.measurements) == 1 and _linear(post):
        return None  # one DP query and a chain of queries over it: the one-query path
    assert isinstance(post, exp.Query)
    return ReleasedTables(
        tuple(split.measurements), tuple(split.names), post, tuple(_operations(post))
    )


# Output names the binder gives unaliased items (dpsql.frontend.bind._default_name).
_AGGREGATE_NAMES = {exp.PercentileCont: "percentile_cont", exp.PercentileDisc: "percentile_disc"}


def _default_name(node: exp.Expression, index: int) -> str:
    if isinstance(node, exp.Column):
        return node.name.lower()
    if isinstance(node, exp.AggFunc):
        return _AGGREGATE_NAMES.get(type(node), type(node).__name__.lower())
    return f"col{index + 1}"


def _outermost_aggregate(node: exp.Expression) -> bool:
    """An aggregate call as a whole (with its FILTER or WITHIN GROUP), not a part of one."""
    if isinstance(node, exp.Filter | exp.WithinGroup):
        return isinstance(node.this, exp.AggFunc)
    return isinstance(node, exp.AggFunc) and not isinstance(
        node.parent, exp.Filter | exp.WithinGroup
    )


def _with_scalars(top: exp.Select, classifier: _Classifier) -> ReleasedTables | None:
    """A DP query whose SELECT list, HAVING or ORDER BY reads scalar subqueries that are DP
    queries (``SELECT k, COUNT(*) * 100.0 / (SELECT COUNT(*) FROM t) FROM t GROUP BY k``): the
    query's keys and aggregates become measurement 0 (``__k<i>``, ``__a<j>``), each subquery
    a measurement of its own, and the SELECT list, HAVING, ORDER BY and LIMIT are evaluated
    over their released tables. None when it reads no such subquery."""
    ctes = classifier.scope(top, {})
    clauses = [*top.expressions, top.args.get("having"), top.args.get("order")]
    scalars = [
        q
        for clause in clauses
        if clause is not None
        for q in ([clause] if isinstance(clause, exp.Select) else [])
        + [
            n
            for n in clause.walk(prune=lambda n: isinstance(n, exp.Select | exp.SetOperation))
            if isinstance(n, exp.Select | exp.SetOperation) and n is not clause
        ]
        if classifier.kind(q, ctes) in (DP, POST)
    ]
    if not scalars:
        return None
    for window in top.find_all(exp.Window):
        raise classifier.refuse(
            "a window next to a DP subquery in the same SELECT is not supported",
            window,
            "read the subquery's result in a CTE: WITH total AS (SELECT COUNT(*) AS n FROM t) ...",
        )
    # the GROUP BY keys, as expressions (ordinals and select aliases resolved)
    items = {e.alias.lower(): e.this for e in top.expressions if isinstance(e, exp.Alias)}
    group = top.args.get("group")
    keys: list[exp.Expression] = []
    for g in group.expressions if group is not None else []:
        if isinstance(g, exp.Literal) and g.is_int and 1 <= int(g.name) <= len(top.expressions):
            g = top.expressions[int(g.name) - 1].unalias()
        elif isinstance(g, exp.Column) and not g.table and g.name.lower() in items:
            g = items[g.name.lower()]
        keys.append(g)
    key_sql = {k.sql(dialect=DIALECT): i for i, k in enumerate(keys)}
    marked = {id(q): j for j, q in enumerate(scalars)}
    for q in scalars:
        q.meta["dp_scalar"] = marked[id(q)]
    aggregates: dict[str, int] = {}
    found: list[exp.Expression] = []

    def visit(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Select | exp.SetOperation) and "dp_scalar" in node.meta:
            return node.copy()  # a new node: not descended into; measured below
        if _outermost_aggregate(node):
            sql = node.sql(dialect=DIALECT)
            if sql not in aggregates:
                aggregates[sql] = len(found)
                found.append(node.copy())
            return exp.column(f"__a{aggregates[sql]}")
        if isinstance(node, exp.Column | exp.Func | exp.Binary | exp.Case | exp.Paren):
            index = key_sql.get(node.sql(dialect=DIALECT))
            if index is not None:
                return exp.column(f"__k{index}")
        return node

    post = exp.Select()
    for i, item in enumerate(top.expressions):
        name = item.alias if isinstance(item, exp.Alias) else _default_name(item, i)
        post = post.select(exp.alias_(item.unalias().transform(visit), name, quoted=True))
    having = top.args.get("having")
    if having is not None:
        post = post.where(having.this.transform(visit))
    order = top.args.get("order")
    if order is not None:
        post.set("order", order.transform(visit))
    for arg in ("limit", "offset", "distinct"):
        if top.args.get(arg) is not None:
            post.set(arg, top.args[arg].copy())
    for q in scalars:
        del q.meta["dp_scalar"]
    # measurement 0: the query's own keys and aggregates
    first = top.copy()
    first.set(
        "expressions",
        [exp.alias_(k.copy(), f"__k{i}") for i, k in enumerate(keys)]
        + [exp.alias_(a, f"__a{j}") for j, a in enumerate(found)],
    )
    for arg in ("having", "order", "limit", "offset", "distinct"):
        first.set(arg, None)
    if keys:
        first.set("group", exp.Group(expressions=[k.copy() for k in keys]))
    if not first.expressions:
        first.set("expressions", [exp.alias_(exp.Count(this=exp.Star()), "__a0")])
    split = _Splitter(classifier)
    split.measurements.append(first)
    split.names.append("query")
    for node in list(post.walk()):
        if isinstance(node, exp.Select | exp.SetOperation) and "dp_scalar" in node.meta:
            node.meta.pop("dp_scalar")
            target = node.parent if isinstance(node.parent, exp.Subquery) else node
            body = split.query(node, ctes, "scalar subquery")
            target.replace(exp.Subquery(this=body))
    for column in post.find_all(exp.Column):
        if (
            not column.name.startswith(("__k", "__a"))
            and column.find_ancestor(exp.Subquery) is None
            and not (column.find_ancestor(exp.Order) is not None and not column.table)
        ):
            raise classifier.refuse(
                f"column {column.name!r} is used outside an aggregate and not in GROUP BY",
                column,
                f"aggregate it (e.g. COUNT({column.name})) or add it to GROUP BY",
            )
    post.set("from_", exp.From(this=exp.to_table(f"{MEASURED}0")))
    return ReleasedTables(tuple(split.measurements), tuple(split.names), post, ("scalar subquery",))


def _linear(post: exp.Expression) -> bool:
    """One SELECT directly over the one DP query (a derived table or CTE), with no join, set
    operation or other subquery: what dpsql.frontend.inline already composes (keeping the
    picked aggregates' intervals and the plan cache). Deeper chains come here."""
    selects = list(post.find_all(exp.Select))
    tables = list(post.find_all(exp.Table))
    inner = [s for s in selects if s is not post]
    return (
        len(selects) == 2
        and len(tables) <= 2
        and post.find(exp.Join, exp.SetOperation) is None
        and isinstance(post, exp.Select)
        # read as a derived table or a CTE, not as a scalar subquery
        and isinstance(inner[0].parent, exp.Subquery | exp.CTE)
        and isinstance(inner[0].parent.parent, exp.From | exp.With)
    )


def _operations(post: exp.Expression) -> list[str]:
    """What the post tree does, in words, for EXPLAIN."""
    found = []
    for node in post.walk():
        if isinstance(node, exp.SetOperation):
            word = type(node).__name__.upper()
            found.append(word if node.args.get("distinct") else f"{word} ALL")
        elif isinstance(node, exp.Join):
            found.append("JOIN")
        elif isinstance(node, exp.Window):
            found.append("window " + node.this.sql(dialect=DIALECT).split("(")[0].upper())
        elif isinstance(node, exp.Subquery) and not isinstance(node.parent, exp.From | exp.Join):
            found.append("subquery")
    return list(dict.fromkeys(found))


class _Splitter:
    def __init__(self, classifier: _Classifier) -> None:
        self.classifier = classifier
        self.measurements: list[exp.Select] = []
        self.names: list[str] = []

    def refuse_private(self, node: exp.Expression, kind: str) -> PrivacyError:
        if kind == PUBLIC:
            return self.classifier.refuse(
                "post-processing of released results cannot read a public table",
                node,
                "join the public table inside the DP query (JOIN departments d ON ...)",
            )
        return self.classifier.refuse(
            "post-processing of released results reads private rows directly",
            node,
            "read only DP queries' results (each with an aggregate, e.g. SELECT k, COUNT(*) "
            "FROM t GROUP BY k) in a window, set operation, join or subquery",
        )

    def query(self, node: exp.Expression, ctes: dict[str, _Cte], name: str) -> exp.Expression:
        """``node`` as post-processing over ``__m<i>``: DP queries cut out as measurements."""
        node = _unwrap(node)
        kind = self.classifier.kind(node, ctes)
        if kind == DP:
            assert isinstance(node, exp.Select)
            return self.measure(node, ctes, name or "query")
        if kind not in (POST, CONSTANT):
            raise self.refuse_private(node, kind)
        scope = self.classifier.scope(node, ctes)
        out = _without_with(node)
        # The post tree keeps the released CTEs it reads (a DP CTE nobody reads is not
        # measured, nor charged); row-level ones go with the measurements that read them.
        with_ = _with(node)
        if with_ is not None:
            read = _referenced(out, scope)
            kept = []
            for cte in with_.expressions:
                cte_name = cte.alias_or_name.lower()
                entry = scope[cte_name]
                if cte_name in read and entry.kind in (DP, POST, CONSTANT):
                    body = self.query(entry.body, entry.scope, f"CTE {cte.alias_or_name}")
                    alias = exp.TableAlias(this=exp.to_identifier(cte_name))
                    kept.append(exp.CTE(this=body, alias=alias))
            if kept:
                out.set("with_", exp.With(expressions=kept))
        for query in _own_queries(out):
            where = _describe_position(query)
            replacement = self.query(query, scope, f"{name} {where}".strip())
            target = query
            # a parenthesised set operation branch: replace the parentheses too
            while (
                isinstance(target.parent, exp.Subquery | exp.Paren)
                and not target.parent.alias
                and isinstance(target.parent.parent, exp.SetOperation)
            ):
                target = target.parent
            target.replace(replacement)
        if isinstance(out, exp.Select):
            for source in _sources(out):
                if isinstance(source, exp.Table):
                    source_kind = self.classifier.source_kind(source, scope)
                    if source_kind not in (DP, POST, CONSTANT):
                        raise self.refuse_private(source, source_kind)
        return out

    def measure(self, select: exp.Select, ctes: dict[str, _Cte], name: str) -> exp.Expression:
        """Cut ``select`` out as measurement i; the post tree reads ``SELECT * FROM __m<i>``.
        The row-level CTEs it reads (directly or through each other) go with it."""
        measurement = select.copy()
        read = _referenced(_without_with(select), ctes)
        attached = [
            exp.CTE(this=c.body.copy(), alias=exp.TableAlias(this=exp.to_identifier(n)))
            for n, c in ctes.items()
            if n in read and c.kind in (PRIVATE, PUBLIC)
        ]
        if attached:
            own = _with(measurement)
            measurement.set(
                "with_", exp.With(expressions=attached + (own.expressions if own else []))
            )
        index = len(self.measurements)
        self.measurements.append(measurement)
        self.names.append(name)
        return exp.select("*").from_(exp.to_table(f"{MEASURED}{index}"))


def _referenced(node: exp.Expression, ctes: dict[str, _Cte]) -> set[str]:
    """Names of the CTEs ``node`` reads, directly or through other CTEs."""
    names = {t.name.lower() for t in node.find_all(exp.Table)}
    todo = [n for n in names if n in ctes]
    while todo:
        entry = ctes[todo.pop()]
        for table in entry.body.find_all(exp.Table):
            name = table.name.lower()
            if name in entry.scope and name not in names:
                names.add(name)
                todo.append(name)
    return names


def _without_with(node: exp.Expression) -> exp.Expression:
    copy = node.copy()
    copy.set("with_", None)
    return copy


def _describe_position(query: exp.Expression) -> str:
    parent = query.parent
    while isinstance(parent, exp.Subquery | exp.Paren) and parent.parent is not None:
        if parent.alias:
            return f"derived table {parent.alias}"
        parent = parent.parent
    if isinstance(parent, exp.SetOperation):
        word = type(parent).__name__.upper()
        return f"{word} branch {1 if query is parent.this else 2}"
    return "subquery"
