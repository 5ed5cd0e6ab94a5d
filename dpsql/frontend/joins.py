"""Joins with public tables: inlined into one query over the private table.

A public table (``[tables.departments] public = true``) is public data, read at connect
(dpsql.policy). A join of the private table with it ON the public table's declared unique key
(``FROM visits v JOIN departments d ON v.dept_id = d.id``) matches each private row with at
most one public row, so every output row is one input row: the relation is 1-stable, like a
row-level derived table, and the sensitivity of every aggregate over it is unchanged
(dpsql.plan.relational.PublicJoin). It is inlined as such a relation:

- each public column ``d.name`` read by the query becomes a lookup on the private row,
  ``CASE WHEN v.dept_id = 1 THEN 'cardiology' WHEN ... END`` (its branches are the public
  rows, so its range and domain are public), NULL where no public row matches (LEFT JOIN);
- an INNER JOIN keeps the rows that match: ``v.dept_id IN (<the public keys>)``;
- GROUP BY a public column releases the public table's values of it, empty groups included,
  without thresholding (for a LEFT JOIN, also the NULL group of rows that match nothing);
- ``FROM departments d LEFT JOIN visits v ON v.dept_id = d.id`` (public groups) is the INNER
  join grouped by public columns: every key of the public table is released.

A semi join ``col IN (SELECT key FROM public_table WHERE ...)`` reads public data only: it is
evaluated here and becomes ``col IN (<its values>)``, a public key set.

Everything else is refused with the reason: a join on a public column that is not a declared
unique key (rows could multiply), joins of two private tables or of a table with itself (those
on the privacy unit were lowered before, by dpsql.frontend.private_joins), cross joins, FULL
joins, ON conditions other than one equality of columns. Nothing here reads private data.

A private *table* joined to public tables (not public groups) is lowered before, too, as a real
JOIN with the public rows (dpsql.frontend.private_joins): the lookups here serve public groups
and derived tables or CTEs on the private side.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import duckdb
from sqlglot import exp

from dpsql.errors import PrivacyError, ProgrammingError, UndefinedColumnError, UndefinedTableError
from dpsql.frontend.logic import column_equality, mismatched_join, transform_clauses
from dpsql.frontend.positions import position_of, snippet
from dpsql.policy import Policy, TablePolicy, comparable

# Meta key on a lookup's CASE: the public values a GROUP BY of it releases (dpsql.frontend.bind).
PUBLIC_VALUES = "dp_public_values"
# Meta key on the rewritten SELECT: what was joined, for EXPLAIN's plan tree.
JOINED = "dp_joined"

_JOIN_HINT = (
    "join a public table ON its declared unique key: FROM visits v JOIN departments d "
    "ON v.dept_id = d.id"
)


def ambiguous_column(col: exp.Column, aliases: Sequence[str]) -> ProgrammingError:
    """42702 for an unqualified column that two joined tables hold, naming the qualifiers."""
    return ProgrammingError(
        f"column reference {col.name!r} is ambiguous",
        sqlstate="42702",
        construct=snippet(col),
        position=position_of(col),
        hint="qualify it: " + " or ".join(f"{a}.{col.name}" for a in aliases),
    )


@dataclass(frozen=True)
class JoinSide:
    """One FROM/JOIN source: a policy table (or a derived table / CTE) and its alias."""

    node: exp.Expression
    alias: str
    table: TablePolicy | None  # None: a derived table or CTE (a private relation)

    @property
    def public(self) -> bool:
        return self.table is not None and self.table.public


@dataclass(frozen=True)
class _Dimension:
    side: JoinSide
    key: str  # the public table's unique column joined on
    foreign: exp.Column  # the private relation's column, as written
    keep_unmatched: bool  # LEFT JOIN: private rows matching nothing stay (with NULLs)

    def rows(self) -> list[tuple[Any, ...]]:
        return list(self.side.table.rows or ())  # type: ignore[union-attr]

    def key_values(self) -> list[Any]:
        """The public table's non-NULL key values (a NULL key matches no row)."""
        index = list(self.side.table.columns).index(self.key)  # type: ignore[union-attr]
        return [r[index] for r in self.rows() if r[index] is not None]


