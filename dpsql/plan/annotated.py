"""The plan: the bound query and its annotated release tree, as one frozen value.

Planning does not fill in a record beside the tree: it builds the tree
(dpsql.plan.tree.annotate), ``Release(Aggregate(Bound(rows)))`` over the bound query's rows,
and a :class:`Plan` is that tree with what running it needs (ε and δ as asked, the charge, the
data version, the engine and its store). Everything the lowerings read comes off the nodes:
R, G and the bounding off :class:`~dpsql.plan.relational.Bound`, the keys and the measures off
:class:`~dpsql.plan.relational.Aggregate`, the outputs, threshold, estimators and selection off
:class:`~dpsql.plan.measures.Release`; the properties below are those reads, named as the
lowerings use them. EXPLAIN prints the same tree (:attr:`Plan.root`), the cost check evaluates
its privacy maps (dpsql.plan.check), and the cache keys serialise it (dpsql.plan.canonical).
A change is a new tree (:meth:`Plan.with_`), never a patched field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from dpsql.aggregates.mode import ModeMeasure
from dpsql.frontend.statements import DPQuery
from dpsql.plan.canonical import answer_key
from dpsql.plan.measures import PostProcess, Release
from dpsql.plan.relational import Aggregate, Bound
from dpsql.plan.tree import annotate
from dpsql.plan.values import (
    ClipEstimate,
    KeyPlan,
    Measure,
    OutputAggregate,
    QuantileMeasure,
    Selection,
    Threshold,
    rescale_factor,
)
from dpsql.privacy.accounting import Cost


@dataclass(frozen=True)
class Plan:
    query: DPQuery  # the bound tree: its rows are the Bound node's input, its post the root's
    release: Release  # Release(Aggregate(Bound(rows))): what is measured, bounded and released
    epsilon: float
    delta: float
    mechanism: str
    cost: Cost
    data_version: str = ""
    # the engine that runs it ("duckdb", "spark"; "" unknown: a plan built outside a service)
    # and that engine's prepared store of the table (dpsql.lower.store_layout.StoreInfo) or
    # None: a plan with an engine compiles against that store only
    engine: str = ""
    store: object = field(default=None, compare=False, repr=False)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    # -- the nodes ------------------------------------------------------------------------

    @property
    def root(self) -> PostProcess:
        """The whole tree, post-processing on top (what EXPLAIN prints)."""
        return PostProcess(self.release, self.query.post)

    @property
    def aggregate(self) -> Aggregate:
        return self.release.input

    @property
    def bound(self) -> Bound:
        return self.release.input.input

    # -- reads off the nodes, named as the lowerings use them ------------------------------

    @property
    def keys(self) -> tuple[KeyPlan, ...]:
        return self.aggregate.keys

    @property
    def measures(self) -> tuple[Measure, ...]:
        return self.aggregate.measures

    @property
    def outputs(self) -> tuple[OutputAggregate, ...]:
        return self.release.outputs

    @property
    def threshold(self) -> Threshold | None:
        return self.release.threshold

    @property
    def quantiles(self) -> tuple[QuantileMeasure | ModeMeasure, ...]:
        return self.release.quantiles

    @property
    def clips(self) -> tuple[ClipEstimate, ...]:
        return self.release.clips

    @property
    def selection(self) -> Selection | None:
        return self.release.selection

    @property
    def max_rows(self) -> int:
        """R."""
        return self.bound.max_rows

    @property
    def max_groups(self) -> int:
        """G (effective)."""
        return self.bound.max_groups

    @property
    def bounding(self) -> str:
        """How pairs over R are bounded: "sample" or "scale" (dpsql.plan.values)."""
        return self.bound.method

    @property
    def group_scaling(self) -> bool:
        """Bounding "scale" with public keys and more bins than G: a unit's k > G groups all
        count, at G/k each, instead of G of them chosen by keyed hash."""
        return self.bound.groups_scaled

    def measure(self, name: str) -> Measure:
        return next(m for m in self.measures if m.name == name)

    def quantile_of(self, output: OutputAggregate) -> QuantileMeasure | ModeMeasure:
        """The histogram measure an output is read from (its kind's and its column's)."""
        return self.release.quantile_of(output)

    @property
    def bounded_by_unit(self) -> bool:
        return self.query.table.privacy_unit is not None

    def fingerprint(self) -> str:
        """The answer cache's key: a digest of the plan's canonical measured tree (everything
        that determines the released distribution, not post-processing; dpsql.plan.canonical)."""
        return answer_key(self)

    # -- a changed plan is a new tree --------------------------------------------------------

    def with_(self, **changes: Any) -> Plan:
        """This plan with some parts replaced and its tree built again around them, as the
        planner builds it (:func:`dpsql.plan.tree.annotate`): ``query`` (the Bound node then
        reads its rows), any of :data:`TREE_PARTS`, or any of the plan's own fields."""
        query = changes.pop("query", self.query)
        parts = {name: changes.pop(name) for name in TREE_PARTS if name in changes}
        if query is self.query and not parts:
            return replace(self, **changes)
        b = self.bound
        release = annotate(
            query,
            (b.max_rows, b.max_groups, b.method, b.groups_scaled),
            **{name: parts.get(name, getattr(self, name)) for name in TREE_PARTS},
        )
        return replace(self, query=query, release=release, **changes)


#: What :meth:`Plan.with_` rebuilds the tree around, beside the query.
TREE_PARTS = ("keys", "measures", "outputs", "threshold", "quantiles", "clips", "selection")


def bounds_groups(plan: Plan) -> bool:
    """Whether a unit can be in more than G groups, so that its groups must be ranked: there
    are keys, and not all public with at most G bins in all."""
    sizes = [len(kp.domain) for kp in plan.keys if kp.domain is not None]
    bins = math.prod(sizes) if len(sizes) == len(plan.keys) else None
    return bool(plan.keys) and (bins is None or bins > plan.max_groups)


def value_measures(plan: Plan) -> list[Measure]:
    """Measures summed from row values (not counted per row or unit): those need sampling
    (MeasureKind.row_scaled: a rescaled bounding multiplies them by R/n)."""
    return [m for m in plan.measures if m.measure_kind.row_scaled]


def count_scale(plan: Plan) -> int:
    """The fine grid of the plan's row and unit counts' pair shares (all share it: row bound
    1), before the per-unit rounding brings them back to integers (dpsql.plan.values)."""
    return next((m.pair_scale for m in plan.measures if m.measure_kind.tallied), rescale_factor(1))
