"""The planner: a bound query annotated with bounds, sensitivities, mechanisms and the
budget split, as the plan tree (:class:`dpsql.plan.annotated.Plan`; dpsql.plan.values says
what each record is).

:func:`build_plan` runs the planning steps in order (contribution bounds, the measures and
their shares of ε and δ, thresholds or the optimal selection, histogram measures, clipping
estimates, bias measures) and then checks the result against the plan tree's privacy maps
(dpsql.plan.check): the charged cost must be exactly their sum. :func:`with_clip_ranges` plans
a query again once its automatic clipping ranges are released.

The plan's values live in dpsql.plan.values, below the plan tree (dpsql.plan) that reads them; this
module sits above both, so the check adds no import cycle (tests/test_layering.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import cast

from dpsql.aggregates import KINDS, QUANTILE_KINDS, SUMMED_KINDS, quantile_target
from dpsql.aggregates.mode import ModeMeasure
from dpsql.errors import NotSupportedError, PrivacyError
from dpsql.frontend.statements import AggregateCall, DPQuery
from dpsql.plan import bias, sharing
from dpsql.plan.annotated import Plan

# Measure kinds and the value one row contributes (before summing):
#   rows   - 1 for every row                       (COUNT(*))
#   values - 1 if the column is not NULL           (COUNT(col), denominators)
#   units  - 1 per (unit, group)                   (COUNT(DISTINCT unit), thresholding)
#   distinct - distinct non-NULL values of a column over the bounded rows (COUNT(DISTINCT col)):
#            a unit's <= R rows in a group add at most R values to it, so its bound is R
#   distinct_sum - SUM(DISTINCT col): the sum of the distinct non-NULL values round(clamp(x)/g)
#            in [lo, hi] over the bounded rows of a group, never centred. Proof of its bound:
#            the group's set S of such values changes, when one unit's <= R rows leave it, only
#            by values of those rows (a value still held by another row stays), so at most R
#            values leave S and none enters; each is at most M = max(|lo|, |hi|) in magnitude,
#            so the sum moves by <= R·M (row_bound M, per group R·M) in each of the unit's <= G
#            groups: L1 = G·R·M, L2 = sqrt(G)·R·M, as "distinct" with M in place of 1.
#   sum    - round(clamp(x)/g) - center, 0 if NULL (SUM, AVG, VAR)
#   sumsq  - (round(clamp(x)/g) - center)^2 - center2, 0 if NULL (VAR, STDDEV)
# and the bias estimates (setting bias_estimate, docs/bias.md; proofs in dpsql.plan.bias):
#   dropped - per kept (unit, group) pair: min(max(n - R, 0), C), its rows cut by R, capped
#   cut     - per kept pair: the pair's clamped sum of x times min(max(n - R, 0), C) / n
#   clamped - per bounded row: round((x - clamp(x)) / g) within [-W, W], W = hi - lo
# (their objects, with what differs between them: dpsql.plan.measure_kinds.MEASURE_KINDS)
# measures counted by their own engine query over the bounded rows (CompiledQuery.extras)
from dpsql.plan.check import check_plan
from dpsql.plan.fixed_point import fixed_point_bounds
from dpsql.plan.measure_kinds import MEASURE_KINDS
from dpsql.plan.tree import annotate
from dpsql.plan.values import (
    ClipEstimate,
    KeyPlan,
    Measure,
    OutputAggregate,
    QuantileMeasure,
    QuantileTarget,
    Selection,
    Threshold,
    quantile_grid,
    quantile_target_order,
    rescale_factor,
)
from dpsql.policy import ColumnPolicy, TablePolicy
from dpsql.privacy.accounting import Cost, exact
from dpsql.privacy.clipping import LogHistogram
from dpsql.privacy.mechanisms import (
    Gaussian,
    Laplace,
    Mechanism,
    quieter_sum_noise,
    threshold_below,
)
from dpsql.privacy.partition import OptimalSelection, Unreleased
from dpsql.privacy.samplers import SecureNoise


def _part_epsilon(share: float, parts: int, groups: int) -> float:
    """The largest float e with parts · groups · e <= share, exactly."""
    e = share / (parts * groups)
    while Fraction(e) * parts * groups > Fraction(share):
        e = math.nextafter(e, 0.0)
    return e


def effective_bounding(table: TablePolicy, kinds: Sequence[str], quantiles: bool) -> str:
    """The bounding a plan uses: the table's, except that sampling stays where a measure
    needs the bounded rows themselves (quantile bins, COUNT(DISTINCT col): their extra
    queries count values of the kept rows) or the table is row-level (nothing to bound)."""
    if table.privacy_unit is None or table.bounding != "scale":
        return "sample"
    if quantiles or any(MEASURE_KINDS[k].distinct for k in kinds):
        return "sample"
    return "scale"


@functools.lru_cache(maxsize=4096)  # a function of the policy's numbers: ~15 us in Fractions
def _fixed_range(col: ColumnPolicy) -> tuple[int, int]:
    return fixed_point_bounds(col.lower, col.upper, col.granularity)  # type: ignore[arg-type]


def _measure_specs(
    query: DPQuery,
    thresholded: bool,
    share: Callable[[tuple[str, str | None]], tuple[str, str | None]] | None = None,
) -> tuple[list[tuple[str, str | None]], list[tuple[AggregateCall, list[tuple[str, str | None]]]]]:
    """The (kind, column) measures the query needs, and each output's measures in order."""
    needed: list[tuple[str, str | None]] = []

    def need(kind: str, column: str | None) -> tuple[str, str | None]:
        spec = (kind, column) if share is None else share((kind, column))
        if spec not in needed:
            needed.append(spec)
        return spec

    outputs = []
    for call in query.aggregates:
        # each kind names the measures it reads (dpsql.aggregates)
        parts = [need(kind, column) for kind, column in KINDS[call.kind].measures(call.column)]
        outputs.append((call, parts))
    if thresholded:
        need("units", None)
    return needed, outputs