def resolve_joins(tree: exp.Select, policy: Policy) -> exp.Select:
    """``tree`` with its semi joins on public tables evaluated and its joins with public
    tables inlined (see the module docstring). Other joins are left to the binder."""
    if not any(t.public for t in policy.tables.values()):
        return tree
    tree = _semi_joins(tree, policy)
    joins = tree.args.get("joins") or []
    if joins and all(isinstance(j.this, exp.Table) for j in joins):
        tree = Joiner(tree, policy).rewrite()
    return tree


def _refuse(message: str, node: exp.Expression | None, hint: str) -> PrivacyError:
    return PrivacyError(
        message,
        construct=snippet(node) if node is not None else None,
        position=position_of(node),
        hint=hint,
    )


# -- semi joins ---------------------------------------------------------------------------------


def _semi_joins(tree: exp.Select, policy: Policy) -> exp.Select:
    def visit(node: exp.Expression) -> exp.Expression:
        if not isinstance(node, exp.In) or node.args.get("query") is None:
            return node
        select = node.args["query"]
        while isinstance(select, exp.Subquery):
            select = select.this
        if not isinstance(select, exp.Select):
            return node
        table = _public_source(select, policy)
        if table is None:
            return node  # a DP subquery (dpsql.frontend.compose) or refused by the binder
        values = _evaluate_public(select, table)
        if not values:
            return exp.false()  # x IN (no rows) is FALSE, NULL x too
        out = node.copy()
        out.set("query", None)
        out.set("expressions", [_literal(v) for v in values])
        return out

    # visit keeps the root (only IN nodes change): a Select stays a Select
    return cast(exp.Select, tree.transform(visit, copy=True))


def _public_source(select: exp.Select, policy: Policy) -> TablePolicy | None:
    from_ = select.args.get("from_") or select.args.get("from")
    source = from_.this if from_ is not None else None
    if not isinstance(source, exp.Table) or not isinstance(source.this, exp.Identifier):
        return None
    table = policy.table(source.name)
    return table if table is not None and table.public else None


def _evaluate_public(select: exp.Select, table: TablePolicy) -> list[Any]:
    """The distinct values of a one-column SELECT over one public table (public data)."""
    from dpsql.frontend.statements import SCALAR_NODES

    problem = None
    if len(select.expressions) != 1 or isinstance(select.expressions[0], exp.Star):
        problem = "must select one column"
    for arg in ("joins", "with_", "with", "group", "having", "limit", "offset", "laterals"):
        if select.args.get(arg):
            problem = f"may not use {arg.rstrip('_').upper()}"
    for node in select.walk():
        if node is select or isinstance(node, exp.From | exp.Where | exp.Table | exp.Alias):
            continue
        if isinstance(node, exp.TableAlias | exp.Distinct):
            continue
        if isinstance(node, exp.Column) and node.name.lower() not in table.columns:
            raise ProgrammingError(
                f"unknown column {node.name!r} in public table {table.name!r}",
                sqlstate=UndefinedColumnError.sqlstate,
                construct=snippet(node),
                position=position_of(node),
                hint="its columns: " + ", ".join(table.columns),
            )
        if isinstance(node, exp.Rand | exp.Anonymous | exp.AggFunc) or not isinstance(
            node, SCALAR_NODES
        ):
            problem = f"may not use {snippet(node)}"
    if problem is not None:
        raise _refuse(
            f"an IN (subquery) over public table {table.name!r} {problem}",
            select,
            f"IN (SELECT key FROM {table.name} WHERE condition)",
        )
    query = select.copy()
    query.set("distinct", exp.Distinct())
    rows = _PublicData.of(table).rows(query.sql(dialect="duckdb"), select)
    return [r[0] for r in rows]


