"""The relational plan tree: what each node does to one privacy unit's rows.

Every node states its *stability* next to its code, OpenDP style: how much one unit (added or
removed with all its rows) can change the node's output, given how much it changes the input.
The chain Scan -> Filter -> Project -> Bound -> Aggregate turns "one unit" into a per-measure
sensitivity; dpsql.plan.measures then charges each measure's privacy map at that sensitivity,
and dpsql.plan.check verifies that the planner charged exactly the sum of those maps.

The planner builds them (dpsql.plan.tree.annotate) and they *are* the plan
(dpsql.plan.annotated.Plan): the lowerings read R, G, the bounding, the keys and the measures
off these nodes. They are values (frozen), with no engine or data reference.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from sqlglot import exp

from dpsql.frontend.per_unit import PerUnitSpec
from dpsql.plan.values import KeyPlan, Measure


@dataclass(frozen=True)
class PublicRows:
    """A public table as the rows the policy holds (read and checked at connect, its unique
    keys held there): joined as those rows, typed as declared. Public: no unit, no stability
    of its own (a side of a :class:`JoinedRows`)."""

    table: str
    columns: tuple[tuple[str, str], ...]  # (name, policy type), in declared order
    rows: tuple[tuple, ...] = field(repr=False)


@dataclass(frozen=True)
class JoinSide:
    """One side of a private join (dpsql.frontend.private_joins): its rows under an internal
    alias, joined (``kind`` "INNER" or "LEFT"; "" for the first side) ON ``on``, a typed
    condition tree of column equalities ``alias.column = alias.column`` with the sides before
    it (None for the first). The lowerings place copies of ``on``, never the tree itself."""

    rows: Scan | PerUnit | PublicRows
    alias: str
    kind: str = ""
    on: exp.Expression | None = None


@dataclass(frozen=True)
class JoinedRows:
    """How a virtual table of private tables joined on the unit (or a unit_path table) is
    read: its sides in join order and its columns, each ``(name, alias, column)``. Every joined
    row belongs to one unit (the ON conditions make both rows the same unit's), so the read
    is as stable as a policy table's: it belongs to the :class:`Scan` of the virtual table, not
    a node of its own (EXPLAIN shows the virtual table)."""

    sides: tuple[JoinSide, ...]
    outputs: tuple[tuple[str, str, str], ...]


@dataclass(frozen=True)
class Scan:
    """Read a policy table. Neighbouring datasets differ by one unit with all of its rows
    (a table without a unit: by one row). ``source``: for a virtual table of private tables
    joined on the unit (or a unit_path table), the join its rows are read from; None: the
    stored table by its name."""

    table: str
    unit: str | None
    source: JoinedRows | None = None

    def children(self) -> tuple:
        return ()

    def describe(self) -> str:
        return f"Scan {self.table}"

    def stability(self) -> str:
        if self.unit is None:
            return "neighbours differ by one row (each row is its own unit)"
        return f"neighbours differ by one {self.unit} with all of its rows"


@dataclass(frozen=True)
class PerUnit:
    """A per-unit relation (dpsql.frontend.per_unit): the base table's rows bounded (R rows per
    (unit, key) for COUNT and SUM, G keys per unit), then grouped by the unit [and keys]. Every
    output row is a function of one unit's own rows, so neighbours differ by that unit's
    output rows: at most 1 (at most G with extra keys); value ranges by interval arithmetic.
    The outer plan reads it as a table with those bounds, and bounds and clamps it again."""

    input: Scan
    definition: str  # WHERE, GROUP BY and each aggregate, as the spec describes them
    keys: int  # extra GROUP BY keys besides the unit
    max_rows: int  # R of the base table
    max_groups: int  # G of the base table
    # what the lowering reads: the relation's validated spec (dpsql.frontend.per_unit's
    # PerUnitSpec: its trees, never changed), the inner WHERE's top-level conjuncts with their
    # totality over the base table (a total one runs bare, the others under TRY), and the
    # base table's stored columns (the row's keyed hash)
    spec: PerUnitSpec | None = field(default=None, compare=False, repr=False)
    where: tuple[tuple[exp.Expression, bool], ...] = field(default=(), compare=False, repr=False)
    stored: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def children(self) -> tuple:
        return (self.input,)

    def describe(self) -> str:
        return f"PerUnit {self.definition} (R = {self.max_rows}, G = {self.max_groups})"

    def stability(self) -> str:
        if self.keys:
            return f"a unit changes <= {self.max_groups} rows (one per kept key)"
        return "a unit changes <= 1 row (its own)"


@dataclass(frozen=True)
class PublicJoin:
    """Join public tables ON their declared unique keys (dpsql.frontend.joins): each private
    row matches at most one public row, so every output row is one input row with public
    columns added (INNER drops unmatched rows; LEFT keeps them with NULLs). 1-stable: a
    unit's rows are never multiplied, so every sensitivity downstream is unchanged."""

    input: Scan | PerUnit
    joins: tuple[str, ...]

    def children(self) -> tuple:
        return (self.input,)

    def describe(self) -> str:
        return "PublicJoin " + "; ".join(self.joins)

    def stability(self) -> str:
        return "1-stable: at most one public row per private row (unique key)"


