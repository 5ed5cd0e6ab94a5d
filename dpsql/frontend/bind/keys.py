"""GROUP BY: the keys of one SELECT, and what its WHERE says about their values.

:class:`GroupByBinder` turns the GROUP BY items (columns, expressions, select-list positions
and aliases) into validated :class:`GroupKey` values, refusing grouping sets, aggregates,
constants and the privacy unit; :meth:`GroupByBinder.restrict` reads a key's public value
set and conditions from the WHERE's top-level conjuncts, from the text alone.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from typing import Any

from sqlglot import exp

from dpsql.errors import (
    Position,
    SQLSyntaxError,
)
from dpsql.frontend.bind.scope import Scope, refusal
from dpsql.frontend.joins import PUBLIC_VALUES
from dpsql.frontend.logic import conjuncts
from dpsql.frontend.positions import offset_position, position_of, source_of
from dpsql.frontend.statements import (
    GroupKey,
)


def key_position(item: exp.Expression) -> Position | None:
    """``position_of(item)``, without tokenizing the text for a column or a number: the
    earliest start recorded on it is its first token's own, which position_of keeps."""
    if isinstance(item, exp.Column) or (isinstance(item, exp.Literal) and not item.is_string):
        starts = [
            start
            for node in item.walk()
            if (start := (getattr(node, "_meta", None) or {}).get("start")) is not None
        ]
        if starts:
            return offset_position(source_of(item).text, min(starts))
    return position_of(item)