class _PublicData:
    """An in-memory DuckDB holding one public table's rows (public data only; no files, no
    configuration changes), to evaluate subqueries over it."""

    _cache: dict[int, tuple[TablePolicy, _PublicData]] = {}  # noqa: RUF012
    _cache_lock = threading.Lock()

    def __init__(self, table: TablePolicy) -> None:
        from dpsql.frontend.identifiers import quote_ident
        from dpsql.policy import SQL_TYPES

        self._con = duckdb.connect(":memory:")
        cols = ", ".join(
            f"{quote_ident(c.name)} {SQL_TYPES[c.type]}" for c in table.columns.values()
        )
        self._con.execute(f"CREATE TABLE {quote_ident(table.name)} ({cols})")
        if table.rows:
            marks = ", ".join("?" for _ in table.columns)
            self._con.executemany(
                f"INSERT INTO {quote_ident(table.name)} VALUES ({marks})",
                [list(r) for r in table.rows],
            )
        self._con.execute("SET threads = 1")
        self._con.execute("SET enable_external_access = false")
        self._con.execute("SET lock_configuration = true")
        self._lock = threading.Lock()

    @classmethod
    def of(cls, table: TablePolicy) -> _PublicData:
        with cls._cache_lock:
            known = cls._cache.get(id(table.rows))
            if known is None or known[0] is not table:
                known = (table, cls(table))
                cls._cache[id(table.rows)] = known
            return known[1]

    def rows(self, sql: str, node: exp.Expression) -> list[tuple[Any, ...]]:
        try:
            with self._lock:
                return self._con.execute(sql).fetchall()
        except duckdb.Error as exc:
            raise ProgrammingError(
                f"the subquery over a public table fails: {str(exc).splitlines()[0][:200]}",
                sqlstate="42804",
                construct=snippet(node),
                position=position_of(node),
                hint="check the column types of the public table",
            ) from None


def public_rows(
    table: TablePolicy, query: exp.Select
) -> tuple[list[str], list[str], list[tuple[Any, ...]]]:
    """Output names, DuckDB types and rows of ``query`` over the public ``table`` alone
    (checked by the binder: scalar SQL and aggregates over its declared columns)."""
    data = _PublicData.of(table)
    try:
        with data._lock:
            cursor = data._con.execute(query.sql(dialect="duckdb"))
            rows = cursor.fetchall()
            description = cursor.description
    except duckdb.Error as exc:
        raise ProgrammingError(
            f"the query over public table {table.name!r} fails: {str(exc).splitlines()[0][:200]}",
            sqlstate="42804",
            construct=snippet(query),
            position=position_of(query),
            hint="check the column types of the public table",
        ) from None
    return [d[0] for d in description], [str(d[1]) for d in description], rows


def _literal(value: Any) -> exp.Expression:
    from dpsql.frontend.statements import to_literal

    return to_literal(value)


# -- joins --------------------------------------------------------------------------------------


