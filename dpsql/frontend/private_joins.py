"""Joins between private tables on the privacy unit, lowered to one private relation.

``FROM visits v JOIN patients p ON v.patient_id = p.patient_id`` becomes a query over one
virtual table, ``visits JOIN patients``: its columns are the joined tables' columns (a name two
tables share is qualified, ``v_visit_id``), its privacy unit the shared unit, its bounds those
of the table whose rows the join keeps. The binder and the planner see a single private table;
the compiler renders its source as a real JOIN of the policy tables in the engine's FROM
(dpsql.lower.sources, from the plan's read node: dpsql.plan.tree.read_node), built from the
validated plan only, and the existing keyed-hash bounding runs on the joined rows.

Stability. A join is accepted when its ON condition makes both rows belong to the same unit:

- ``a.unit = b.unit`` (both tables declare the same privacy_unit), or
- a step of a declared unit_path, ``a.fk = b.key`` where a's unit is reached through b.key
  (b.key a declared unique key); the generated ON adds ``a.unit = b.unit``.

So every joined row belongs to exactly one unit, and removing a unit from every table removes
exactly its joined rows: the other units' joined rows are unchanged. A unit's joined rows can
be more than its rows in either table (n visits x m rows), but bounding AFTER the join keeps at
most R of them per group and G groups per unit, so the sensitivity of every aggregate is what
it is for one table with those bounds. Which R and G: those of the table whose multiplicity the
join keeps (the other side joins on a declared unique key, so each row meets at most one row);
a join where neither side is unique on the ON columns (many-to-many within a unit: the answer
would count pairs) is refused, as is every join not on the unit (rows of two units would meet),
cross joins, RIGHT/FULL joins and ON conditions other than one equality of columns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from sqlglot import exp

from dpsql.errors import PrivacyError, ProgrammingError, UndefinedColumnError, UndefinedTableError
from dpsql.frontend.logic import column_equality, mismatched_join, transform_clauses
from dpsql.frontend.per_unit import PerUnitSpec
from dpsql.frontend.positions import position_of, snippet
from dpsql.policy import ColumnPolicy, JoinedSource, JoinStep, Policy, TablePolicy, comparable

if TYPE_CHECKING:
    from dpsql.frontend.joins import Joiner
    from dpsql.frontend.joins import JoinSide as PublicSide

    # a dimension: its side, its unique key, the private column joined on, LEFT or not
    Dimension = tuple[PublicSide, str, exp.Column, bool]

_HINT = (
    "join private tables ON their privacy unit (FROM visits v JOIN patients p ON "
    "v.patient_id = p.patient_id) or along a declared unit_path (ON r.encounter_id = "
    "e.encounter_id)"
)


@dataclass(frozen=True)
class JoinSide:
    node: exp.Expression
    alias: str  # as the analyst wrote it
    table: TablePolicy
    internal: str  # j0, j1, ... in the engine SQL
    kind: str  # "", "INNER", "LEFT"


@dataclass(frozen=True)
class PerUnitSource(JoinedSource):
    """A per-unit relation (dpsql.frontend.per_unit): its one step is the base table, its rows
    one per unit (per key), computed after bounding. A JoinedSource so that every path that
    reads a private join's own relation (no prepared store, no column program, a shadow table
    for typing) treats it the same way."""

    spec: PerUnitSpec | None = None

    @functools.cached_property
    def identity(self) -> str:
        """V's whole definition (base table, WHERE, keys, aggregates, ranges, R and G), and
        the base's own join when it is one (its name alone does not say which rows it yields)."""
        base = self.steps[0].table
        joined = base.joined.identity if base.joined is not None else ""
        assert self.spec is not None
        return f"per-unit\n{self.spec.identity}\n{base.name}\n{joined}"


def per_unit_source(base: TablePolicy, spec: PerUnitSpec, description: str) -> PerUnitSource:
    return PerUnitSource(
        steps=(JoinStep(base, "r"),), outputs=(), description=description, spec=spec
    )