def build_plan(
    query: DPQuery,
    domains: Sequence[tuple | None],
    *,
    epsilon: float,
    delta: float,
    mechanism: str,
    data_version: str = "",
    quantile_method: str = "em",
    partition_selection: str = "auto",
    engine: str = "",
    store: object = None,
    bias_estimate: bool = False,
) -> Plan:
    """Annotate a bound query with bounds, sensitivities, mechanisms and the budget split.

    ``bias_estimate``: also measure what the bounds cut (dpsql.plan.bias), from
    BIAS_SHARE of the ε left after any clipping share (the session setting, on by default)."""
    table = query.table
    thresholded = any(d is None for d in domains)
    _refuse_without_delta(query, domains, delta, mechanism, thresholded)
    R, G, groups_over = _contribution_bounds(query, domains, thresholded)
    quantile_targets, histograms = _histogram_targets(query)
    n_histograms = len(quantile_targets) + len(histograms)
    auto = _auto_clipped(query)
    # what the bounds cut: its measures' share of ε comes after clipping's (dpsql.plan.bias)
    bias_specs = bias.bias_specs(query, bias_estimate, R, _fixed_range)
    split = _split_epsilon(
        query, epsilon, delta, mechanism, partition_selection, thresholded, auto,
        bool(bias_specs), n_histograms, R, G,
    )  # fmt: skip
    clip_epsilon, bias_epsilon = split.clip_epsilon, split.bias_epsilon
    quantile_epsilon, threshold_delta = split.quantile_epsilon, split.threshold_delta
    specs, output_specs, eps_shares, selection = split.layout
    # k = 0: only public keys are asked for (SELECT grp ... GROUP BY grp): nothing to noise.
    k = max(len(specs), 1)
    measure_delta = 0.0
    if mechanism == "gaussian" and specs:
        measure_delta = (delta - threshold_delta) / k

    bounding = effective_bounding(table, [kind for kind, _ in specs], n_histograms > 0)
    group_scaling = bounding == "scale" and groups_over
    # Centre sums on the midpoint when a count of the same column is released anyway.
    count_of = _count_specs(query, specs, R)
    counted = set(count_of)
    names: dict[tuple[str, str | None], str] = {spec: f"m{i}" for i, spec in enumerate(specs)}
    shape = _Shape(R, G, bounding, group_scaling, mechanism, measure_delta)
    measures = [
        _measure(table, f"m{i}", spec, eps_shares[i], shape, counted, count_of, names)
        for i, spec in enumerate(specs)
    ]

    outputs = _outputs(query, output_specs, names)

    cut = _bias_measures(
        query, bias_specs, bias_epsilon, len(measures), R, G, bounding, group_scaling
    )
    if not all(_drawable(m.mechanism) for m in cut):
        # at an ε so small that a bias measure's noise cannot be drawn (its share is a tenth
        # of ε, its sensitivity C·M): the query as if bias_estimate were off, not a refusal
        return build_plan(
            query,
            domains,
            epsilon=epsilon,
            delta=delta,
            mechanism=mechanism,
            data_version=data_version,
            quantile_method=quantile_method,
            partition_selection=partition_selection,
            engine=engine,
            store=store,
            bias_estimate=False,
        )
    measures += cut

    threshold = _threshold(selection, specs, measures, threshold_delta, G)
    quantiles = _histogram_measures(
        query, quantile_targets, histograms, R, G, quantile_epsilon, quantile_method
    )
    clips = _clip_estimates(query, domains, auto, specs, eps_shares, clip_epsilon, epsilon, R, G)

    threshold_cost = Cost(delta=threshold_delta if threshold is not None else 0.0)
    cost, selection = _charged(threshold_cost, measures, selection, quantiles, clips, G)
    if bias_specs and cost.exact_rho == 0:
        measures, cost = _bias_to_total(measures, cost, epsilon)
    release = annotate(
        query,
        (R, G, bounding, group_scaling),
        tuple(KeyPlan(key, d) for key, d in zip(query.keys, domains, strict=True)),
        tuple(measures),
        tuple(outputs),
        threshold=threshold,
        quantiles=tuple(quantiles),
        clips=tuple(clips),
        selection=selection,
    )
    plan = Plan(
        query=query,
        release=release,
        epsilon=epsilon,
        delta=delta if (thresholded or mechanism == "gaussian") else 0.0,
        mechanism=mechanism,
        cost=cost,
        data_version=data_version,
        # the ε a replanning (with_clip_ranges) starts from: the bias share is taken again
        extra={
            "measured_epsilon": split.epsilon_main + bias_epsilon,
            "bias_estimate": bias_estimate,
        },
        engine=engine,
        store=store,
    )
    check_plan(plan)  # charged cost == the sum of the plan tree's privacy maps
    return plan


