"""A DP subquery whose released result filters the outer query (Superset's series limit).

    SELECT department, COUNT(*) FROM visits
    JOIN (SELECT department AS d__, COUNT(*) AS m FROM visits GROUP BY department
          ORDER BY m DESC LIMIT 5) AS series_limit ON department = d__
    GROUP BY department

is two measurements: the inner DP query, released (noisy counts, top 5 by noisy count), then
the outer DP query over the rows whose ``department`` is among the released values. The
released values are post-processing of the first measurement, so using them as a public key
set of the second costs nothing more; the outer plan's cost is fixed before the inner one
runs (it cannot depend on the values), and both are reserved in one charge
(dpsql.service.composite). ``WHERE department IN (SELECT ... GROUP BY ...)`` is the same.

This module only recognises the shape, from the text: nothing here reads data.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlglot import exp

from dpsql.errors import PrivacyError
from dpsql.frontend.inline import is_aggregate
from dpsql.frontend.logic import conjuncts
from dpsql.frontend.positions import position_of, snippet


@dataclass(frozen=True)
class ReleasedFilter:
    """``outer`` with the join removed; its rows keep ``column IN released(inner, output)``."""

    outer: exp.Select
    inner: exp.Select
    column: exp.Column  # the outer query's column, as written
    output: str  # the inner query's output column whose released values filter it


def _dp_subquery(node: exp.Expression | None) -> exp.Select | None:
    while isinstance(node, exp.Subquery | exp.Paren):
        node = node.this
    return node if isinstance(node, exp.Select) and is_aggregate(node) else None


def _output_name(select: exp.Select, index: int = 0) -> str | None:
    item = select.expressions[index] if len(select.expressions) > index else None
    if isinstance(item, exp.Alias):
        return item.alias
    if isinstance(item, exp.Column):
        return item.name
    return None


def split_released_filter(tree: exp.Select) -> ReleasedFilter | None:
    """The released-filter shape of ``tree``, or None when it has none."""
    joins = tree.args.get("joins") or []
    if len(joins) == 1:
        return _from_join(tree, joins[0])
    where = tree.args.get("where")
    if joins or where is None:
        return None
    for part in conjuncts(where.this):
        if not isinstance(part, exp.In) or not isinstance(part.this, exp.Column):
            continue
        inner = _dp_subquery(part.args.get("query"))
        if inner is None:
            continue
        name = _output_name(inner)
        if name is None or len(inner.expressions) != 1:
            raise _refuse(
                "an IN (subquery) over a DP query must select one named column",
                part,
                "IN (SELECT department AS d FROM t GROUP BY department ...)",
            )
        outer = tree.copy()
        remaining = [p.copy() for p in conjuncts(where.this) if p is not part]
        outer.set("where", exp.Where(this=exp.and_(*remaining)) if remaining else None)
        return ReleasedFilter(outer, inner, part.this, name)
    return None


def _from_join(tree: exp.Select, join: exp.Join) -> ReleasedFilter | None:
    inner = _dp_subquery(join.this)
    if inner is None:
        return None
    kind = (join.args.get("kind") or "").upper()
    side = (join.args.get("side") or "").upper()
    if side or kind not in ("", "INNER", "SEMI"):
        raise _refuse(
            f"{(side + ' ' + kind).strip()} JOIN with a DP subquery is not supported",
            join,
            "use an inner JOIN (or IN (subquery)): the subquery's released values filter rows",
        )
    alias = join.this.alias_or_name.lower() if isinstance(join.this, exp.Subquery) else ""
    outputs = {
        (e.alias if isinstance(e, exp.Alias) else e.name).lower()
        for e in inner.expressions
        if isinstance(e, exp.Alias | exp.Column)
    }
    on = join.args.get("on")
    pair = _equality(on, alias, outputs) if on is not None else None
    if pair is None or join.args.get("using"):
        raise _refuse(
            "a JOIN with a DP subquery needs ON column = subquery_column",
            on or join,
            "JOIN (SELECT d AS d__, COUNT(*) ... LIMIT 5) AS s ON d = d__",
        )
    column, output = pair
    outer = tree.copy()
    outer.set("joins", None)
    for col in outer.find_all(exp.Column):
        if alias and col.table.lower() == alias:
            raise _refuse(
                f"the outer query reads the DP subquery's column {col.sql()!r}",
                col,
                "a DP subquery may only filter the outer rows (ON col = its column); select "
                "its values with a query of their own",
            )
    return ReleasedFilter(outer, inner, column, output)


def _equality(on: exp.Expression, alias: str, outputs: set[str]) -> tuple[exp.Column, str] | None:
    while isinstance(on, exp.Paren):
        on = on.this
    if not isinstance(on, exp.EQ):
        return None
    a, b = on.this, on.expression
    if not isinstance(a, exp.Column) or not isinstance(b, exp.Column):
        return None

    def is_inner(col: exp.Column) -> bool:
        if col.table:
            return bool(alias) and col.table.lower() == alias
        return col.name.lower() in outputs

    if is_inner(b) and not is_inner(a):
        return a.copy(), b.name
    if is_inner(a) and not is_inner(b):
        return b.copy(), a.name
    return None


def _refuse(message: str, node: exp.Expression, hint: str) -> PrivacyError:
    return PrivacyError(message, construct=snippet(node), position=position_of(node), hint=hint)