class Joiner:
    def __init__(self, tree: exp.Select, policy: Policy) -> None:
        self.tree = tree
        self.policy = policy

    def refuse(self, message: str, node: exp.Expression | None, hint: str) -> PrivacyError:
        return _refuse(message, node, hint)

    def side(self, node: exp.Expression) -> JoinSide:
        alias = node.alias_or_name.lower()
        if isinstance(node, exp.Table) and isinstance(node.this, exp.Identifier):
            table = self.policy.table(node.name)
            if table is None and not self._is_cte(node.name):
                raise ProgrammingError(
                    f"unknown table {node.name!r}",
                    sqlstate=UndefinedTableError.sqlstate,
                    construct=snippet(node),
                    position=position_of(node),
                    hint="use a table declared in the policy: "
                    + ", ".join(sorted(self.policy.tables)),
                )
            return JoinSide(node, alias, table)
        return JoinSide(node, alias, None)

    def _is_cte(self, name: str) -> bool:
        with_ = self.tree.args.get("with_") or self.tree.args.get("with")
        return with_ is not None and any(
            c.alias_or_name.lower() == name.lower() for c in with_.expressions
        )

    def rewrite(self) -> exp.Select:
        from_ = self.tree.args.get("from_") or self.tree.args.get("from")
        if from_ is None:
            return self.tree
        first = self.side(from_.this)
        joins: list[exp.Join] = self.tree.args["joins"]
        sides = [first] + [self.side(j.this) for j in joins]
        private = [s for s in sides if not s.public]
        if not private:
            raise self.refuse(
                "a join of public tables only is not supported",
                joins[0],
                "join a public table to a private one, or query the public table in your tool",
            )
        if len(private) > 1:
            derived = next((s for s in private if s.table is None), None)
            if derived is not None:
                # private joins of policy tables were lowered before (dpsql.frontend.
                # private_joins); a derived table or CTE as a member is not
                raise self.refuse(
                    "a derived table or CTE cannot be a member of a join with another table",
                    derived.node,
                    "join the policy tables themselves (inside the derived table if needed: "
                    "FROM (SELECT ... FROM visits v JOIN patients p ON v.patient_id = "
                    "p.patient_id) AS x); a public table is joined by its own name",
                )
            same = private[0].table is private[1].table
            raise self.refuse(
                ("a self-join of a private table" if same else "a join of two private tables")
                + " that is not on their privacy unit is not supported: rows of one unit "
                "could combine with another's",
                private[1].node,
                "join private tables ON their privacy unit (or along a declared unit_path), "
                "or join them only with public tables (declared public = true)",
            )
        aliases = [s.alias for s in sides]
        duplicate = next((a for a in aliases if aliases.count(a) > 1), None)
        if duplicate is not None:
            raise self.refuse(
                f"two tables are named {duplicate!r} in FROM",
                joins[0],
                "give each joined table its own alias: JOIN departments d2 ON ...",
            )
        fact = private[0]
        public_groups = False
        dims: dict[str, _Dimension] = {}
        for join, side in zip(joins, sides[1:], strict=True):
            kind = self._kind(join, side, fact, first.public, len(joins))
            public_groups = public_groups or kind == "groups"
            dim_side = first if side is fact else side
            key, foreign = self._on(join, dim_side, fact)
            dims[dim_side.alias] = _Dimension(dim_side, key, foreign, kind == "left")
        return self._inline(fact, dims, public_groups)

    def _kind(
        self, join: exp.Join, side: JoinSide, fact: JoinSide, public_groups: bool, count: int
    ) -> str:
        join_side = (join.args.get("side") or "").upper()
        kind = (join.args.get("kind") or "").upper()
        if join.args.get("using"):
            raise self.refuse(
                "JOIN ... USING is not supported", join, "write ON v.col = d.key instead"
            )
        if kind == "CROSS" or join.args.get("on") is None:
            raise self.refuse(
                "cross joins (and FROM a, b) are not supported: every private row would "
                "meet every public row",
                join,
                _JOIN_HINT,
            )
        if kind in ("SEMI", "ANTI", "ASOF", "POSITIONAL") or join_side == "FULL":
            raise self.refuse(
                f"{(join_side + ' ' + kind).strip()} JOIN is not supported",
                join,
                "use INNER or LEFT JOIN, or WHERE col IN (SELECT key FROM public_table ...)",
            )
        if public_groups or join_side == "RIGHT":
            # FROM public LEFT JOIN private (or private RIGHT JOIN public): public groups
            wants = "LEFT" if public_groups else "RIGHT"
            if count != 1 or join_side != wants or (public_groups and side is not fact):
                raise self.refuse(
                    "public groups take one join: FROM public_table p LEFT JOIN private_table "
                    "t ON t.fk = p.key",
                    join,
                    "FROM departments d LEFT JOIN visits v ON v.dept_id = d.id GROUP BY d.name",
                )
            return "groups"
        return "left" if join_side == "LEFT" else "inner"

    def _on(self, join: exp.Join, dim: JoinSide, fact: JoinSide) -> tuple[str, exp.Column]:
        assert dim.table is not None
        on = column_equality(join.args["on"])
        if on is None:
            raise self.refuse(
                "a join with a public table needs ON private_column = public_key",
                join.args["on"],
                _JOIN_HINT + "; put other conditions in WHERE",
            )
        a, b = on.this, on.expression
        if self._is_dim_column(b, dim, fact) and not self._is_dim_column(a, dim, fact):
            public_col, foreign = b, a
        elif self._is_dim_column(a, dim, fact) and not self._is_dim_column(b, dim, fact):
            public_col, foreign = a, b
        else:
            raise self.refuse(
                f"the ON condition must compare a column of {dim.alias!r} with a column of "
                f"{fact.alias!r}",
                on,
                _JOIN_HINT,
            )
        if foreign.table and foreign.table.lower() != fact.alias:
            raise self.refuse(
                f"unknown table or alias {foreign.table!r} in {foreign.sql()!r}",
                foreign,
                _JOIN_HINT,
            )
        key = public_col.name.lower()
        if key not in dim.table.columns:
            raise self._no_column(public_col, dim)
        if key not in dim.table.unique_keys:
            declared = ", ".join(dim.table.unique_keys) or "none"
            raise self.refuse(
                f"{dim.table.name}.{key} is not a declared unique key of public table "
                f"{dim.table.name!r}: a private row could match several public rows, so its "
                "contribution would multiply",
                on,
                f"join ON a unique key (declared: {declared}), or declare "
                f'primary_key = "{key}" / unique = ["{key}"] in [tables.{dim.table.name}] '
                "if its values are unique",
            )
        spec = fact.table.columns.get(foreign.name.lower()) if fact.table is not None else None
        if spec is not None and not comparable(spec.type, dim.table.columns[key].type):
            assert fact.table is not None
            raise mismatched_join(
                on,
                f"{fact.table.name}.{spec.name}",
                spec.type,
                f"{dim.table.name}.{key}",
                dim.table.columns[key].type,
            )
        return key, foreign

    def _is_dim_column(self, col: exp.Column, dim: JoinSide, fact: JoinSide) -> bool:
        if col.table:
            return col.table.lower() == dim.alias
        assert dim.table is not None
        in_dim = col.name.lower() in dim.table.columns
        in_fact = fact.table is not None and col.name.lower() in fact.table.columns
        if in_dim and in_fact:
            raise self._ambiguous(col, [dim.alias, fact.alias])
        return in_dim

    def _ambiguous(self, col: exp.Column, aliases: Sequence[str]) -> ProgrammingError:
        return ambiguous_column(col, aliases)

    def _no_column(self, col: exp.Column, dim: JoinSide) -> ProgrammingError:
        assert dim.table is not None
        return ProgrammingError(
            f"unknown column {col.name!r} in table {dim.table.name!r}",
            sqlstate=UndefinedColumnError.sqlstate,
            construct=snippet(col),
            position=position_of(col),
            hint="columns declared in the policy: " + ", ".join(dim.table.columns),
        )

    # -- the inlined query ----------------------------------------------------------------
    def _inline(
        self, fact: JoinSide, dims: dict[str, _Dimension], public_groups: bool
    ) -> exp.Select:
        result = self.tree.copy()
        result.set("joins", None)
        result.set("from_", exp.From(this=fact.node.copy()))
        # Keep output names: SELECT d.name ... answers a column called name.
        items = []
        for item in result.expressions:
            if isinstance(item, exp.Column) and not isinstance(item.this, exp.Star):
                item = exp.alias_(item, item.name, quoted=item.this.args.get("quoted", False))
            items.append(item)
        result.set("expressions", items)

        def lookup(col: exp.Column, dim: _Dimension, in_aggregate: bool) -> exp.Expression:
            assert dim.side.table is not None
            table = dim.side.table
            name = col.name.lower()
            if name not in table.columns:
                raise self._no_column(col, dim.side)
            if public_groups and in_aggregate:
                raise self.refuse(
                    f"with public groups, aggregates read the private table only, not "
                    f"{snippet(col)}",
                    col,
                    f"aggregate a column of {fact.alias!r}, e.g. COUNT({fact.alias}.<column>)",
                )
            names = list(table.columns)
            k, v = names.index(dim.key), names.index(name)
            ifs = [
                exp.If(
                    this=exp.EQ(this=dim.foreign.copy(), expression=_literal(row[k])),
                    true=_literal(row[v]),
                )
                for row in dim.rows()
                if row[k] is not None and row[v] is not None
            ]
            # in the public table's row order: a set's order of strings follows the process's
            # hash seed, and so did the answer key of the same query in another process
            values = dict.fromkeys(row[v] for row in dim.rows() if row[k] is not None)
            if dim.keep_unmatched:
                values[None] = None
            node: exp.Expression = (
                exp.Case(ifs=ifs) if ifs else exp.Cast(this=exp.Null(), to=_type(table, name))
            )
            node.meta[PUBLIC_VALUES] = tuple(values)
            return node

        def dimension_of(col: exp.Column) -> _Dimension | None:
            if col.table:
                return dims.get(col.table.lower())
            name = col.name.lower()
            owners = [a for a, d in dims.items() if name in d.side.table.columns]  # type: ignore[union-attr]
            if not owners:
                return None
            in_fact = fact.table is not None and name in fact.table.columns
            if in_fact or len(owners) > 1:
                raise self._ambiguous(col, ([fact.alias] if in_fact else []) + owners)
            if fact.table is None:
                return None  # a derived table's column (checked when it is inlined)
            return dims[owners[0]]

        def substitute(node: exp.Expression) -> exp.Expression:
            if isinstance(node, exp.Star) and public_groups and isinstance(node.parent, exp.Count):
                raise self.refuse(
                    "with public groups, COUNT(*) would count one row for each empty group",
                    node.parent,
                    f"count the private rows: COUNT({fact.alias}."
                    f"{(fact.table.privacy_unit if fact.table else None) or '<column>'})",
                )
            if not isinstance(node, exp.Column) or isinstance(node.this, exp.Star):
                return node
            dim = dimension_of(node)
            if dim is None:
                return node
            return lookup(node, dim, node.find_ancestor(exp.AggFunc) is not None)

        transform_clauses(result, substitute)
        if public_groups and result.args.get("expressions"):
            for count in result.find_all(exp.Count):
                if count.this is None or isinstance(count.this, exp.Literal | exp.Boolean):
                    raise self.refuse(
                        "with public groups, COUNT(*) would count one row for each empty group",
                        count,
                        f"count the private rows: COUNT({fact.alias}.<column>)",
                    )
        # INNER: a private row stays only if a public row matches it.
        kept = [
            exp.In(this=d.foreign.copy(), expressions=[_literal(k) for k in d.key_values()])
            if d.key_values()
            else exp.false()
            for d in dims.values()
            if not d.keep_unmatched
        ]
        if kept:
            where = result.args.get("where")
            parts = [*kept] + ([exp.Paren(this=where.this)] if where is not None else [])
            result.set("where", exp.Where(this=exp.and_(*parts)))
        result.meta[JOINED] = tuple(
            f"{'LEFT' if d.keep_unmatched else 'INNER'} JOIN public {d.side.table.name} "  # type: ignore[union-attr]
            f"ON {d.foreign.sql()} = {d.side.alias}.{d.key} (unique key)"
            + (": public groups" if public_groups else "")
            for d in dims.values()
        )
        return result


def _type(table: TablePolicy, column: str) -> exp.DataType:
    from dpsql.policy import SQL_TYPES

    return exp.DataType.build(SQL_TYPES[table.columns[column].type])