@dataclass(frozen=True)
class _Split:
    """A query's ε and δ before the measures' own shares: the clipping share off the top, then
    the bias measures' share, then one share per histogram release (quantiles, MODE) equal
    to a measure's average; the rest (``epsilon_main``) is split over the measures and the
    selection by dpsql.plan.sharing (``layout``). Thresholding takes ``threshold_delta``."""

    clip_epsilon: float
    bias_epsilon: float
    quantile_epsilon: float
    epsilon_main: float
    threshold_delta: float
    layout: Layout


def _split_epsilon(
    query: DPQuery,
    epsilon: float,
    delta: float,
    mechanism: str,
    partition_selection: str,
    thresholded: bool,
    auto: list[str],
    measures_bias: bool,
    n_histograms: int,
    R: int,
    G: int,
) -> _Split:
    """Split ε and δ (see :class:`_Split`); the clipping share is the largest any
    auto-clipped column asks for."""
    table = query.table
    clip_epsilon = epsilon * max(table.columns[c].clip_share for c in auto) if auto else 0.0
    epsilon_rest = epsilon - clip_epsilon
    bias_epsilon = bias.share(epsilon_rest) if measures_bias else 0.0
    epsilon_rest = epsilon_rest - bias_epsilon
    threshold_delta = 0.0
    if thresholded:
        threshold_delta = delta if mechanism == "laplace" else delta / 2

    def choose(eps: float) -> Layout:
        return _choose_layout(
            query, thresholded, partition_selection, eps, delta, threshold_delta, mechanism, R, G
        )

    layout = choose(epsilon_rest)
    quantile_epsilon = 0.0
    epsilon_main = epsilon_rest
    if n_histograms:
        slots = len(layout[0]) + (
            1 if layout[3] is not None and layout[3].mechanism is not None else 0
        )
        quantile_epsilon = epsilon_rest / (slots + n_histograms)
        if slots:
            epsilon_main = epsilon_rest - quantile_epsilon * n_histograms
            layout = choose(epsilon_main)
    return _Split(
        clip_epsilon, bias_epsilon, quantile_epsilon, epsilon_main, threshold_delta, layout
    )


def _charged(
    cost: Cost,
    measures: list[Measure],
    selection: Selection | None,
    quantiles: Sequence[QuantileMeasure | ModeMeasure],
    clips: Sequence[ClipEstimate],
    G: int,
) -> tuple[Cost, Selection | None]:
    """The plan's cost: ``cost`` (the threshold's δ) plus every measure's, the selection's,
    each histogram release's and each clipping histogram's. The selection reads an exact unit
    count: one more measure (appended to ``measures``), never noised or released."""
    for m in measures:
        cost = cost + m.mechanism.cost
    if selection is not None and selection.mechanism is not None:
        exact = f"m{len(measures)}"
        measures.append(_exact_units(exact, G))
        cost = cost + selection.mechanism.cost
        selection = replace(selection, measure=exact)
    for qm in quantiles:
        cost = cost + qm.cost
    for clip in clips:
        cost = cost + clip.cost
    return cost, selection