# -- the query rewrite ----------------------------------------------------------------------


def resolve_private_joins(tree: exp.Select, policy: Policy) -> tuple[exp.Select, Policy]:
    """``tree`` over one virtual table if its FROM joins two or more private tables (and the
    policy with that table); otherwise both unchanged. Refusals are decided from the text and
    the policy alone: nothing is read."""
    tree, policy = _resolve_nested(tree, policy)
    joins = tree.args.get("joins") or []
    from_ = tree.args.get("from_") or tree.args.get("from")
    if not joins or from_ is None:
        return tree, policy
    nodes = [from_.this, *(j.this for j in joins)]
    if not all(isinstance(n, exp.Table) and isinstance(n.this, exp.Identifier) for n in nodes):
        return tree, policy  # derived tables and CTEs: dpsql.frontend.joins decides
    tables = [policy.table(n.name) for n in nodes]
    if any(t is None for t in tables):
        return tree, policy
    if sum(not t.public for t in tables if t) >= 2:
        tree, policy = _Lowering(tree, policy).run()
    return _lower_public(tree, policy)


def _resolve_nested(tree: exp.Select, policy: Policy) -> tuple[exp.Select, Policy]:
    """The joins inside the FROM's derived table and inside each CTE, lowered in place (their
    bodies then read one virtual table, which dpsql.frontend.inline inlines or wraps like any
    other): ``FROM (SELECT p.sex, v.cost FROM visits v JOIN patients p ON ...) AS x`` is
    admitted or refused exactly as the flat join is."""
    from dpsql.frontend.joins import resolve_joins

    def lowered(body: exp.Select) -> exp.Select | None:
        nonlocal policy
        new, policy = resolve_private_joins(body, policy)
        new = resolve_joins(new, policy)
        return None if new is body else new

    def arg(select: exp.Select, *names: str) -> Any:
        return next((select.args[n] for n in names if select.args.get(n) is not None), None)

    out = tree
    with_ = arg(tree, "with_", "with")
    for i, cte in enumerate(with_.expressions if with_ is not None else []):
        if isinstance(cte.this, exp.Select) and (new := lowered(cte.this)) is not None:
            out = tree.copy() if out is tree else out
            arg(out, "with_", "with").expressions[i].set("this", new)
    from_ = arg(tree, "from_", "from")
    source = from_.this if from_ is not None else None
    if (
        isinstance(source, exp.Subquery)
        and isinstance(source.this, exp.Select)
        and (new := lowered(source.this)) is not None
    ):
        out = tree.copy() if out is tree else out
        arg(out, "from_", "from").this.set("this", new)
    return out, policy


