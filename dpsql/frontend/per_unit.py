"""Per-unit relations: a derived table or CTE grouped by the privacy unit, aggregated again.

    SELECT AVG(per_user) FROM (SELECT patient_id, SUM(cost) AS per_user
                               FROM visits GROUP BY patient_id) AS t

The inner query is not a DP query of its own (its groups are people): it is a *per-unit
relation* V, computed in the engine, that the outer DP query reads like a table whose privacy
unit is still ``patient_id``. Shapes: Tableau's FIXED LOD (a per-unit value, then binned),
cohorts (each unit's first month, then COUNT by month), ZetaSQL's per-user subqueries.

How V is computed (dpsql.lower.sources.per_unit, engine SQL generated from the validated spec
only, which the plan's PerUnit node carries):

1. the base table's rows that pass the inner WHERE and have a unit;
2. contribution bounding, *before* aggregating: each unit keeps its G (unit, key) pairs of
   smallest keyed hash (only with extra GROUP BY keys); COUNT and SUM read the R rows of
   smallest keyed hash of each pair (R = max_rows_per_unit, G = max_groups_per_unit of the
   base table; always by keyed-hash sampling, whatever the table's ``bounding``: a rescaled
   row has no MIN/MAX), MIN, MAX and AVG every row of the kept pairs (their range is the
   value's however many rows there are: bounding them would only cost accuracy);
3. GROUP BY unit [, keys]: one row per unit (per key), each aggregate over clamped values.

Stability (what one unit changes). Every V row is a function of one unit's own rows (its
GROUP BY holds the unit; WHERE and the keyed hash read one row, the hash's secret is the
query's), so neighbouring datasets' V differ by exactly one unit's V rows: at most 1 row
without extra keys, at most G rows (one per kept key) with them. So V is a table whose unit is
the same column, with ``max_rows_per_unit`` = 1 (G with extra keys, unless the outer query
groups by all of them: then 1 per group) and ``max_groups_per_unit`` = 1 (G with extra keys);
the outer query's own bounding and clamping run on V as on any table, so these bounds and the
value ranges below are enforced there, not trusted. Ranges, by interval arithmetic over the
declared bounds [L, U] of the aggregated value (after step 2, at most R values per row):

- COUNT(*): [1, R]; COUNT(x), COUNT(DISTINCT x): [0, R]; COUNT(DISTINCT unit): [1, 1]
- SUM(x), SUM(DISTINCT x): [min(L, R·L), max(U, R·U)]; AVG(x), MIN(x), MAX(x): [L, U]
- an analyst's clamp LEAST(GREATEST(agg, a), b) (or GREATEST(LEAST(...))) narrows it to [a, b]

A unit's HAVING filters that unit's own V row: it becomes a WHERE over V (1-stable).
MIN/MAX of a column (any type) or of DATE_TRUNC(unit, column) keep the column's own policy
(its declared values or public date range): MIN(DATE_TRUNC('month', d)) is computed as
DATE_TRUNC('month', MIN(d)) (DATE_TRUNC is monotone), so a month key over it has a public
domain of months.

A join inside V (private tables on the unit, public tables on a unique key) is lowered to one
private relation first (dpsql.frontend.private_joins) and bounded after the join, as a flat
query over it is.

Refused (with the construct and a hint; nothing read, nothing charged): a per-unit relation
over another per-unit relation or over a unit_path table, GROUP BY keys other than plain columns,
DISTINCT/LIMIT/OFFSET/windows inside it, a select item that is neither the unit, a key nor an
aggregate (arithmetic over aggregates other than the clamp), aggregates other than COUNT, SUM,
AVG, MIN and MAX. Everything a flat query refuses (an unbounded SUM, an unknown function) is
refused here by the same binder: each aggregate is bound as ``SELECT agg FROM t WHERE ...``.

This module imports nothing of the binder or the policy (it sits below them in the import
graph): the caller passes the binder and the maker of V's source.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from sqlglot import exp

from dpsql.errors import PrivacyError, UndefinedColumnError
from dpsql.frontend.per_unit_kinds import BOUND, FUNCTIONS, KINDS, LISTED, PerUnitKind
from dpsql.frontend.per_unit_kinds import SHAPE as _HINT
from dpsql.frontend.positions import position_of, snippet
from dpsql.policy import default_granularity

# Clauses that make a relation depend on other rows than its own, or on an order: refused in
# a per-unit relation here and in a row-level one (dpsql.frontend.inline), one list for both.
ROW_CHANGING_CLAUSES = {
    "distinct": "DISTINCT",
    "limit": "LIMIT",
    "offset": "OFFSET",
    "qualify": "QUALIFY",
    "windows": "WINDOW",
    "sample": "TABLESAMPLE",
    "laterals": "LATERAL",
    "joins": "JOIN",
    "into": "INTO",
    "locks": "FOR UPDATE",
}
_WIDEST_INT = 2**62


@dataclass(frozen=True)
class PerUnitColumn:
    """One aggregate column of V: ``kind`` over ``value`` (a tree over the base table's
    columns, never changed: the relation reads copies of it; None for COUNT(*)), each row
    value clamped to ``row_clamp``, the aggregate to ``clamp`` (the analyst's), cast to
    ``sql_type``."""

    name: str
    kind: str  # its PerUnitKind's name (dpsql.frontend.per_unit_kinds.KINDS)
    value: exp.Expression | None
    computed: bool  # value is an expression: evaluated under TRY
    row_clamp: tuple[float, float] | None
    clamp: tuple[float, float] | None
    sql_type: str

    @property
    def per_unit_kind(self) -> PerUnitKind:
        """The kind's object: its range, its lowering (dpsql.frontend.per_unit_kinds)."""
        return KINDS[self.kind]

    @property
    def value_text(self) -> str | None:
        """The value's DuckDB rendering: how EXPLAIN and the spec's identity show it."""
        return None if self.value is None else self.value.sql(dialect="duckdb")

    @property
    def identity(self) -> tuple:
        """Every field, the value as its rendering (the spec's identity is text)."""
        clamps = (self.row_clamp, self.clamp, self.sql_type)
        return (self.name, self.kind, self.value_text, self.computed, *clamps)


@dataclass(frozen=True)
class PerUnitSpec:
    """Everything that decides V's rows (its identity keys caches and plan fingerprints)."""

    table: str
    unit: str
    keys: tuple[str, ...]
    # the inner WHERE, validated by the binder: its tree (a copy of the binder's, never
    # changed: the relation reads copies of it), lowered with the rest of V
    where: exp.Expression | None
    columns: tuple[PerUnitColumn, ...]
    max_rows: int  # R of the base table: rows kept per (unit, key)
    max_groups: int  # G of the base table: keys kept per unit

    @property
    def identity(self) -> str:
        """V's definition as text (caches and plan fingerprints key on it): every field, the
        WHERE as its DuckDB rendering."""
        where = None if self.where is None else self.where.sql(dialect="duckdb")
        columns = tuple(c.identity for c in self.columns)
        fields = (self.table, self.unit, self.keys, where, columns)
        return repr((*fields, self.max_rows, self.max_groups))

    def describe(self) -> str:
        """V as EXPLAIN shows it to the analyst (display text, never run)."""
        by = ", ".join((self.unit, *self.keys))
        cols = ", ".join(f"{c.name}={c.kind}({c.value_text or '*'})" for c in self.columns)
        shown = [self.table]
        if self.where is not None:
            shown.append(exp.Where(this=self.where.copy()).sql(dialect="duckdb"))
        return " ".join(shown) + f" GROUP BY {by}: {cols}"


def _literal_number(node: exp.Expression) -> float | None:
    if isinstance(node, exp.Paren):
        return _literal_number(node.this)
    if isinstance(node, exp.Neg):
        inner = _literal_number(node.this)
        return None if inner is None else -inner
    if isinstance(node, exp.Literal) and not node.is_string:
        try:
            return float(node.this)
        except ValueError:
            return None
    return None


def _unwrap(node: exp.Expression) -> exp.Expression:
    while isinstance(node, exp.Paren):
        node = node.this
    return node


class _Shape:
    """The SELECT read as a per-unit relation: whether it is one (a private policy table grouped
    by its privacy unit), the constructs it may not hold, and refusals that point at the text."""

    def __init__(self, inner: exp.Select, outer: exp.Select, policy: Any) -> None:
        self.inner = inner
        self.outer = outer
        self.policy = policy

    def refuse(
        self,
        message: str,
        node: exp.Expression | None,
        hint: str = _HINT,
        construct: str | None = None,
    ) -> Exception:
        return PrivacyError(
            message,
            construct=construct or (snippet(node) if node is not None else None),
            position=position_of(node),
            hint=hint,
        )

    # -- recognition ------------------------------------------------------------------------
    def recognise(self) -> bool:
        from_ = self.inner.args.get("from_") or self.inner.args.get("from")
        source = from_.this if from_ is not None else None
        if not isinstance(source, exp.Table) or not isinstance(source.this, exp.Identifier):
            return False
        base = self.policy.table(source.name)
        if base is None or base.public or base.privacy_unit is None:
            return False
        group = self.inner.args.get("group")
        if group is None:
            return False
        self.source = source
        self.base = base
        self.unit = base.privacy_unit
        self.qualifiers = {source.name.lower(), (source.alias or source.name).lower()}
        self.groups = [self._resolve_group_item(item) for item in group.expressions]
        return any(self.is_column(g, self.unit) for g in self.groups)

    def _resolve_group_item(self, item: exp.Expression) -> exp.Expression:
        items = self.inner.expressions
        if isinstance(item, exp.Literal) and not item.is_string and str(item.this).isdigit():
            index = int(item.this) - 1
            if 0 <= index < len(items):
                return _unwrap(items[index].unalias())
        if isinstance(item, exp.Column) and not item.table:
            name = item.name.lower()
            if name not in self.base.columns:
                for e in items:
                    if isinstance(e, exp.Alias) and e.alias.lower() == name:
                        return _unwrap(e.this)
        return _unwrap(item)

    def is_column(self, node: exp.Expression, name: str | None = None) -> bool:
        node = _unwrap(node)
        if not isinstance(node, exp.Column) or isinstance(node.this, exp.Star):
            return False
        if node.table and node.table.lower() not in self.qualifiers:
            return False
        return name is None or node.name.lower() == name

    def refuse_unsupported(self) -> None:
        """Refuse V over V or over a unit_path table, ROLLUP/CUBE/GROUPING SETS, the clauses
        that make a row depend on other rows, and windows."""
        base = self.base
        # A join lowered to one private relation (on the unit, or with public tables on a
        # unique key) is bounded after the join like any table; V over V, or a unit_path
        # table (its unit is not among its own columns), is not supported.
        nested = getattr(base.joined, "spec", None) is not None
        if nested or (base.joined is not None and self.unit not in base.columns):
            group = self.inner.args["group"]
            raise self.refuse(
                "a per-unit relation (GROUP BY the privacy unit) over another per-unit "
                "relation or over a unit_path table is not supported",
                group if position_of(self.source) is None else self.source,
                "aggregate per unit once, over a table that holds the unit column",
                construct=snippet(self.source),
            )
        group = self.inner.args["group"]
        extra = next(
            (k for k in ("rollup", "cube", "grouping_sets", "totals") if group.args.get(k)), None
        )
        if extra is not None:
            raise self.refuse(
                "ROLLUP/CUBE/GROUPING SETS are not supported",
                group,
                "send one query per grouping",
            )
        for arg, word in ROW_CHANGING_CLAUSES.items():
            if self.inner.args.get(arg):
                node = self.inner.args[arg]
                node = node[0] if isinstance(node, list) else node
                raise self.refuse(
                    f"{word} inside a per-unit relation (GROUP BY the privacy unit) is not "
                    "supported",
                    node if isinstance(node, exp.Expression) else self.inner,
                    "move the clause to the outer query",
                )
        for window in self.inner.find_all(exp.Window):
            raise self.refuse(
                "window functions are not allowed",
                window,
                "use GROUP BY with COUNT/SUM/AVG; windows would release individual rows",
            )

    def group_keys(self) -> list[str]:
        """The GROUP BY columns besides the unit: plain columns of the base table."""
        keys: list[str] = []
        for node in self.groups:
            if self.is_column(node, self.unit):
                continue
            if not self.is_column(node):
                raise self.refuse(
                    f"a per-unit relation groups by the privacy unit and plain columns, not "
                    f"{snippet(node)}",
                    node,
                    "GROUP BY unit, column; compute expressions of the key in the outer query",
                )
            name = node.name.lower()
            if name not in self.base.columns:
                raise UndefinedColumnError(
                    f"unknown column {node.name!r} in table {self.base.name!r}",
                    construct=snippet(node),
                    position=position_of(node),
                    hint="its columns: " + ", ".join(self.base.columns),
                )
            if name not in keys:
                keys.append(name)
        return keys


class _Columns:
    """V's columns and their column policies: each aggregate bound by the binder as a flat
    query over the base table, its range from the declared bounds (the module docstring)."""

    def __init__(self, shape: _Shape, keys: list[str], bind: Callable[[exp.Select], Any]) -> None:
        self.shape = shape
        self.keys = keys
        self.bind = bind
        base = shape.base
        # "auto" bounds are not chosen here: the base's fallback (dpsql.policy.TablePolicy)
        self.R, self.G = base.unchosen_bounds()
        # the WHERE and the keys, validated as a flat query over the base table would be
        self.probe = self.bind_one(exp.Count(this=exp.Star()))
        self.columns: list[PerUnitColumn] = []
        self.policies: dict[str, Any] = {shape.unit: replace(base.columns[shape.unit])}
        for k in keys:
            self.policies[k] = base.columns[k]

    def bind_one(self, aggregate: exp.Expression) -> Any:
        """``SELECT aggregate FROM base WHERE ... GROUP BY keys``, bound by the binder: the
        same checks as a flat query (functions, types, bounds, totality)."""
        trial = exp.Select(expressions=[aggregate.copy()])
        trial.set("from_", exp.From(this=self.shape.source.copy()))
        where = self.shape.inner.args.get("where")
        if where is not None:
            trial.set("where", where.copy())
        if self.keys:
            trial.set("group", exp.Group(expressions=[exp.column(k) for k in self.keys]))
        return self.bind(trial)

    def aggregate(self, node: exp.Expression, name: str, shown: exp.Expression) -> exp.Expression:
        """V's column for ``node`` (an aggregate, perhaps inside the analyst's clamp), added to
        ``columns`` and ``policies``; the expression over V that reads it."""
        clamp_lo, clamp_hi = -math.inf, math.inf
        inner = _unwrap(node)
        for _ in range(2):  # LEAST(GREATEST(agg, a), b) or GREATEST(LEAST(agg, b), a)
            if isinstance(inner, exp.Least | exp.Greatest) and len(inner.expressions) == 1:
                bound = _literal_number(inner.expressions[0])
                if bound is None:
                    break
                if isinstance(inner, exp.Least):
                    clamp_hi = min(clamp_hi, bound)
                else:
                    clamp_lo = max(clamp_lo, bound)
                inner = _unwrap(inner.this)
        kind = FUNCTIONS.get(type(inner))
        if kind is None or any(n is not inner for n in inner.find_all(exp.AggFunc)):
            found: Any = inner if isinstance(inner, exp.AggFunc) else node.find(exp.AggFunc)
            if found is not None and FUNCTIONS.get(type(found)) is None:
                raise self.shape.refuse(
                    f"aggregate {snippet(found)} is not supported in a per-unit relation",
                    found,
                    f"per unit: {LISTED}",
                )
            written = shown.sql(dialect="duckdb")  # the whole expression, not its first call
            raise self.shape.refuse(
                f"the per-unit relation's column {written} must be an aggregate (or "
                "LEAST(GREATEST(aggregate, low), high)), the unit or a GROUP BY column",
                shown,
                "compute other expressions of the per-unit values in the outer query",
                construct=written,
            )
        clamp = None
        if math.isfinite(clamp_lo) or math.isfinite(clamp_hi):
            if kind.picks_value and not self._numeric_arg(inner):
                raise self.shape.refuse(
                    f"{snippet(shown)}: LEAST/GREATEST clamps a number",
                    shown,
                    "clamp SUM, COUNT, AVG, or MIN/MAX of a number",
                )
            if clamp_lo > clamp_hi:
                raise self.shape.refuse(
                    f"{snippet(shown)}: the clamp's lower end is above its upper end",
                    shown,
                    "LEAST(GREATEST(agg, low), high) with low <= high",
                )
            clamp = (clamp_lo, clamp_hi)
        arg = inner.this
        if kind.picks_value:
            monotone = self._monotone_column(arg)
            if monotone is not None:
                column, wrap = monotone
                return self._min_max(kind, name, column, wrap, clamp)
        if kind.distinct_unit is not None and isinstance(arg, exp.Distinct):
            values = arg.expressions
            if len(values) == 1 and self.shape.is_column(values[0], self.shape.unit):
                return self._column(name, KINDS[kind.distinct_unit], None, clamp)
        distinct = kind.distinct if isinstance(arg, exp.Distinct) else None
        if distinct is not None:
            # SUM(DISTINCT x): x bound as in SUM(x); the sum of the distinct values among
            # the pair's R kept rows lies in SUM's range too (at most R values of [L, U])
            values = arg.expressions
            if len(values) != 1:
                raise self.shape.refuse(
                    f"{kind.spelled}(DISTINCT ...) takes one value",
                    inner,
                    f"{kind.spelled}(DISTINCT column)",
                )
            call_query = self.bind_one(type(inner)(this=values[0].copy()))
        else:
            call_query = self.bind_one(inner)
        return self._ranged(name, inner, call_query, clamp, distinct)

    def _ranged(
        self,
        name: str,
        inner: exp.Expression,
        call_query: Any,
        clamp: tuple[float, float] | None,
        distinct: str | None,
    ) -> exp.Expression:
        """V's column for an aggregate the binder bound: its kind (``distinct``: the kind
        its DISTINCT form computes) and its range (the kind's ``ranged``)."""
        call = call_query.aggregates[0]
        kind = BOUND.get(call.kind)
        if kind is None:
            raise self.shape.refuse(
                f"{snippet(inner)} is not supported in a per-unit relation",
                inner,
                f"per unit: {LISTED}",
            )
        if distinct is not None:
            kind = KINDS[distinct]
        col = None
        if kind.reads_value and call.column is not None:
            col = call_query.table.columns[call.column]
        return self._column(name, kind, col, clamp)

    def _column(
        self, name: str, kind: PerUnitKind, col: Any, clamp: tuple[float, float] | None
    ) -> exp.Expression:
        """V's column of ``kind`` over ``col`` (None: COUNT(*), or a kind reading no value),
        ranged by the kind over the pair's rows."""
        value = None if col is None else _stored_or_computed(col)
        computed = col is not None and col.expr is not None
        r = kind.ranged(col, self.R)
        out = (r.out, r.type, r.granularity)
        return self._add(
            name, kind.name, value, computed, r.row_clamp, clamp, *out, nullable=r.nullable
        )

    def _numeric_arg(self, agg: exp.Expression) -> bool:
        monotone = self._monotone_column(agg.this)
        if monotone is None:
            return True  # an expression: the binder refuses a non-number
        spec = self.shape.base.columns.get(monotone[0])
        return spec is not None and spec.numeric and monotone[1] is None

    def _monotone_column(self, arg: exp.Expression) -> tuple[str, exp.Expression | None] | None:
        """``col`` or ``DATE_TRUNC(unit, col)`` (monotone: MIN/MAX commute with it)."""
        arg = _unwrap(arg)
        if self.shape.is_column(arg):
            return arg.name.lower(), None
        if isinstance(arg, exp.TimestampTrunc | exp.DateTrunc) and self.shape.is_column(arg.this):
            unit = arg.args.get("unit")
            if isinstance(unit, exp.Var | exp.Literal):
                return _unwrap(arg.this).name.lower(), arg
        return None

    def _min_max(
        self,
        kind: PerUnitKind,
        name: str,
        column: str,
        wrap: exp.Expression | None,
        clamp: tuple[float, float] | None,
    ) -> exp.Expression:
        spec = self.shape.base.columns.get(column)
        if spec is None:
            raise UndefinedColumnError(
                f"unknown column {column!r} in table {self.shape.base.name!r}",
                construct=column,
                hint="its columns: " + ", ".join(self.shape.base.columns),
            )
        if column == self.shape.unit:
            raise self.shape.refuse(
                f"{kind.spelled} of the privacy unit is meaningless",
                self.shape.inner,
                f"COUNT(DISTINCT {column}) counts units",
            )
        if spec.expr is not None:
            raise self.shape.refuse(
                f"{kind.spelled}({column}) of a computed column is not supported per unit",
                self.shape.inner,
                "aggregate a stored column",
            )
        if wrap is not None and spec.type != "date":
            raise self.shape.refuse(
                f"{kind.spelled}(DATE_TRUNC(..., {column})): {column} is {spec.type}, not a date",
                self.shape.inner,
                "DATE_TRUNC a date column",
            )
        row_clamp = (
            (float(spec.lower), float(spec.upper)) if spec.numeric and spec.bounded else None
        )
        sql_type = {"int": "BIGINT", "float": "DOUBLE", "text": "VARCHAR", "bool": "BOOLEAN"}.get(
            spec.type, "DATE"
        )
        column_policy = replace(spec, name=name, expr=None)
        if clamp is not None and spec.numeric and spec.bounded:
            lo, hi = _clamped((float(spec.lower), float(spec.upper)), clamp)
            column_policy = replace(column_policy, lower=lo, upper=hi)
        self.columns.append(
            PerUnitColumn(
                name, kind.name, exp.column(column, quoted=True), False, row_clamp, clamp, sql_type
            )
        )
        self.policies[name] = column_policy
        ref = exp.column(name, quoted=True)
        if wrap is None:
            return ref
        wrapped = wrap.copy()
        wrapped.set("this", ref)
        return wrapped

    def _add(
        self,
        name: str,
        kind: str,
        value: exp.Expression | None,
        computed: bool,
        row_clamp: tuple[float, float] | None,
        clamp: tuple[float, float] | None,
        out: tuple[float, float],
        out_type: str,
        granularity: float,
        *,
        nullable: bool = False,
    ) -> exp.Expression:
        lo, hi = _clamped(out, clamp) if clamp is not None else out
        if (
            clamp is not None
            and out_type == "int"
            and not all(float(v).is_integer() for v in clamp if math.isfinite(v))
        ):
            out_type = "float"
            granularity = min(granularity, default_granularity("float", lo, hi))
        if out_type == "int" and max(abs(lo), abs(hi)) >= _WIDEST_INT:
            raise self.shape.refuse(
                f"the per-unit column {name!r} ranges over [{lo:g}, {hi:g}]: too wide for an "
                "integer",
                self.shape.inner,
                "clamp it: LEAST(GREATEST(agg, low), high)",
            )
        sql_type = "BIGINT" if out_type == "int" else "DOUBLE"
        self.columns.append(PerUnitColumn(name, kind, value, computed, row_clamp, clamp, sql_type))
        base_col = self.shape.base.columns[self.shape.unit]
        self.policies[name] = replace(
            base_col,
            name=name,
            type=out_type,
            lower=float(lo),
            upper=float(hi),
            values=None,
            nullable=nullable,
            granularity=granularity,
            expr=None,
            date_range=None,
        )
        return exp.column(name, quoted=True)


class _Builder:
    """V from a recognised shape: the columns the outer query reads, the HAVING over them,
    V's policy table and the row-level SELECT over it."""

    def __init__(self, shape: _Shape, bind: Callable[[exp.Select], Any]) -> None:
        self.shape = shape
        self.bind = bind

    def build(self, make_source: Callable[[Any, PerUnitSpec, str], Any]) -> tuple[exp.Select, Any]:
        shape = self.shape
        shape.refuse_unsupported()
        keys = shape.group_keys()
        self.columns = _Columns(shape, keys, self.bind)
        projection = self._projection()
        having = shape.inner.args.get("having")
        condition = None
        if having is not None:
            condition = self._having(having.this, projection)
        table = self._table(keys, projection, make_source)
        relation = exp.Select(
            expressions=[
                exp.alias_(e, n, quoted=True)
                for n, e in projection.items()
                if not n.startswith("__")
            ],
            from_=exp.From(this=exp.Table(this=exp.Identifier(this=table.name, quoted=True))),
        )
        if condition is not None:
            relation.set("where", exp.Where(this=condition))
        return relation, table

    def _projection(self) -> dict[str, exp.Expression]:
        """Each select item's name and the expression over V the outer query reads for it."""
        projection: dict[str, exp.Expression] = {}
        for item in self.shape.inner.expressions:
            name, node = self._item_name(item)
            if name in projection:
                raise self.shape.refuse(
                    f"the per-unit relation has two columns named {name!r}",
                    item,
                    "give each column its own name",
                )
            projection[name] = self._projected(node, name, item)
        return projection

    def _table(
        self,
        keys: list[str],
        projection: dict[str, exp.Expression],
        make_source: Callable[[Any, PerUnitSpec, str], Any],
    ) -> Any:
        """V's policy table: the base's, with V's columns, V's bounds and V as its source."""
        shape, columns = self.shape, self.columns
        base = shape.base
        probe = columns.probe
        spec = PerUnitSpec(
            table=base.name,
            unit=shape.unit,
            keys=tuple(keys),
            where=probe.where.copy() if probe.where is not None else None,
            columns=tuple(columns.columns),
            max_rows=columns.R,
            max_groups=columns.G,
        )
        digest = hashlib.sha256(
            repr([(n, c.type) for n, c in columns.policies.items()]).encode()
        ).hexdigest()[:12]
        name = f"{base.name} per {shape.unit} {digest}".lower()
        rows, groups = (1, 1)
        if keys:
            groups = columns.G
            rows = 1 if self._outer_groups_by(keys, projection) else columns.G
        joined = make_source(base, spec, f"per {shape.unit}: {spec.describe()}")
        return replace(
            base,
            name=name,
            columns=dict(columns.policies),
            max_rows_per_unit=rows,
            max_groups_per_unit=groups,
            unique_keys=(),
            unit_path=(),
            rows=None,
            joined=joined,
            # V's bounds are its own (1, or G with extra keys), never chosen per query; an
            # "auto" bound of the base is read above at its fallback (the cap when declared)
            auto_bounds=(),
        )

    def _item_name(self, item: exp.Expression) -> tuple[str, exp.Expression]:
        if isinstance(item, exp.Alias):
            return item.alias.lower(), _unwrap(item.this)
        if self.shape.is_column(item):
            return item.name.lower(), item
        if isinstance(item, exp.Star) or (
            isinstance(item, exp.Column) and isinstance(item.this, exp.Star)
        ):
            raise self.shape.refuse(
                "SELECT * in a per-unit relation (GROUP BY the privacy unit) is not supported",
                item,
                "select the unit and named aggregates: SELECT unit, SUM(x) AS total ...",
            )
        raise self.shape.refuse(
            f"the per-unit relation's column {snippet(item)} needs a name",
            item,
            f"name it: {snippet(item)} AS name",
        )

    def _projected(self, node: exp.Expression, name: str, item: exp.Expression) -> exp.Expression:
        """The expression over V that the outer query reads as column ``name``."""
        if self.shape.is_column(node):
            column = node.name.lower()
            if column == self.shape.unit or column in self.columns.keys:
                return exp.column(column, quoted=True)
            raise self.shape.refuse(
                f"column {node.name!r} must appear in the per-unit relation's GROUP BY",
                node,
                "group by it too, or aggregate it (MIN, MAX, SUM, ...)",
            )
        return self.columns.aggregate(node, name, node)

    def _having(
        self, condition: exp.Expression, projection: dict[str, exp.Expression]
    ) -> exp.Expression:
        """The inner HAVING as a condition over V: a filter on each unit's own row."""
        known = {}
        for item in self.shape.inner.expressions:
            if isinstance(item, exp.Alias):
                known[_unwrap(item.this).sql(dialect="duckdb")] = projection[item.alias.lower()]
        hidden = [0]

        def visit(node: exp.Expression) -> exp.Expression:
            if isinstance(node, exp.AggFunc):
                sql = node.sql(dialect="duckdb")
                if sql not in known:
                    name = f"__having{hidden[0]}"
                    hidden[0] += 1
                    known[sql] = self.columns.aggregate(node, name, node)
                return known[sql].copy()
            if isinstance(node, exp.Column) and not isinstance(node.this, exp.Star):
                name = node.name.lower()
                if name in projection and (not node.table or self.shape.is_column(node)):
                    return projection[name].copy()
                raise self.shape.refuse(
                    f"HAVING reads {snippet(node)}, which is not a column of the per-unit relation",
                    node,
                    "compare the relation's aggregates or GROUP BY columns",
                )
            return node

        return condition.copy().transform(visit)

    def _outer_groups_by(self, keys: list[str], projection: dict[str, exp.Expression]) -> bool:
        """Whether the outer query groups by every extra key (then one V row per unit and
        outer group). A utility refinement only: the outer bounding enforces it."""
        group = self.shape.outer.args.get("group")
        if group is None:
            return False
        names = {n for n, e in projection.items() if isinstance(e, exp.Column) and e.name in keys}
        by_key = {projection[n].name for n in names}
        aliases = {
            e.alias.lower(): _unwrap(e.this)
            for e in self.shape.outer.expressions
            if isinstance(e, exp.Alias)
        }
        grouped: set[str] = set()
        for item in group.expressions:
            node = _unwrap(item)
            if isinstance(node, exp.Literal) and not node.is_string and str(node.this).isdigit():
                index = int(node.this) - 1
                if 0 <= index < len(self.shape.outer.expressions):
                    node = _unwrap(self.shape.outer.expressions[index].unalias())
            if (
                isinstance(node, exp.Column)
                and node.name.lower() in aliases
                and node.name.lower() not in names
            ):
                node = aliases[node.name.lower()]
            if isinstance(node, exp.Column) and node.name.lower() in names:
                grouped.add(projection[node.name.lower()].name)
        return by_key <= grouped and set(keys) <= by_key


def _clamped(out: tuple[float, float], clamp: tuple[float, float]) -> tuple[float, float]:
    lo, hi = clamp
    return (min(max(out[0], lo), hi), min(max(out[1], lo), hi))


def _stored_or_computed(col: Any) -> exp.Expression:
    """A column's value as a tree: its quoted name, or a computed column's expression (a copy
    of the tree the binder kept on the column, ColumnPolicy.tree: never its text parsed)."""
    if col.expr is None:
        return exp.column(col.name, quoted=True)
    assert isinstance(col.tree, exp.Expression), "a computed column carries its tree"
    return col.tree.copy()


def groups_by_unit(select: exp.Select, policy: Any) -> bool:
    """Whether ``select`` is a per-unit relation (a policy table grouped by its privacy unit):
    private rows, one per unit, not a DP query of its own (for classifiers of the text, such
    as dpsql.frontend.released's). From the text and the policy alone."""
    return _Shape(select, select, policy).recognise()


def per_unit_relation(
    inner: exp.Select,
    outer: exp.Select,
    policy: Any,
    *,
    bind: Callable[[exp.Select], Any],
    make_source: Callable[[Any, PerUnitSpec, str], Any],
) -> tuple[exp.Select, Any] | None:
    """``(relation, table)``: a row-level SELECT over the per-unit table V and V's policy
    table, if ``inner`` groups a private table by its privacy unit; None otherwise (then
    ``inner`` is a DP query of its own). Refuses what the module docstring lists."""
    shape = _Shape(inner, outer, policy)
    if not shape.recognise():
        return None
    return _Builder(shape, bind).build(make_source)