def _refuse_without_delta(
    query: DPQuery,
    domains: Sequence[tuple | None],
    delta: float,
    mechanism: str,
    thresholded: bool,
) -> None:
    """Free refusals of what needs δ > 0: keys that are not public (thresholding) and the
    Gaussian mechanism."""
    if thresholded and delta <= 0:
        key = next(k for k, d in zip(query.keys, domains, strict=True) if d is None)
        raise PrivacyError(
            f"GROUP BY {key.sql}: the keys are not public, and releasing them needs delta > 0 "
            "(thresholding)",
            construct=key.sql,
            position=key.position,
            hint=f"declare the public values of {', '.join(key.columns)} in the policy "
            "(values = [...]), group by a public binning, or SET delta = 1e-6",
        )
    if mechanism == "gaussian" and delta <= 0:
        raise PrivacyError(
            "the Gaussian mechanism needs delta > 0",
            construct="mechanism",
            hint="SET delta = 1e-6, or SET mechanism = 'laplace'",
        )


def _contribution_bounds(
    query: DPQuery, domains: Sequence[tuple | None], thresholded: bool
) -> tuple[int, int, bool]:
    """R (rows per unit and group), G (groups per unit: at most the public bins) and whether
    a unit may fall in more public groups than G (bounding = "scale" keeps all at G/k)."""
    table = query.table
    R = table.max_rows_per_unit
    # A row-level table's unit is one row, which lies in exactly one group.
    G = table.max_groups_per_unit if (query.keys and table.privacy_unit) else 1
    # bounding = "scale" with public keys: a unit over G groups keeps all k of them at G/k
    groups_over = False
    if query.keys and not thresholded:
        bins = math.prod(len(d) for d in domains if d is not None)
        groups_over = bool(table.privacy_unit) and bins > G
        G = min(G, bins)
    return R, G, groups_over


def _histogram_targets(
    query: DPQuery,
) -> tuple[dict[str, set[QuantileTarget]], list[tuple[str, str | None]]]:
    """The quantile targets per column (MIN, MAX, quantiles), and the other histogram kinds'
    (kind, column) pairs (MODE), one measure each."""
    quantile_targets: dict[str, set[QuantileTarget]] = {}
    for call in query.aggregates:
        if call.kind in QUANTILE_KINDS:
            quantile_targets.setdefault(call.column, set()).add(quantile_target(call))  # type: ignore[arg-type]
    # other histogram kinds (MODE): one measure per (kind, column), built by the kind's object
    histograms = list(
        dict.fromkeys(
            (call.kind, call.column)
            for call in query.aggregates
            if KINDS[call.kind].histogram not in (None, "quantile")
        )
    )
    return quantile_targets, histograms


def _auto_clipped(query: DPQuery) -> list[str]:
    """The summed columns whose policy says clip = "auto": their range is released first."""
    table = query.table
    return list(
        dict.fromkeys(
            call.column
            for call in query.aggregates
            if call.kind in SUMMED_KINDS
            and call.column is not None
            and table.columns[call.column].clip == "auto"
        )
    )


def _outputs(
    query: DPQuery,
    output_specs: list[tuple[AggregateCall, list[tuple[str, str | None]]]],
    names: dict[tuple[str, str | None], str],
) -> list[OutputAggregate]:
    """Each aggregate of the query: the measures it reads, and its output's bounds."""
    outputs = []
    for call, parts in output_specs:
        output_col = query.table.columns[call.column] if call.column else None
        lower, upper = KINDS[call.kind].output_bounds(output_col)
        outputs.append(
            OutputAggregate(call, tuple(names[p] for p in parts), lower=lower, upper=upper)
        )
    return outputs


@dataclass(frozen=True)
class _Shape:
    """What every measure of one plan shares: the contribution bounds (R rows per group, G
    groups per unit), the bounding and its group scaling, the mechanism and each measure's δ."""

    R: int
    G: int
    bounding: str
    group_scaling: bool
    mechanism: str
    measure_delta: float