class _Lowering:
    def __init__(self, tree: exp.Select, policy: Policy) -> None:
        self.tree = tree
        self.policy = policy
        self._on: dict[str, tuple[tuple[str, str, str, str], ...]] = {}  # by internal alias

    def refuse(self, message: str, node: exp.Expression | None, hint: str = _HINT) -> PrivacyError:
        return PrivacyError(
            message,
            construct=snippet(node) if node is not None else None,
            position=position_of(node),
            hint=hint,
        )

    def run(self) -> tuple[exp.Select, Policy]:
        from_ = self.tree.args.get("from_") or self.tree.args.get("from")
        joins: list[exp.Join] = self.tree.args["joins"]
        assert from_ is not None  # resolve_private_joins checked
        first = from_.this
        first_table = self.policy.table(first.name)
        assert first_table is not None
        if first_table.public:
            raise self.refuse(
                "public groups (FROM public_table LEFT JOIN ...) over a join of private "
                "tables are not supported",
                first,
                "start FROM a private table; GROUP BY the public column still releases "
                "every public key",
            )
        aliases = [first.alias_or_name.lower(), *(j.this.alias_or_name.lower() for j in joins)]
        duplicate = next((a for a in aliases if aliases.count(a) > 1), None)
        if duplicate is not None:
            raise self.refuse(
                f"two tables are named {duplicate!r} in FROM",
                joins[0],
                "give each joined table its own alias: FROM visits a JOIN visits b ON ...",
            )
        private = [JoinSide(first, aliases[0], first_table, "j0", "")]
        driver = private[0]
        public_joins: list[exp.Join] = []
        for join, alias in zip(joins, aliases[1:], strict=True):
            table = self.policy.table(join.this.name)
            assert table is not None
            if table.public:
                public_joins.append(join)
                continue
            side = JoinSide(join.this, alias, table, f"j{len(private)}", self._kind(join))
            driver = self._check_on(join, side, private, driver)
            private.append(side)
        return self._rewrite(private, driver, public_joins)

    def _kind(self, join: exp.Join) -> str:
        side = (join.args.get("side") or "").upper()
        kind = (join.args.get("kind") or "").upper()
        if kind == "CROSS" or (join.args.get("on") is None and not join.args.get("using")):
            raise self.refuse(
                "cross joins (and FROM a, b) of private tables are not supported: every row "
                "of one unit would meet every row of the others",
                join,
            )
        if join.args.get("using"):
            raise self.refuse(
                "JOIN ... USING is not supported", join, "write ON a.patient_id = b.patient_id"
            )
        if side in ("RIGHT", "FULL") or kind in ("SEMI", "ANTI", "ASOF", "POSITIONAL"):
            raise self.refuse(
                f"{(side + ' ' + kind).strip()} JOIN of private tables is not supported",
                join,
                "use INNER or LEFT JOIN (put the table whose rows you keep first)",
            )
        return "LEFT" if side == "LEFT" else "INNER"

    # -- the ON condition ----------------------------------------------------------------
    def _check_on(
        self, join: exp.Join, side: JoinSide, before: list[JoinSide], driver: JoinSide
    ) -> JoinSide:
        """Refuse unless ON matches rows of one unit; the side whose multiplicity the
        joined relation has (its R and G bound it) after this join."""
        on = column_equality(join.args["on"])
        if on is None:
            raise self.refuse(
                "a join of private tables needs ON one equality of columns",
                join.args["on"],
                _HINT + "; put other conditions in WHERE",
            )
        owners = [self._owner(c, [*before, side]) for c in (on.this, on.expression)]
        mine = [i for i, o in enumerate(owners) if o is side]
        if len(mine) != 1:
            raise self.refuse(
                f"the ON condition must compare a column of {side.alias!r} with a column of "
                "a table joined before it",
                on,
            )
        b_col = (on.this, on.expression)[mine[0]].name.lower()
        a_col = (on.this, on.expression)[1 - mine[0]].name.lower()
        a = owners[1 - mine[0]]
        self._check_unit(on, a, a_col, side, b_col)
        self._check_types(on, a, a_col, side, b_col)
        self._on[side.internal] = self._on_pairs(a, a_col, side, b_col)
        if b_col in side.table.unique_keys:
            return driver  # each row meets at most one row of the new table
        if a_col in a.table.unique_keys and before == [a]:
            return side  # one row of the first table per row of the new one
        raise self.refuse(
            f"the join of {a.table.name!r} and {side.table.name!r} ON {a_col} = {b_col} is "
            "many-to-many within a unit: each of a unit's rows in one table would meet each "
            "of its rows in the other, and the answer would count those pairs",
            on,
            f'declare primary_key = "{b_col}" (or unique) in [tables.{side.table.name}] if it '
            "has one row per key, or aggregate each table in its own query",
        )

    def _check_unit(
        self, on: exp.Expression, a: JoinSide, a_col: str, b: JoinSide, b_col: str
    ) -> None:
        unit_a, unit_b = a.table.privacy_unit, b.table.privacy_unit
        direct = (
            unit_a is not None
            and unit_a == unit_b
            and (a_col, b_col) == (unit_a, unit_b)
            and not a.table.unit_path
        )
        if direct and not b.table.unit_path:
            return
        for x, x_col, y, y_col in ((a, a_col, b, b_col), (b, b_col, a, a_col)):
            path = x.table.unit_path
            if path and path[0] == (x_col, y.table.name, y_col):
                return
        if unit_a != unit_b:
            raise self.refuse(
                f"{a.table.name!r} and {b.table.name!r} have different privacy units "
                f"({unit_a} and {unit_b}): no join between them keeps one unit per row",
                on,
                "aggregate each table in its own query",
            )
        what = "a self-join" if a.table is b.table else "a join of private tables"
        raise self.refuse(
            f"{what} ON {a_col} = {b_col} is not on the privacy unit {unit_a!r}: rows of two "
            "units could meet, and one unit would change the other's rows",
            on,
        )

    def _check_types(self, on: exp.EQ, a: JoinSide, a_col: str, b: JoinSide, b_col: str) -> None:
        """Both sides of the ON in one comparison family (dpsql.policy.comparable): the
        engine's join then casts nothing and cannot fail on any value."""
        ta, tb = a.table.columns[a_col].type, b.table.columns[b_col].type
        if not comparable(ta, tb):
            raise mismatched_join(on, f"{a.table.name}.{a_col}", ta, f"{b.table.name}.{b_col}", tb)

    def _on_pairs(
        self, a: JoinSide, a_col: str, b: JoinSide, b_col: str
    ) -> tuple[tuple[str, str, str, str], ...]:
        pairs = [(a.internal, a_col, b.internal, b_col)]
        unit_a, unit_b = a.table.privacy_unit, b.table.privacy_unit
        if (a_col, b_col) != (unit_a, unit_b):
            # a unit_path step: the key reaches the unit; say so in the engine's ON too,
            # so that every joined row has one unit by construction
            pairs.append((a.internal, unit_a, b.internal, unit_b))  # type: ignore[arg-type]
        return tuple(pairs)

    def _owner(self, col: exp.Column, sides: list[JoinSide]) -> JoinSide:
        if col.table:
            found = [s for s in sides if s.alias == col.table.lower()]
            if not found:
                raise ProgrammingError(
                    f"unknown table or alias {col.table!r} in {col.sql()!r}",
                    sqlstate=UndefinedTableError.sqlstate,
                    construct=snippet(col),
                    position=position_of(col),
                    hint="qualify it with a table joined so far: "
                    + ", ".join(s.alias for s in sides),
                )
            if col.name.lower() not in found[0].table.columns:
                raise self._no_column(col, found[0].table)
            return found[0]
        found = [s for s in sides if col.name.lower() in s.table.columns]
        if len(found) != 1:
            if not found:
                raise self._no_column(col, sides[-1].table)
            raise self._ambiguous(col, [s.alias for s in found])
        return found[0]

    def _no_column(self, col: exp.Column, table: TablePolicy) -> ProgrammingError:
        return ProgrammingError(
            f"unknown column {col.name!r} in table {table.name!r}",
            sqlstate=UndefinedColumnError.sqlstate,
            construct=snippet(col),
            position=position_of(col),
            hint="columns declared in the policy: " + ", ".join(table.columns),
        )

    def _ambiguous(self, col: exp.Column, aliases: list[str]) -> ProgrammingError:
        from dpsql.frontend.joins import ambiguous_column

        return ambiguous_column(col, aliases)

    # -- the virtual table ---------------------------------------------------------------
    def _rewrite(
        self, private: list[JoinSide], driver: JoinSide, public_joins: list[exp.Join]
    ) -> tuple[exp.Select, Policy]:
        unit = private[0].table.privacy_unit
        assert unit is not None
        names: dict[tuple[str, str], str] = {}  # (alias, column) -> virtual column
        columns: dict[str, ColumnPolicy] = {}
        outputs: list[tuple[str, str, str]] = [(unit, "j0", unit)]
        counts: dict[str, int] = {}
        for s in private:
            for c in s.table.columns:
                counts[c] = counts.get(c, 0) + 1
        for s in private:
            for c, spec in s.table.columns.items():
                if c == unit and s.table.privacy_unit == unit and (s.kind != "LEFT"):
                    # the unit, equal on every INNER-joined side: one column
                    names[(s.alias, c)] = unit
                    columns.setdefault(unit, replace(spec, name=unit))
                    continue
                # named by table (and position, in a self-join), never by the analyst's
                # alias: a virtual table's name always has the same columns
                twice = [t.table.name for t in private].count(s.table.name) > 1
                prefix = f"{s.table.name}{s.internal[1:]}" if twice else s.table.name
                name = c if counts[c] == 1 else f"{prefix}_{c}"
                while name in columns or (name != c and name in counts):
                    name += "_"
                names[(s.alias, c)] = name
                columns[name] = replace(spec, name=name, nullable=spec.nullable or s.kind == "LEFT")
                outputs.append((name, s.internal, c))
        steps = tuple(
            JoinStep(s.table, s.internal, s.kind, self._on.get(s.internal, ())) for s in private
        )
        description = " ".join(
            (f"{s.kind} JOIN " if s.kind else "") + f"{s.table.name} {s.alias}" for s in private
        )
        versions = [s.table.version or "" for s in private]
        virtual = TablePolicy(
            name=" ".join((f"{s.kind} JOIN " if s.kind else "") + s.table.name for s in private),
            source="",
            source_path=None,
            columns=columns,
            privacy_unit=unit,
            # "auto" bounds are chosen on single-table queries only: the driver's fallback
            max_rows_per_unit=driver.table.unchosen_bounds()[0],
            max_groups_per_unit=driver.table.unchosen_bounds()[1],
            version="|".join(versions) if any(versions) else None,
            joined=JoinedSource(steps, tuple(outputs), description + f" (on the unit {unit})"),
        )
        result = self._rewritten_tree(private, names, virtual, public_joins)
        tables = {**self.policy.tables, virtual.name.lower(): virtual}
        return result, replace(self.policy, tables=tables)

    def _rewritten_tree(
        self,
        private: list[JoinSide],
        names: dict[tuple[str, str], str],
        virtual: TablePolicy,
        public_joins: list[exp.Join],
    ) -> exp.Select:
        by_alias = {s.alias: s for s in private}
        public = {j.this.alias_or_name.lower() for j in public_joins}
        public_columns = {
            c
            for j in public_joins
            for c in (self.policy.table(j.this.name).columns)  # type: ignore[union-attr]
        }

        def fix(node: exp.Expression) -> exp.Expression:
            if not isinstance(node, exp.Column) or isinstance(node.this, exp.Star):
                return node
            if node.find_ancestor(exp.Select) is not result:
                return node  # a subquery's own column (IN (SELECT ... FROM departments))
            name = node.name.lower()
            if node.table:
                side = by_alias.get(node.table.lower())
                if side is None:
                    return node  # a public table's column: dpsql.frontend.joins
                if name not in side.table.columns:
                    raise self._no_column(node, side.table)
                return exp.column(names[(side.alias, name)])
            owners = [s for s in private if name in s.table.columns]
            if not owners:
                return node  # a public column, or unknown (the binder says which)
            if len(owners) > 1 and len({names[(s.alias, name)] for s in owners}) > 1:
                raise self._ambiguous(node, [s.alias for s in owners])
            if name in public_columns:
                raise self._ambiguous(node, [owners[0].alias, *sorted(public)])
            return exp.column(names[(owners[0].alias, name)])

        result = _aliased_copy(self.tree)
        _read_virtual(result, virtual, fix)
        kept = []
        for join in result.args.get("joins") or []:
            if join.this.alias_or_name.lower() in public:
                kept.append(join.transform(fix, copy=False))
        result.set("joins", kept or None)
        return result