class GroupByBinder:
    """The GROUP BY of ``tree`` in ``scope``."""

    def __init__(self, scope: Scope, tree: exp.Select) -> None:
        self.scope = scope
        self.tree = tree

    def bind(self) -> tuple[list[GroupKey], list[exp.Expression]]:
        group = self.tree.args.get("group")
        if group is None:
            return [], []
        sets = exp.Rollup | exp.Cube | exp.GroupingSets
        grouping = next((e for e in group.expressions if isinstance(e, sets)), None)
        if (
            grouping is not None
            or group.args.get("rollup")
            or group.args.get("cube")
            or group.args.get("grouping_sets")
        ):
            raise self.scope.refuse(
                "ROLLUP/CUBE/GROUPING SETS are not supported",
                grouping or group,
                "send one query per grouping",
            )
        aliases = {
            e.alias.lower(): e.this for e in self.tree.expressions if isinstance(e, exp.Alias)
        }
        keys: list[GroupKey] = []
        nodes: list[exp.Expression] = []
        assert self.scope.table is not None
        for item in group.expressions:
            resolved = item
            if isinstance(item, exp.Literal) and not item.is_string:
                if not str(item.this).isdigit():  # GROUP BY .7, 1.5, 1e0: no position
                    raise refusal(
                        SQLSyntaxError,
                        f"GROUP BY {item.this} is not a select-list position",
                        item,
                        "GROUP BY a column, an expression, or a whole position such as 1",
                    )
                index = int(item.this) - 1
                if not 0 <= index < len(self.tree.expressions):
                    raise self.scope.refuse(
                        f"GROUP BY position {item.this} is out of range",
                        item,
                        "GROUP BY a column or a select-list position",
                    )
                resolved = self.tree.expressions[index]
                resolved = resolved.this if isinstance(resolved, exp.Alias) else resolved
            elif (
                isinstance(item, exp.Column)
                and not item.table
                and item.name.lower() not in self.scope.table.columns
                and item.name.lower() in aliases
            ):
                resolved = aliases[item.name.lower()]
            if resolved.find(exp.AggFunc):
                raise self.scope.refuse(
                    "GROUP BY an aggregate is not allowed", item, "group by columns or bins"
                )
            self.scope.check_scalar(resolved, "GROUP BY")
            expr = self.scope.normalise_columns(resolved)
            columns = tuple(sorted({c.name for c in expr.find_all(exp.Column)}))
            if not columns:
                raise self.scope.refuse("GROUP BY a constant", item, "group by a column or a bin")
            if self.scope.table.privacy_unit in columns:
                raise self.scope.refuse(
                    f"GROUP BY the privacy unit {self.scope.table.privacy_unit!r} would release "
                    "one group per person",
                    item,
                    "group by other columns; COUNT(DISTINCT "
                    f"{self.scope.table.privacy_unit}) counts units",
                )
            key = GroupKey(expr=expr, columns=columns, position=key_position(item))
            looked_up = resolved
            while isinstance(looked_up, exp.Paren):
                looked_up = looked_up.this
            if PUBLIC_VALUES in looked_up.meta:
                # A public table's column (dpsql.frontend.joins): its values are public.
                key = replace(key, allowed=looked_up.meta[PUBLIC_VALUES])
            if any(k.sql == key.sql for k in keys):
                continue
            keys.append(key)
            nodes.append(resolved)
        return keys, nodes

    def restrict(self, key: GroupKey, where: exp.Expression) -> GroupKey:
        """What the WHERE says about a key's values, from the text alone.

        Conjuncts over the key's columns only filter its public domain as they filter rows
        (``conditions``). A bare-column key that a conjunct pins to literals (``col IN ('a',
        'b')``, ``col = 'a'``) has those values as its public set (``allowed``): released
        without thresholding, or intersected with its declared domain."""
        own = tuple(
            part.copy()
            for part in conjuncts(where)
            if {c.name for c in part.find_all(exp.Column)} <= set(key.columns)
            and part.find(exp.Column) is not None
        )
        if own:
            key = replace(key, conditions=own)
        if not isinstance(key.expr, exp.Column):
            return key
        assert self.scope.table is not None
        col = self.scope.table.columns[key.columns[0]]
        allowed: set | None = None
        for part in conjuncts(where):
            values = None
            if isinstance(part, exp.In) and _same_column(part.this, key.expr):
                if part.args.get("query") is None and not part.args.get("unnest"):
                    values = part.expressions
            elif isinstance(part, exp.EQ):
                if _same_column(part.this, key.expr):
                    values = [part.expression]
                elif _same_column(part.expression, key.expr):
                    values = [part.this]
            if values is None:
                continue
            typed = [_typed_literal(v, col.type) for v in values]
            if any(t is _NOT_LITERAL for t in typed):
                continue
            found = {t for t in typed if t is not None}  # NULL never equals: no bin
            allowed = found if allowed is None else allowed & found
        if allowed is None:
            return key
        return replace(key, allowed=tuple(sorted(allowed)))

    def distinct_as_group_by(self, tree: exp.Select) -> None:
        """``SELECT DISTINCT a, b FROM t`` (no aggregate) is ``... GROUP BY a, b``: a key set,
        answered from the policy at no cost when the keys have a public domain, else
        released by thresholding like any GROUP BY."""
        if not tree.args.get("distinct") or tree.args.get("group") is not None:
            return
        if any(item.find(exp.AggFunc) for item in tree.expressions):
            return
        if tree.args["distinct"].args.get("on") is not None:
            raise self.scope.refuse(
                "DISTINCT ON is not supported", tree.args["distinct"], "use GROUP BY"
            )
        keys = [item.unalias().copy() for item in tree.expressions]
        tree.set("group", exp.Group(expressions=keys))


_NOT_LITERAL = object()


def _same_column(node: exp.Expression, column: exp.Expression) -> bool:
    return isinstance(node, exp.Column) and node.name.lower() == column.name.lower()


def _typed_literal(node: exp.Expression, col_type: str) -> Any:
    """The value a literal compares equal to in a column of ``col_type`` (None for NULL or a
    value no row can hold), or _NOT_LITERAL for anything else."""
    if isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Boolean):
        return node.this if col_type == "bool" else _NOT_LITERAL
    if isinstance(node, exp.Cast) and isinstance(node.this, exp.Literal):
        node = node.this
    if not isinstance(node, exp.Literal):
        return _NOT_LITERAL
    text = node.this
    try:
        if col_type == "text":
            return text if node.is_string else _NOT_LITERAL
        if col_type == "int":
            number = float(text)
            return int(number) if number.is_integer() else None
        if col_type == "float":
            return float(text)
        if col_type == "date":
            return dt.date.fromisoformat(text.strip())
        if col_type == "bool":
            return {"true": True, "false": False, "t": True, "f": False}.get(text.lower())
    except ValueError:
        return _NOT_LITERAL
    return _NOT_LITERAL