def _measure(
    table: TablePolicy,
    name: str,
    spec: tuple[str, str | None],
    eps_share: float,
    shape: _Shape,
    counted: set[str],
    count_of: dict[str, tuple[str, str | None]],
    names: dict[tuple[str, str | None], str],
) -> Measure:
    """One measure of ``spec`` (kind, column): its fixed-point range and centre, its
    per-row and per-group bounds, its sensitivities and its noise at ``eps_share``."""
    kind, column = spec
    g = 1.0
    lo = hi = center = center2 = 0
    mk = MEASURE_KINDS[kind]  # what differs between kinds (dpsql.plan.measure_kinds)
    if mk.counted:
        row_bound = 1
    else:
        col = table.columns[column]  # type: ignore[index]
        g = col.granularity
        lo, hi = fixed_point_bounds(col.lower, col.upper, g)  # type: ignore[arg-type]
        if column in counted and mk.centred:
            center = (lo + hi) // 2
        row_bound = max(abs(lo - center), abs(hi - center))
        # The engine computes per-row values (and their squares) in 64-bit integers: an
        # overflow would fail the query only when some row is extreme, a data-dependent
        # error. Refuse such plans up front instead.
        limit = 3_037_000_499 if mk.squared else 2**62  # isqrt(2**63 - 1)
        if max(abs(lo), abs(hi), row_bound) > limit:
            raise NotSupportedError(
                f"{column}: its fixed-point range (bounds / granularity) is too large for "
                "64-bit " + ("sums of squares (VAR, STDDEV)" if mk.squared else "sums"),
                construct=column,
                hint=f"declare a coarser granularity or narrower bounds for {column}",
            )
        if mk.squared:
            span = row_bound * row_bound  # squared centred values lie in [0, span]
            center2 = span // 2
            row_bound = max(center2, span - center2)
            g = g * g
    scale = fine = 1
    if mk.fine_grid(shape.bounding, shape.group_scaling):
        scale = rescale_factor(row_bound)
    if mk.rounded and scale > 1:
        # shares on the fine grid, rounded per unit to an integer count (ROUNDED_KINDS)
        fine, scale = scale, 1
    per_group = (row_bound if mk.per_pair else shape.R * row_bound) * scale
    l1 = float(shape.G * per_group)
    l2 = math.sqrt(shape.G) * per_group
    if shape.mechanism == "laplace":
        # pure ε: a sum's noise of least E|X| at the same charge (the staircase) where one unit
        # moves one group only (its map is per changed group: dpsql.privacy.mechanisms
        # .Staircase.privacy_map), else the discrete Laplace
        scalar = shape.G == 1 and not shape.group_scaling
        mech: Mechanism = (
            quieter_sum_noise(l1, eps_share)
            if mk.least_noise and scalar
            else Laplace(l1=l1, epsilon=eps_share)
        )
    else:
        mech = Gaussian(l2=l2, epsilon=eps_share, delta=shape.measure_delta)
    return Measure(
        name=name,
        kind=kind,
        column=column,
        granularity=g,
        center=center,
        lo=lo,
        hi=hi,
        center2=center2,
        row_bound=row_bound,
        per_group_bound=per_group,
        l1=l1,
        l2=l2,
        epsilon=eps_share,
        delta=shape.measure_delta,
        mechanism=mech,
        count=names[count_of[column]] if center and column in count_of else None,
        scale=scale,
        fine=fine,
    )


def _threshold(
    selection: Selection | None,
    specs: list[tuple[str, str | None]],
    measures: list[Measure],
    threshold_delta: float,
    G: int,
) -> Threshold | None:
    """The τ a group's noisy unit count must reach to be released (thresholding), or None."""
    threshold = None
    if selection is not None and selection.mode == "threshold":
        units = measures[specs.index(("units", None))]
        mech = cast(Mechanism, units.mechanism)
        tau = mech.threshold(threshold_delta, G)
        below = threshold_below(mech, tau, threshold_delta, G)
        threshold = Threshold(measure=units.name, tau=tau, delta=threshold_delta, below=below)
    return threshold


def _histogram_measures(
    query: DPQuery,
    quantile_targets: dict[str, set[QuantileTarget]],
    histograms: list[tuple[str, str | None]],
    R: int,
    G: int,
    quantile_epsilon: float,
    quantile_method: str,
) -> list[QuantileMeasure | ModeMeasure]:
    """One quantile release per column (its MIN, MAX and quantiles together), then one
    measure per other histogram kind (MODE), each at ``quantile_epsilon``."""
    table = query.table
    quantiles: list[QuantileMeasure | ModeMeasure] = []
    for i, (column, found) in enumerate(quantile_targets.items()):
        targets = tuple(sorted(found, key=quantile_target_order))
        n_parts = sum(
            1 for kind in ("min", "quantile", "max") if any(t[0] == kind for t in targets)
        )
        if quantile_method == "smooth" and targets != (("quantile", 0.5),):
            call = next(
                c for c in query.aggregates if c.column == column and c.kind in QUANTILE_KINDS
            )
            raise NotSupportedError(
                f"{call.label}: the smooth-sensitivity mechanism releases MEDIAN only",
                construct=call.label,
                hint="SET quantile_method = 'em' (or 'pf') for other quantiles, MIN and MAX",
            )
        quantiles.append(
            QuantileMeasure(
                name=f"q{i}",
                column=column,
                grid=quantile_grid(table.columns[column]),
                targets=targets,
                max_values=R,
                groups=G,
                part_epsilon=_part_epsilon(quantile_epsilon, n_parts, G),
                epsilon=quantile_epsilon,
                method=quantile_method,
            )
        )
    for kind, hist_column in histograms:  # MODE: its own measure, one slot of the ε split
        measure = KINDS[kind].histogram_measure(
            f"q{len(quantiles)}",
            table.columns[cast(str, hist_column)],
            R,
            G,
            quantile_epsilon,
        )
        quantiles.append(measure)
    return quantiles