# -- public dimensions as a real JOIN ---------------------------------------------------------

# False: joins with public tables keep the lookup lowering (dpsql.frontend.joins) -- for
# bench/bench_joins.py, which measures both (docs/performance.md, "Joins").
REAL_PUBLIC_JOINS = True


def _lower_public(tree: exp.Select, policy: Policy) -> tuple[exp.Select, Policy]:
    """``FROM private JOIN public ON private.fk = public.key`` (INNER or LEFT, one or more
    dimensions) as one virtual table whose source is a real JOIN with the public rows.

    The checks are dpsql.frontend.joins' (a declared unique key, one equality, no cross or
    FULL join), and so is the stability: each private row meets at most one public row, so
    the relation is 1-stable and bounding (after the join) sees each private row once. A
    public column's values are public: its domain is the public table's values (NULL too for
    a LEFT JOIN), released without thresholding like the lookup lowering's. Public groups
    (FROM public LEFT JOIN private) stay with the lookup lowering.
    """
    from dpsql.frontend.joins import JOINED, Joiner

    joins = tree.args.get("joins") or []
    if not REAL_PUBLIC_JOINS:
        return tree, policy
    from_ = tree.args.get("from_") or tree.args.get("from")
    if not joins or from_ is None:
        return tree, policy
    nodes = [from_.this, *(j.this for j in joins)]
    if not all(isinstance(n, exp.Table) and isinstance(n.this, exp.Identifier) for n in nodes):
        return tree, policy
    joiner = Joiner(tree, policy)
    fact, *dims = [joiner.side(n) for n in nodes]
    aliases = [s.alias for s in (fact, *dims)]
    if fact.table is None or fact.public or not all(d.public for d in dims):
        return tree, policy
    if len(set(aliases)) != len(aliases):
        return tree, policy  # dpsql.frontend.joins refuses it
    lowered: list[Dimension] = []
    for join, dim in zip(joins, dims, strict=True):
        kind = joiner._kind(join, dim, fact, False, len(joins))
        if kind == "groups":
            return tree, policy
        key, foreign = joiner._on(join, dim, fact)
        if foreign.name.lower() not in fact.table.columns:
            raise joiner._no_column(foreign, fact)
        lowered.append((dim, key, foreign, kind == "left"))
    return _public_virtual(tree, policy, joiner, fact, lowered, JOINED)


