"""The FROM of a plan, lowered from the relational node that reads its table.

A stored table is its quoted name. A virtual table of private tables joined on the unit (or a
unit_path table) is the JOIN of its sides as a derived table with the virtual table's columns
(dpsql.frontend.private_joins validated it): each side a stored table under its internal
alias, a public table as the rows the policy holds (a typed VALUES list), a per-unit relation
(bounded, then grouped by the unit, from the spec dpsql.frontend.per_unit validated) or a join
again, ON the side's condition tree. Everything is read off the nodes (dpsql.plan.tree.read_node
puts it there): the lowerings never go back to the policy's join records, and no text is
parsed. Bounding runs on these rows, after the join.
"""

from __future__ import annotations

import math
from typing import Any

from sqlglot import exp

from dpsql.frontend.per_unit import PerUnitColumn, PerUnitSpec
from dpsql.frontend.safety import guarded
from dpsql.frontend.statements import to_literal
from dpsql.lower.builders import table_ref
from dpsql.lower.hashing import keyed_hash, secret_slot
from dpsql.plan.relational import (
    Filter,
    JoinedRows,
    PerUnit,
    Project,
    PublicJoin,
    PublicRows,
    Scan,
)
from dpsql.policy import SQL_TYPES

#: the derived table's name for a joined read
SOURCE_ALIAS = "__src"


def read_of(rows: object) -> Scan | PerUnit | PublicRows:
    """The node that reads the table under the rows a plan's Bound node reads
    (dpsql.plan.tree.relational_nodes: [Project] over [Filter] over [PublicJoin] over it)."""
    node = rows
    while isinstance(node, Project | Filter | PublicJoin):
        node = node.input
    assert isinstance(node, Scan | PerUnit | PublicRows), "the rows end in their read"
    return node


def stored_scan(rows: object) -> Scan | None:
    """The Scan under ``rows`` when it reads a stored table by its name (what the column
    programs and the prepared store hold); None for a join, a unit_path table or a per-unit
    relation, which only the engine's SQL reads."""
    node = read_of(rows)
    return node if isinstance(node, Scan) and node.source is None else None


def source(node: Scan | PerUnit | PublicRows) -> exp.Expression:
    """The FROM for ``node``: a stored table's quoted name, or its rows as a derived table
    named ``__src``."""
    if isinstance(node, Scan) and node.source is None:
        return table_ref(node.table, quoted=True)
    return _side(node, SOURCE_ALIAS)


def _side(node: Scan | PerUnit | PublicRows, alias: str | None) -> exp.Expression:
    ident = exp.Identifier(this=alias, quoted=False) if alias else None
    if isinstance(node, PublicRows):
        return _public_values(node, ident)
    if isinstance(node, PerUnit):
        return exp.Subquery(this=per_unit(node), alias=exp.TableAlias(this=ident))
    if node.source is None:
        table = exp.Table(this=exp.Identifier(this=node.table, quoted=True))
        if ident is not None:
            table.set("alias", exp.TableAlias(this=ident))
        return table
    return exp.Subquery(this=_joined(node.source), alias=exp.TableAlias(this=ident))


def _joined(joined: JoinedRows) -> exp.Select:
    """The join's SELECT: the virtual table's columns over its sides, in order."""
    first, *rest = joined.sides
    joins = []
    for side in rest:
        assert side.on is not None  # every side after the first is joined ON its condition
        joins.append(
            exp.Join(
                this=_side(side.rows, side.alias),
                side="LEFT" if side.kind == "LEFT" else None,
                on=side.on.copy(),
            )
        )
    return exp.Select(
        expressions=[
            exp.Alias(this=_column(a, c), alias=exp.Identifier(this=name, quoted=True))
            for name, a, c in joined.outputs
        ],
        from_=exp.From(this=_side(first.rows, first.alias)),
        joins=joins,
    )


def per_unit(node: PerUnit) -> exp.Select:
    """A per-unit relation as engine SQL, from its node only: the base's rows under the inner
    WHERE (each conjunct bare where it is total, the others under TRY) that belong to a unit,
    bounded, then grouped by the unit (the spec: dpsql.frontend.per_unit.PerUnitSpec)."""
    spec = node.spec
    assert spec is not None  # a per-unit read carries its spec (dpsql.plan.tree.read_node)
    conditions = guarded(node.where)
    unit = exp.column(spec.unit, quoted=True)
    conditions.append(exp.Not(this=exp.Is(this=unit, expression=exp.Null())))
    return _relation(spec, _side(node.input, SOURCE_ALIAS), conditions, list(node.stored))


def _clamp(x: exp.Expression, lower: float, upper: float) -> exp.Expression:
    ifs = []
    if math.isfinite(lower):
        ifs.append(exp.If(this=exp.LT(this=x.copy(), expression=_num(lower)), true=_num(lower)))
    if math.isfinite(upper):
        ifs.append(exp.If(this=exp.GT(this=x.copy(), expression=_num(upper)), true=_num(upper)))
    return exp.Case(ifs=ifs, default=x.copy()) if ifs else x


def _num(value: float) -> exp.Expression:
    magnitude = abs(value)
    text = (
        str(int(magnitude))
        if float(magnitude).is_integer() and magnitude < 2**63
        else repr(float(magnitude))
    )
    node: exp.Expression = exp.Literal.number(text)
    return exp.Neg(this=node) if value < 0 else node