def _clip_estimates(
    query: DPQuery,
    domains: Sequence[tuple | None],
    auto: list[str],
    specs: list[tuple[str, str | None]],
    eps_shares: Sequence[float],
    clip_epsilon: float,
    epsilon: float,
    R: int,
    G: int,
) -> list[ClipEstimate]:
    """Per auto-clipped column, the noisy histogram of |x| its range is released from."""
    table = query.table
    clips = []
    # every released group's SUM pays its own noise, the clamp's bias is over all of them
    released_groups = math.prod(len(d) for d in domains if d is not None) if query.keys else 1
    for column in auto:
        col = table.columns[column]
        sum_share = [e for s, e in zip(specs, eps_shares, strict=True) if s == ("sum", column)]
        clips.append(
            ClipEstimate(
                column=column,
                histogram=LogHistogram.for_bounds(
                    col.lower,  # type: ignore[arg-type]
                    col.upper,  # type: ignore[arg-type]
                    resolution=col.granularity,
                    ratio=2**0.25,
                ),
                epsilon=clip_epsilon / len(auto),
                max_values=R * G,
                sum_epsilon=(sum_share[0] if sum_share else max(eps_shares, default=epsilon))
                / released_groups,
                # "auto" (the default): a total's error is bias + noise ("sum"); per-group
                # answers, small groups' noise dominates: the clip_quantile of |x| (measured)
                method=col.clip_method
                if col.clip_method != "auto"
                else ("quantile" if released_groups > 1 else "sum"),
                q=col.clip_quantile,
            )
        )
    return clips


def with_clip_ranges(plan: Plan, ranges: dict[str, tuple[float, float]]) -> Plan:
    """The plan the engine runs once its clipping ranges are released: the same query with
    each auto-clipped column's bounds replaced by its (public, DP) range, planned again at the
    ε left after the clipping share (so its cost is the original's minus the clipping's)."""
    import dataclasses

    table = plan.query.table
    columns = dict(table.columns)
    for name, (lo, hi) in ranges.items():
        col = columns[name]
        if col.type == "int":
            lo, hi = math.floor(lo), math.ceil(hi)
        lo = max(lo, cast(float, col.lower))
        hi = min(hi, cast(float, col.upper))
        columns[name] = dataclasses.replace(col, lower=lo, upper=hi, clip="declared")
    query = plan.query.with_table(dataclasses.replace(table, columns=columns))
    return build_plan(
        query,
        [kp.domain for kp in plan.keys],
        epsilon=plan.extra["measured_epsilon"],
        delta=plan.delta,
        mechanism=plan.mechanism,
        data_version=plan.data_version,
        quantile_method=next(
            (q.method for q in plan.quantiles if isinstance(q, QuantileMeasure)), "em"
        ),
        partition_selection=plan.selection.requested if plan.selection else "auto",
        engine=plan.engine,
        store=plan.store,
        bias_estimate=plan.extra.get("bias_estimate", False),
    )


# -- shared measures, the ε split and partition selection (dpsql.plan.sharing) ------------------


def _count_specs(
    query: DPQuery, specs: list[tuple[str, str | None]], R: int
) -> dict[str, tuple[str, str | None]]:
    """Per summed column, the measure counting its values, when the query measures it anyway
    (its sum, and sum of squares, is then centred on its range's midpoint and the count adds
    centre × it back): per column of a centred measure kind (MeasureKind.centred)."""
    units = ("units", None) in specs
    out = {}
    for kind, column in specs:
        if MEASURE_KINDS[kind].centred and column is not None:
            spec = sharing.count_spec(query.table, column, units, R)
            if spec in specs:
                out[column] = spec
    return out


def _sum_scale(query: DPQuery, column: str, centred: bool) -> tuple[float, float, float]:
    """(h, c, M) of a column's fixed-point range: per-row bound after centring, the centre,
    the largest |value| (as the measure loop computes them)."""
    col = query.table.columns[column]
    lo, hi = fixed_point_bounds(col.lower, col.upper, col.granularity)  # type: ignore[arg-type]
    center = (lo + hi) // 2 if centred else 0
    h = max(abs(lo - center), abs(hi - center))
    return float(h), float(center), float(max(abs(lo), abs(hi), 1))


def _split_weights(
    query: DPQuery,
    specs: list[tuple[str, str | None]],
    output_specs: list[tuple[AggregateCall, list[tuple[str, str | None]]]],
    R: int,
    threshold_on_units: bool,
) -> list[float]:
    """C_i per spec: the sum over outputs of (weight of its noise × its per-row bound)²."""
    count_of = _count_specs(query, specs, R)
    weights = dict.fromkeys(specs, 0.0)
    for call, parts in output_specs:
        parts = list(parts)
        if KINDS[call.kind].recentred and call.column in count_of:  # SUM: g (S + c N)
            parts.append(count_of[call.column])

        def scale(spec: tuple[str, str | None]) -> tuple[float, float, float]:
            return _sum_scale(query, spec[1], spec[1] in count_of)  # type: ignore[arg-type]

        for spec, coefficient in sharing.output_coefficients(call.kind, parts, scale).items():
            bound = 1 if spec[0] == "units" else R
            weights[spec] += (coefficient * bound) ** 2
    if threshold_on_units:
        weights[("units", None)] += _selection_weight(list(weights.values()))
    return [weights[s] for s in specs]