def _public_virtual(
    tree: exp.Select,
    policy: Policy,
    joiner: Joiner,
    fact: PublicSide,
    lowered: list[Dimension],
    joined_meta: str,
) -> tuple[exp.Select, Policy]:
    fact_table = _table_of(fact)
    columns: dict[str, ColumnPolicy] = dict(fact_table.columns)
    outputs = [(c, "j0", c) for c in fact_table.columns]
    if fact_table.privacy_unit is not None and fact_table.privacy_unit not in columns:
        outputs.append((fact_table.privacy_unit, "j0", fact_table.privacy_unit))
    names: dict[tuple[str, str], str] = {}
    seen: dict[str, int] = {}
    for dim, *_ in lowered:
        for c in _table_of(dim).columns:
            seen[c] = seen.get(c, 0) + 1
    steps = [JoinStep(fact_table, "j0")]
    for i, (dim, key, foreign, left) in enumerate(lowered, start=1):
        table = _table_of(dim)
        rows = [r for r in table.rows or () if r[list(table.columns).index(key)] is not None]
        for position, (c, spec) in enumerate(table.columns.items()):
            name = c if c not in fact_table.columns and seen[c] == 1 else f"{table.name}_{c}"
            while name in columns:
                name += "_"
            values = {r[position] for r in rows}
            columns[name] = _public_column(spec, name, values, left)
            names[(dim.alias, c)] = name
            outputs.append((name, f"j{i}", c))
        kind = "LEFT" if left else "INNER"
        fk = foreign.name.lower()
        if not left:  # an INNER join keeps the rows whose key is a public key: its domain
            keys = {r[list(table.columns).index(key)] for r in rows}
            spec = columns[fk]
            if spec.values is not None:
                keys &= set(spec.values)
            columns[fk] = replace(spec, values=tuple(sorted(keys)), nullable=False)
        on = (("j0", fk, f"j{i}", key),)
        steps.append(JoinStep(replace(table, rows=tuple(rows)), f"j{i}", kind, on))
    description = " ".join(
        [fact_table.name]
        + [f"{'LEFT' if left else 'INNER'} JOIN {_table_of(d).name}" for d, *_, left in lowered]
    )
    virtual = replace(
        fact_table,
        name=description,
        source="",
        source_path=None,
        columns=columns,
        unique_keys=(),
        unit_path=(),
        joined=JoinedSource(tuple(steps), tuple(outputs), description + " (public, unique keys)"),
    )
    result = _rename_public(tree, joiner, fact, lowered, names, virtual)
    result.meta[joined_meta] = tuple(
        f"{'LEFT' if left else 'INNER'} JOIN public {_table_of(d).name} ON {foreign.sql()} = "
        f"{d.alias}.{key} (unique key, a real JOIN)"
        for d, key, foreign, left in lowered
    )
    tables = {**policy.tables, virtual.name.lower(): virtual}
    return result, replace(policy, tables=tables)