def _q(name: str) -> exp.Column:
    return exp.column(name, quoted=True)


def _relation(
    spec: PerUnitSpec, source: exp.Expression, conditions: list[exp.Expression], stored: list[str]
) -> exp.Select:
    """V as engine SQL: bounded rows (step 2 of dpsql.frontend.per_unit's docstring), then
    GROUP BY unit [, keys]. ``conditions``: the inner WHERE guarded, and unit IS NOT NULL;
    ``stored``: the base table's stored columns (the row hash)."""
    pair = [_q(spec.unit), *[_q(k) for k in spec.keys]]
    row_order = keyed_hash([*[_q(c) for c in stored], secret_slot()])
    rn = exp.Window(
        this=exp.RowNumber(),
        partition_by=[p.copy() for p in pair],
        order=exp.Order(expressions=[exp.Ordered(this=row_order)]),
    )
    keep: exp.Expression | None = None
    if spec.keys:
        key_order = keyed_hash([*[p.copy() for p in pair], secret_slot()])
        dr = exp.Window(
            this=exp.Anonymous(this="DENSE_RANK", expressions=[]),
            partition_by=[_q(spec.unit)],
            order=exp.Order(
                expressions=[
                    exp.Ordered(this=key_order),
                    *[exp.Ordered(this=_q(k)) for k in spec.keys],
                ]
            ),
        )
        keep = exp.LTE(this=dr, expression=_num(spec.max_groups))
    # the row number only where a COUNT or SUM reads it (a window over every row is the
    # costly step: docs/performance.md); MIN/MAX/AVG alone read every row of a kept pair
    counted = any(c.per_unit_kind.row_bounded for c in spec.columns)
    items_rows: list[Any] = [exp.Star(), *([exp.alias_(rn, "__rn")] if counted else [])]
    rows = exp.Select(expressions=items_rows).from_(source)
    where = None
    for c in conditions:
        where = c if where is None else exp.And(this=where, expression=c)
    if where is not None:
        rows.set("where", exp.Where(this=where))
    if keep is not None:
        rows.set("qualify", exp.Qualify(this=keep))
    within = exp.LTE(this=exp.column("__rn"), expression=_num(spec.max_rows))
    items: list[Any] = [exp.alias_(p.copy(), p.name, quoted=True) for p in pair]
    for col in spec.columns:
        items.append(exp.alias_(_aggregate_expr(col, within), col.name, quoted=True))
    return exp.Select(
        expressions=items,
        from_=exp.From(
            this=exp.Subquery(this=rows, alias=exp.TableAlias(this=exp.to_identifier("r")))
        ),
        group=exp.Group(expressions=[p.copy() for p in pair]),
    )


def _aggregate_expr(col: PerUnitColumn, within: exp.Expression) -> exp.Expression:
    """One aggregate of V, built by its kind (dpsql.frontend.per_unit_kinds). A kind whose
    range grows with the rows (COUNT, SUM: ``row_bounded``) reads only the R kept rows of the
    pair (``within``); MIN, MAX and AVG every row of the kept pairs (their range is the
    value's, however many rows: bounding them would only lose accuracy)."""
    kind = col.per_unit_kind
    value: Any = None
    if col.value is not None:
        value = col.value.copy()
        if col.computed:
            value = exp.Try(this=value)
        if col.row_clamp is not None:
            value = _clamp(value, *col.row_clamp)
    if kind.row_bounded:
        kept = value if value is not None else _num(1)
        value = exp.Case(ifs=[exp.If(this=within.copy(), true=kept)])
    node = kind.aggregate(value)
    if col.clamp is not None:
        node = _clamp(node, *col.clamp)
    return exp.Cast(this=node, to=exp.DataType.build(col.sql_type))


def _public_values(node: PublicRows, ident: exp.Identifier | None) -> exp.Subquery:
    """A public table as its rows, a VALUES list typed as declared: the engine joins exactly
    those public facts."""
    inner = [exp.Identifier(this=f"c{i}", quoted=False) for i in range(len(node.columns))]
    items = [
        exp.Alias(
            this=exp.Cast(
                this=exp.Column(this=inner[i].copy()),
                to=exp.DataType.build(SQL_TYPES[kind]),
            ),
            alias=exp.Identifier(this=name, quoted=True),
        )
        for i, (name, kind) in enumerate(node.columns)
    ]
    rows = list(node.rows)
    where = None
    if not rows:  # VALUES needs a row: one of NULLs, never kept
        rows, where = [(None,) * len(node.columns)], exp.Where(this=exp.false())
    values = exp.Values(
        expressions=[exp.Tuple(expressions=[to_literal(v) for v in r]) for r in rows],
        alias=exp.TableAlias(this=exp.Identifier(this="v", quoted=False), columns=inner),
    )
    select = exp.Select(expressions=items, from_=exp.From(this=values), where=where)
    return exp.Subquery(this=select, alias=exp.TableAlias(this=ident))


def _column(alias: str, column: str) -> exp.Column:
    return exp.Column(
        this=exp.Identifier(this=column, quoted=True),
        table=exp.Identifier(this=alias, quoted=False),
    )