def _selection_weight(weights: list[float]) -> float:
    """The selection's weight in the split: that of the query's heaviest measure (at least a
    COUNT's): suppressing a group loses every value of it, so the selection is never starved
    to feed one value's precision."""
    return max([1.0, *weights])


# a query's measures, its outputs' measures, each measure's ε and its partition selection
Layout = tuple[
    list[tuple[str, str | None]],
    list[tuple[AggregateCall, list[tuple[str, str | None]]]],
    list[float],
    "Selection | None",
]


def _choose_layout(
    query: DPQuery,
    thresholded: bool,
    requested: str,
    epsilon: float,
    delta: float,
    threshold_delta: float,
    mechanism: str,
    R: int,
    G: int,
) -> Layout:
    """The measures, each one's ε, and the partition selection (optimal or threshold,
    whichever keeps a key at the smaller unit count; see dpsql.plan.sharing)."""
    if requested not in sharing.SELECTION_MODES:
        raise PrivacyError(
            f"unknown partition_selection {requested!r}",
            construct="partition_selection",
            hint="SET partition_selection = 'auto', 'optimal' or 'threshold'",
        )
    # a kind measuring the units (COUNT(DISTINCT unit)) measures them for every count
    units_measured = thresholded or any(
        ("units", None) in KINDS[c.kind].measures(c.column) for c in query.aggregates
    )

    def share(spec: tuple[str, str | None]) -> tuple[str, str | None]:
        return sharing.canonical(query.table, spec, units_measured, R)

    if not thresholded:
        specs, output_specs = _measure_specs(query, False, share)
        weights = _split_weights(query, specs, output_specs, R, False)
        return specs, output_specs, sharing.split(epsilon, weights), None
    candidates: list[tuple[int, float, list, list, list[float], OptimalSelection | None]] = []
    modes = ("threshold", "optimal") if requested == "auto" else (requested,)
    for mode in modes:
        specs, output_specs = _measure_specs(query, mode == "threshold", share)
        weights = _split_weights(query, specs, output_specs, R, mode == "threshold")
        if mode == "threshold":
            shares = sharing.split(epsilon, weights)
            eps_u = shares[specs.index(("units", None))]
            k = max(len(specs), 1)
            units: Mechanism
            if mechanism == "laplace":
                units = Laplace(l1=float(G), epsilon=eps_u)
            else:
                units = Gaussian(
                    l2=math.sqrt(G), epsilon=eps_u, delta=(delta - threshold_delta) / k
                )
            tau = units.threshold(threshold_delta, G)
            below = threshold_below(units, tau, threshold_delta, G)
            n_half = sharing.half_keep(sharing.threshold_suppression(units, tau, below))
            error = _output_error(query, specs, output_specs, R, shares)
            candidates.append((n_half, error, specs, output_specs, shares, None))
        else:
            *shares, eps_sel = sharing.split(epsilon, [*weights, _selection_weight(weights)])
            try:
                sel = OptimalSelection(eps_sel, threshold_delta, max_groups=G)
                n_half = sharing.half_keep(sel.suppression_probability)
            except (ValueError, OverflowError):
                if requested == "optimal":
                    raise PrivacyError(
                        "optimal partition selection at this epsilon needs too many units per "
                        "group before a key is released, or e^epsilon overflows",
                        construct="partition_selection",
                        hint="raise epsilon, or SET partition_selection = 'threshold'",
                    ) from None
                continue
            error = _output_error(query, specs, output_specs, R, shares)
            candidates.append((n_half, error, specs, output_specs, shares, sel))
    # fewer lost groups first, then the released values' error, then the optimal (steeper) one
    n_half, _, specs, output_specs, shares, chosen = min(
        candidates, key=lambda c: (c[0], c[1], c[5] is None)
    )
    compared = tuple(("threshold" if c[5] is None else "optimal", c[0]) for c in candidates)
    selection = Selection(
        mode="threshold" if chosen is None else "optimal",
        requested=requested,
        mechanism=chosen,
        epsilon=chosen.epsilon if chosen is not None else 0.0,
        delta=threshold_delta,
        n_half=compared,
    )
    return specs, output_specs, shares, selection