def _table_of(side: PublicSide) -> TablePolicy:
    assert side.table is not None  # _lower_public lowers policy tables only
    return side.table


def _public_column(spec: ColumnPolicy, name: str, values: set[Any], left: bool) -> ColumnPolicy:
    """A public column of the join: its public values are its domain (NULL: a LEFT JOIN's
    unmatched rows, or a NULL in the public table); numbers get their range from them."""
    present = sorted(v for v in values if v is not None)
    nullable = left or None in values
    lower, upper = spec.lower, spec.upper
    if spec.numeric and not spec.bounded and present:
        lower, upper = float(min(present)), float(max(present))
    return replace(
        spec, name=name, values=tuple(present), nullable=nullable, lower=lower, upper=upper
    )


def _rename_public(
    tree: exp.Select,
    joiner: Joiner,
    fact: PublicSide,
    lowered: list[Dimension],
    names: dict[tuple[str, str], str],
    virtual: TablePolicy,
) -> exp.Select:
    by_alias = {d.alias: d for d, *_ in lowered}
    fact_table = _table_of(fact)

    def fix(node: exp.Expression) -> exp.Expression:
        if not isinstance(node, exp.Column) or isinstance(node.this, exp.Star):
            return node
        if node.find_ancestor(exp.Select) is not result:
            return node
        name = node.name.lower()
        if node.table:
            qualifier = node.table.lower()
            if qualifier == fact.alias:
                return exp.column(name)
            dim = by_alias.get(qualifier)
            if dim is None:
                return node  # the binder names the unknown qualifier
            if name not in _table_of(dim).columns:
                raise joiner._no_column(node, dim)
            return exp.column(names[(dim.alias, name)])
        owners = [d for d, *_ in lowered if name in _table_of(d).columns]
        in_fact = name in fact_table.columns
        if owners and (in_fact or len(owners) > 1):
            raise joiner._ambiguous(
                node, ([fact.alias] if in_fact else []) + [d.alias for d in owners]
            )
        if owners:
            return exp.column(names[(owners[0].alias, name)])
        return exp.column(name) if in_fact else node

    result = _aliased_copy(tree)
    _read_virtual(result, virtual, fix)
    result.set("joins", None)
    return result


def _aliased_copy(tree: exp.Select) -> exp.Select:
    """A copy of ``tree`` whose bare select-list columns are aliased to their own names: the
    released columns keep the names the analyst wrote once the columns are renamed."""
    result = tree.copy()
    items = []
    for item in result.expressions:
        if isinstance(item, exp.Column) and not isinstance(item.this, exp.Star):
            item = exp.alias_(item, item.name, quoted=item.this.args.get("quoted", False))
        items.append(item)
    result.set("expressions", items)
    return result


def _read_virtual(
    result: exp.Select, virtual: TablePolicy, fix: Callable[[exp.Expression], exp.Expression]
) -> None:
    """``result``'s clauses with every column renamed by ``fix``, reading FROM ``virtual``."""
    transform_clauses(result, fix)
    source = exp.Table(this=exp.Identifier(this=virtual.name, quoted=True))
    result.set("from_", exp.From(this=source))