@dataclass(frozen=True)
class Filter:
    """Keep the rows a condition accepts (under TRY: a failing row is dropped, never an
    error). 1-stable: a unit's rows can only be removed, never multiplied or moved."""

    input: Scan | PerUnit | PublicJoin
    condition: exp.Expression

    def children(self) -> tuple:
        return (self.input,)

    def describe(self) -> str:
        return f"Filter {self.condition.sql(dialect='duckdb')}"

    def stability(self) -> str:
        return "1-stable: removes rows only"


@dataclass(frozen=True)
class ComputedColumn:
    name: str
    sql: str  # its rendering, as EXPLAIN shows it
    lower: float
    upper: float
    # the expression as a tree (the binder's copy, ColumnPolicy.tree): what the lowerings
    # place copies of, under TRY (dpsql.lower.row_values.column_value)
    tree: exp.Expression | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Project:
    """Computed columns (derived tables, expressions inside aggregates): one output row per
    input row, so 1-stable; each value is clamped to its range in the engine."""

    input: Scan | PerUnit | PublicJoin | Filter
    columns: tuple[ComputedColumn, ...]

    def children(self) -> tuple:
        return (self.input,)

    def describe(self) -> str:
        return "Project " + ", ".join(
            f"{c.sql} in [{c.lower:g}, {c.upper:g}]" for c in self.columns
        )

    def stability(self) -> str:
        return "1-stable: one output row per input row; values clamped to their ranges"


@dataclass(frozen=True)
class Bound:
    """Contribution bounding in the engine: after it each unit adds at most ``max_rows`` rows'
    worth to each group and reaches at most ``max_groups`` groups. ``sample``: a pair over R
    keeps its R rows of smallest keyed hash; ``scale``: it keeps every row at weight R/n
    (truncated toward zero), so a sum over it is at most R·row_bound in magnitude all the same
    (the measures of a rescaled plan give ``row_bound`` in their fine units)."""

    # the query's rows as nodes (dpsql.plan.tree.relational_nodes): derived from the plan's
    # bound query node for node, which the plan compares and serialises itself
    input: Scan | PerUnit | PublicJoin | Filter | Project = field(compare=False)
    unit: str | None
    max_rows: int  # R
    max_groups: int  # G (effective)
    method: str = "sample"  # "sample" or "scale"
    groups_scaled: bool = False  # scale, public keys: a unit's k > G groups all kept at G/k

    def children(self) -> tuple:
        return (self.input,)

    def describe(self) -> str:
        if self.unit is None:
            return f"Bound: one row per unit, {self.max_groups} group(s)"
        how = ", over-R groups rescaled to R rows" if self.method == "scale" else ""
        if self.groups_scaled:
            how += ", a unit's k > G groups each at G/k"
        return (
            f"Bound per {self.unit}: <= {self.max_rows} rows per group, <= {self.max_groups} "
            f"groups{how}"
        )

    def stability(self) -> str:
        return f"a unit changes <= {self.max_groups} groups by <= {self.max_rows} rows each"

    def unit_change(self, row_bound: int, per_unit: bool = False) -> tuple[int, float, float]:
        """(per-group bound, L1, L2) of one unit on a sum of per-row values in
        [-row_bound, row_bound] (``per_unit``: one value per (unit, group), a unit count)."""
        per_group = row_bound if per_unit else self.max_rows * row_bound
        return per_group, float(self.max_groups * per_group), math.sqrt(self.max_groups) * per_group


@dataclass(frozen=True)
class AggregateMeasure:
    """One exact integer aggregate: the sum over bounded rows of a per-row value in
    [-row_bound, row_bound] (after centring), or a count of (unit, group) pairs."""

    name: str
    kind: str
    column: str | None
    row_bound: int
    per_unit: bool  # one contribution per (unit, group): units, not rows


@dataclass(frozen=True)
class Aggregate:
    """GROUP BY keys (public domains, or released by ``hidden``), exact measures per group."""

    input: Bound
    keys: tuple[KeyPlan, ...]
    measures: tuple[Measure, ...]
    hidden: str = "thresholded"  # how keys without a public domain are released

    def children(self) -> tuple:
        return (self.input,)

    @functools.cached_property
    def specs(self) -> tuple[AggregateMeasure, ...]:
        """Each measure as this node sees it: its per-row bound in engine units, derived from
        its fixed-point range by its kind's object and R (not read off the planner's figures)."""
        R = self.input.max_rows
        return tuple(
            AggregateMeasure(
                m.name,
                m.kind,
                m.column,
                m.measure_kind.row_bound(m.lo, m.hi, m.center, m.center2, R) * m.scale,
                per_unit=m.measure_kind.per_pair,
            )
            for m in self.measures
        )

    def describe(self) -> str:
        domains = [
            self.hidden if kp.domain is None else f"public: {len(kp.domain)} bins"
            for kp in self.keys
        ]
        keys = ", ".join(f"{kp.key.sql} ({d})" for kp, d in zip(self.keys, domains, strict=True))
        head = f"Aggregate by {keys}" if keys else "Aggregate"
        return (
            head + ": " + ", ".join(f"{m.name}={m.kind}({m.column or '*'})" for m in self.measures)
        )

    def stability(self) -> str:
        return "per measure: L1 = G * R * row bound (units: G * 1), L2 = sqrt(G) * R * row bound"