def _output_error(
    query: DPQuery,
    specs: list[tuple[str, str | None]],
    output_specs: list[tuple[AggregateCall, list[tuple[str, str | None]]]],
    R: int,
    shares: list[float],
) -> float:
    """Σ_i C_i / ε_i² of the released values only (the split's objective without the
    selection's weight): breaks a tie in n½ between the two selections."""
    weights = _split_weights(query, specs, output_specs, R, False)
    return sum(c / e / e if e > 0 else math.inf for c, e in zip(weights, shares, strict=True) if c)


def _bias_measures(
    query: DPQuery,
    specs: list[tuple[str, str | None]],
    epsilon: float,
    first: int,
    R: int,
    G: int,
    bounding: str,
    group_scaling: bool,
) -> list[Measure]:
    """The bias measures (dpsql.plan.bias: what each estimates, and its bound per unit), named
    from m{first} on, each Laplace at an equal part of ``epsilon`` (pure ε whatever the plan's
    mechanism: no part of δ). Sensitivity: a unit adds at most ``per_group`` to each of its
    <= G kept groups (under group scaling its k groups at G/k each: the same L1 and L2)."""
    out: list[Measure] = []
    shares = bias.parts(epsilon, len(specs)) if specs else []
    for i, (kind, column) in enumerate(specs):
        lo = hi = 0
        g = 1.0
        if column is not None:
            col = query.table.columns[column]
            g = col.granularity
            lo, hi = fixed_point_bounds(col.lower, col.upper, g)  # type: ignore[arg-type]
            lo, hi = bias.measure_range(kind, lo, hi)
        row_bound = bias.row_bound(kind, lo, hi, R)
        scale = 1
        # the fine grid where a value is scaled (R/n, G/k) or divided (cut: v·d/n), so that
        # the truncation toward zero loses < 2^-20 of a row per pair
        if MEASURE_KINDS[kind].fine_grid(bounding, group_scaling):
            scale = rescale_factor(row_bound)
        per_group = (row_bound if MEASURE_KINDS[kind].per_pair else R * row_bound) * scale
        l1, l2 = float(G * per_group), math.sqrt(G) * per_group
        eps = shares[i]
        out.append(
            Measure(
                name=f"m{first + i}",
                kind=kind,
                column=column,
                granularity=g,
                center=0,
                lo=lo,
                hi=hi,
                center2=0,
                row_bound=row_bound,
                per_group_bound=per_group,
                l1=l1,
                l2=l2,
                epsilon=eps,
                delta=0.0,
                mechanism=Laplace(l1=l1, epsilon=eps),
                scale=scale,
            )
        )
    return out


@functools.lru_cache(maxsize=4096)
def _drawable(mechanism: Mechanism | Unreleased) -> bool:
    """Whether the exact sampler can draw this noise and its interval be found (what the
    service's free pre-run check asks of every measure). A function of the mechanism's own
    numbers (frozen, compared by value; a draw of size 0 reads no random byte), so it is
    remembered per mechanism like its interval search (mechanisms._cached_search): building
    a sampler and an empty draw for each bias measure was ~2.5% of planning a new shape."""
    try:
        mechanism.sample(SecureNoise(), 0)
        mechanism.interval_halfwidth()
    except (ValueError, OverflowError):
        return False
    return True


def _bias_to_total(
    measures: list[Measure], cost: Cost, epsilon: float
) -> tuple[list[Measure], Cost]:
    """The last bias measure's ε adjusted by what the float shares miss or exceed of the
    query's ε as the ledger reads it (dpsql.privacy.accounting.exact): the charge is then ε
    exactly where that share reads back exactly, else the nearest float below (never more
    than ε: a query at the budget's edge is not refused for a rounding)."""
    gap = exact(epsilon) - cost.exact_epsilon
    if gap == 0:
        return measures, cost
    i = max(j for j, m in enumerate(measures) if m.measure_kind.bias)
    m = measures[i]
    target = exact(m.epsilon) + gap
    if target <= 0:
        return measures, cost
    e = float(target)
    while exact(e) > target:
        e = math.nextafter(e, 0.0)
    mech = Laplace(l1=m.l1, epsilon=e)
    out = [*measures[:i], replace(m, epsilon=e, mechanism=mech), *measures[i + 1 :]]
    return out, cost + Cost(epsilon=exact(e) - exact(m.epsilon))


def _exact_units(name: str, G: int) -> Measure:
    """The exact unit count an optimal selection reads (one per (unit, group), G groups)."""
    l1, l2 = float(G), math.sqrt(G)
    return Measure(
        name=name,
        kind="units",
        column=None,
        granularity=1.0,
        center=0,
        lo=0,
        hi=0,
        center2=0,
        row_bound=1,
        per_group_bound=1,
        l1=l1,
        l2=l2,
        epsilon=0.0,
        delta=0.0,
        mechanism=Unreleased(l1=l1, l2=l2),
    )
