"""The sensitivity-annotated plan: what the engine computes and how each value is noised.

A plan is a frozen value. Every *measure* (an exact integer aggregate the engine returns) carries
its per-row range in fixed-point units, the per-unit bound after contribution bounding, its L1 and
L2 sensitivity, its mechanism (scale, cost) and its share of the query's ε/δ. Output aggregates
(COUNT, SUM, AVG, VAR, STDDEV) are post-processing of measures.

Neighbouring relation: add or remove one privacy unit with all of its rows. After bounding, a
unit keeps at most R = max_rows_per_unit rows in each of at most G = max_groups_per_unit groups
(G = 1 without GROUP BY; G = min(G, number of public bins) for a public domain).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import cast

from dpsql.aggregates import KINDS
from dpsql.errors import NotSupportedError, PrivacyError
from dpsql.privacy.accounting import Cost
from dpsql.privacy.clipping import ApproxBounds, LogHistogram
from dpsql.privacy.mechanisms import Gaussian, Laplace, Mechanism
from dpsql.privacy.quantiles import Grid
from dpsql.sql.bind import QUANTILE_KINDS, AggregateCall, BoundQuery, GroupKey

# Measure kinds and the value one row contributes (before summing):
#   rows   - 1 for every row                       (COUNT(*))
#   values - 1 if the column is not NULL           (COUNT(col), denominators)
#   units  - 1 per (unit, group)                   (COUNT(DISTINCT unit), thresholding)
#   distinct - distinct non-NULL values of a column over the bounded rows (COUNT(DISTINCT col)):
#            a unit's <= R rows in a group add at most R values to it, so its bound is R
#   sum    - round(clamp(x)/g) - center, 0 if NULL (SUM, AVG, VAR)
#   sumsq  - (round(clamp(x)/g) - center)^2 - center2, 0 if NULL (VAR, STDDEV)
MEASURE_KINDS = ("rows", "values", "units", "distinct", "sum", "sumsq")


@dataclass(frozen=True)
class Measure:
    name: str
    kind: str
    column: str | None
    granularity: float  # released value = integer * granularity (g for sum, g² for sumsq)
    center: int  # integer subtracted from each row value (fixed-point units)
    lo: int  # per-row integer range (before centring) after clamping and rounding
    hi: int
    center2: int  # sumsq only: subtracted from each squared centred value
    row_bound: int  # max |per-row contribution| after centring
    per_group_bound: int  # max |contribution| of one unit to one group: R * row_bound
    l1: float  # per-unit L1 sensitivity across all groups
    l2: float  # per-unit L2 sensitivity across all groups
    epsilon: float  # share of the query's ε
    delta: float  # share of the query's δ (Gaussian only)
    mechanism: Mechanism


QuantileTarget = tuple[str, float | None]  # ("min", None), ("quantile", q), ("max", None)


@dataclass(frozen=True)
class QuantileMeasure:
    """The quantiles of one bounded column, per group: the engine counts the values in each
    bin of a public grid after bounding (<= R values per unit per group, <= G groups per unit);
    each group's targets are released from those counts by the exponential mechanism
    (dpsql.privacy.quantiles): MIN and MAX one EM each, the levels in (0, 1) one joint release
    by recursive splitting. Each such part is ``part_epsilon``-DP in one group for R values
    per unit (its utility sensitivity is R·max(q, 1 − q)); a unit reaches <= G groups, so the
    measure costs parts · G · part_epsilon (basic composition, pure ε)."""

    name: str
    column: str
    grid: Grid
    targets: tuple[QuantileTarget, ...]  # MIN first, levels ascending, MAX last
    max_values: int  # R
    groups: int  # G
    part_epsilon: float
    epsilon: float  # the share of the query's ε it was given (>= its cost)
    method: str = "em"  # "em", "pf" (permute-and-flip) or "smooth" (MEDIAN alone)

    @property
    def parts(self) -> tuple[tuple[QuantileTarget, ...], ...]:
        """The releases per group: MIN alone, the levels in (0, 1) jointly, MAX alone."""
        inner = tuple(t for t in self.targets if t[0] == "quantile")
        out = [tuple(t for t in self.targets if t[0] == "min")]
        out += [inner, tuple(t for t in self.targets if t[0] == "max")]
        return tuple(p for p in out if p)

    @property
    def cost(self) -> Cost:
        """ε = n·e for its n = parts·G releases of e each; in zCDP each is e²/2, so n·e²/2
        (zCDP composes by addition: less than (n·e)²/2 under the zCDP filter)."""
        n = len(self.parts) * self.groups
        e = Fraction(self.part_epsilon)
        return Cost(epsilon=e * n, zrho=n * e * e / 2)


@dataclass(frozen=True)
class ClipEstimate:
    """Automatic clipping of one column (policy ``clip = "auto"``): before the sums run, the
    engine counts |x| in public log bins over the query's bounded rows (every group: a unit
    has <= R·G values), Laplace noise of scale R·G/ε_b per bin makes the histogram ε_b-DP
    (each value is in one bin), and the range [lo, hi] inside the declared bounds is chosen
    from it by post-processing (ApproxBounds, method "sum": the bound minimising the estimated
    bias + noise of a SUM at ``sum_epsilon``). The plan's sums then run with that range as
    the column's bounds: their sensitivity is the released range's, a public value."""

    column: str
    histogram: LogHistogram
    epsilon: float  # ε_b
    max_values: int  # R·G
    sum_epsilon: float
    method: str = "sum"
    q: float = 0.99  # method "quantile"

    @property
    def mechanism(self) -> ApproxBounds:
        return ApproxBounds(
            self.histogram,
            self.epsilon,
            max_values=self.max_values,
            method=self.method,
            q=self.q,
            sum_epsilon=self.sum_epsilon,
        )

    @property
    def cost(self) -> Cost:
        return self.mechanism.cost


def quantile_target_order(target: QuantileTarget) -> tuple[float, float]:
    kind, q = target
    return (0.0, 0.0) if kind == "min" else (2.0, 0.0) if kind == "max" else (1.0, float(q or 0.0))


def quantile_grid(col) -> Grid:  # type: ignore[no-untyped-def]
    """The column's public grid: unit bins for a small integer range, else its declared
    ``quantile_bins`` bins (linear or log)."""
    lower, upper = float(col.lower), float(col.upper)
    integer = col.type == "int"
    if not integer and not upper > lower:
        raise NotSupportedError(
            f"{col.name}: its declared range is a single value; its quantiles are that value",
            construct=col.name,
            hint=f"declare a wider range for {col.name}, or select the constant",
        )
    return Grid.for_column(
        lower, upper, integer=integer, bins=col.quantile_bins, scale=col.quantile_grid
    )


def _part_epsilon(share: float, parts: int, groups: int) -> float:
    """The largest float e with parts · groups · e <= share, exactly."""
    e = share / (parts * groups)
    while Fraction(e) * parts * groups > Fraction(share):
        e = math.nextafter(e, 0.0)
    return e


@dataclass(frozen=True)
class OutputAggregate:
    """An aggregate the analyst asked for, as a formula over measures."""

    call: AggregateCall
    measures: tuple[str, ...]  # names of measures it reads, in formula order
    lower: float | None = None  # clamp range of the released value (AVG) or None
    upper: float | None = None


@dataclass(frozen=True)
class KeyPlan:
    key: GroupKey
    domain: tuple | None  # the public domain, or None when released by thresholding


@dataclass(frozen=True)
class Threshold:
    measure: str  # the units measure it reads
    tau: float
    delta: float


@dataclass(frozen=True)
class Plan:
    query: BoundQuery
    keys: tuple[KeyPlan, ...]
    measures: tuple[Measure, ...]
    outputs: tuple[OutputAggregate, ...]
    threshold: Threshold | None
    epsilon: float
    delta: float
    mechanism: str
    max_rows: int  # R
    max_groups: int  # G (effective)
    cost: Cost
    data_version: str = ""
    quantiles: tuple[QuantileMeasure, ...] = ()
    clips: tuple[ClipEstimate, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def measure(self, name: str) -> Measure:
        return next(m for m in self.measures if m.name == name)

    def quantile_of(self, output: OutputAggregate) -> QuantileMeasure:
        return next(q for q in self.quantiles if q.column == output.call.column)

    @property
    def bounded_by_unit(self) -> bool:
        return self.query.table.privacy_unit is not None

    def fingerprint(self) -> str:
        """Hash of everything that determines the released distribution (not post-processing)."""
        q = self.query
        parts = [
            q.table.name,
            "|".join(f"{c.name}={c.expr}" for c in q.table.columns.values() if c.expr),
            q.where.sql(dialect="duckdb") if q.where is not None else "",
            "|".join(k.key.sql + repr(k.domain) for k in self.keys),
            "|".join(
                f"{m.name}:{m.kind}:{m.column}:{m.granularity!r}:{m.center}:{m.center2}:"
                f"{m.lo}:{m.hi}:{m.mechanism!r}"
                for m in self.measures
            ),
            # the cached answer stores one array per output, so outputs are part of the key
            "|".join(f"{o.call.label}:{','.join(o.measures)}" for o in self.outputs),
            repr(self.threshold),
            repr(self.quantiles),
            repr(self.clips),
            f"{self.max_rows}:{self.max_groups}:{self.mechanism}:{self.epsilon!r}:{self.delta!r}",
            self.data_version,
        ]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def fixed_point_bounds(lower: float, upper: float, g: float) -> tuple[int, int]:
    """The integer range [lo, hi] of one row's fixed-point value, as the sensitivity assumes.

    Each bound goes to its nearest multiple of ``g``, a tie toward the inside of [lower, upper]
    (the smaller range), computed exactly on the decimal values the policy states (no float
    quotient: 0.35 / 0.1 is a tie, not 3.4999...). The engine clamps ``x / g`` to these very
    integers before rounding it (:func:`dpsql.sql.compile.fixed_point_value`), so its own tie
    rule (DuckDB and Spark round half away from zero) cannot leave [lo, hi]; and a row's value
    stays within g/2 of its clamped x whether or not the bounds are multiples of ``g``.
    """
    a, b = Fraction(repr(lower)) / Fraction(repr(g)), Fraction(repr(upper)) / Fraction(repr(g))
    lo, hi = math.floor(a + Fraction(1, 2)), math.ceil(b - Fraction(1, 2))
    # lo > hi only when lower == upper sits on a tie: either neighbour is as near
    return min(lo, hi), hi


def _measure_specs(
    query: BoundQuery, thresholded: bool
) -> tuple[list[tuple[str, str | None]], list[tuple[AggregateCall, list[tuple[str, str | None]]]]]:
    """The (kind, column) measures the query needs, and each output's measures in order."""
    needed: list[tuple[str, str | None]] = []

    def need(kind: str, column: str | None) -> tuple[str, str | None]:
        spec = (kind, column)
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
    query: BoundQuery,
    domains: Sequence[tuple | None],
    *,
    epsilon: float,
    delta: float,
    mechanism: str,
    data_version: str = "",
    quantile_method: str = "em",
) -> Plan:
    """Annotate a bound query with bounds, sensitivities, mechanisms and the budget split."""
    table = query.table
    thresholded = any(d is None for d in domains)
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
    R = table.max_rows_per_unit
    # A row-level table's unit is one row, which lies in exactly one group.
    G = table.max_groups_per_unit if (query.keys and table.privacy_unit) else 1
    if query.keys and not thresholded:
        bins = math.prod(len(d) for d in domains if d is not None)
        G = min(G, bins)

    specs, output_specs = _measure_specs(query, thresholded)
    quantile_targets: dict[str, set[QuantileTarget]] = {}
    for call in query.aggregates:
        if call.kind in QUANTILE_KINDS:
            target = KINDS[call.kind].target(call)  # type: ignore[attr-defined]
            quantile_targets.setdefault(call.column, set()).add(target)  # type: ignore[arg-type]
    # k = 0: only public keys are asked for (SELECT grp ... GROUP BY grp): nothing to noise.
    k = max(len(specs) + len(quantile_targets), 1)
    auto: list[str] = list(
        dict.fromkeys(
            c
            for kind, c in specs
            if c is not None and kind in ("sum", "sumsq") and table.columns[c].clip == "auto"
        )
    )
    clip_epsilon = 0.0
    if auto:
        # the largest share any of them asks for, split equally between them
        clip_epsilon = epsilon * max(table.columns[c].clip_share for c in auto)
        epsilon_main = epsilon - clip_epsilon
    else:
        epsilon_main = epsilon
    measure_delta = 0.0
    threshold_delta = 0.0
    if thresholded:
        threshold_delta = delta if mechanism == "laplace" else delta / 2
    if mechanism == "gaussian" and specs:
        measure_delta = (delta - threshold_delta) / len(specs)
    eps_share = epsilon_main / k

    # Centre sums on the midpoint when a count of the same column is released anyway.
    counted = {c for kind, c in specs if kind == "values"}
    measures: list[Measure] = []
    names: dict[tuple[str, str | None], str] = {}
    for i, (kind, column) in enumerate(specs):
        name = f"m{i}"
        names[(kind, column)] = name
        g = 1.0
        lo = hi = center = center2 = 0
        if kind in ("rows", "values", "units", "distinct"):
            row_bound = 1
        else:
            col = table.columns[column]  # type: ignore[index]
            g = col.granularity
            lo, hi = fixed_point_bounds(col.lower, col.upper, g)  # type: ignore[arg-type]
            if column in counted:
                center = (lo + hi) // 2
            row_bound = max(abs(lo - center), abs(hi - center))
            # The engine computes per-row values (and their squares) in 64-bit integers: an
            # overflow would fail the query only when some row is extreme, a data-dependent
            # error. Refuse such plans up front instead.
            limit = 3_037_000_499 if kind == "sumsq" else 2**62  # isqrt(2**63 - 1)
            if max(abs(lo), abs(hi), row_bound) > limit:
                raise NotSupportedError(
                    f"{column}: its fixed-point range (bounds / granularity) is too large for "
                    "64-bit " + ("sums of squares (VAR, STDDEV)" if kind == "sumsq" else "sums"),
                    construct=column,
                    hint=f"declare a coarser granularity or narrower bounds for {column}",
                )
            if kind == "sumsq":
                span = row_bound * row_bound  # squared centred values lie in [0, span]
                center2 = span // 2
                row_bound = max(center2, span - center2)
                g = g * g
        per_group = row_bound if kind == "units" else R * row_bound
        l1 = float(G * per_group)
        l2 = math.sqrt(G) * per_group
        if mechanism == "laplace":
            mech: Mechanism = Laplace(l1=l1, epsilon=eps_share)
        else:
            mech = Gaussian(l2=l2, epsilon=eps_share, delta=measure_delta)
        measures.append(
            Measure(
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
                delta=measure_delta,
                mechanism=mech,
            )
        )

    outputs = []
    for call, parts in output_specs:
        output_col = table.columns[call.column] if call.column else None
        lower, upper = KINDS[call.kind].output_bounds(output_col)
        outputs.append(
            OutputAggregate(call, tuple(names[p] for p in parts), lower=lower, upper=upper)
        )

    threshold = None
    if thresholded:
        units = measures[specs.index(("units", None))]
        tau = units.mechanism.threshold(threshold_delta, G)
        threshold = Threshold(measure=units.name, tau=tau, delta=threshold_delta)

    quantiles = []
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
                part_epsilon=_part_epsilon(eps_share, n_parts, G),
                epsilon=eps_share,
                method=quantile_method,
            )
        )

    clips = []
    for column in auto:
        col = table.columns[column]
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
                sum_epsilon=eps_share,
                method=col.clip_method,
                q=col.clip_quantile,
            )
        )

    cost = Cost(delta=threshold_delta)
    for m in measures:
        cost = cost + m.mechanism.cost
    for qm in quantiles:
        cost = cost + qm.cost
    for clip in clips:
        cost = cost + clip.cost
    plan = Plan(
        query=query,
        keys=tuple(KeyPlan(key, d) for key, d in zip(query.keys, domains, strict=True)),
        measures=tuple(measures),
        outputs=tuple(outputs),
        threshold=threshold,
        epsilon=epsilon,
        delta=delta if (thresholded or mechanism == "gaussian") else 0.0,
        mechanism=mechanism,
        max_rows=R,
        max_groups=G,
        cost=cost,
        data_version=data_version,
        quantiles=tuple(quantiles),
        clips=tuple(clips),
        extra={"measured_epsilon": epsilon_main},
    )
    from dpsql.ir.check import check_plan

    check_plan(plan)  # charged cost == the sum of the plan tree's privacy maps
    return plan


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
    query = dataclasses.replace(plan.query, table=dataclasses.replace(table, columns=columns))
    return build_plan(
        query,
        [kp.domain for kp in plan.keys],
        epsilon=plan.extra["measured_epsilon"],
        delta=plan.delta,
        mechanism=plan.mechanism,
        data_version=plan.data_version,
        quantile_method=plan.quantiles[0].method if plan.quantiles else "em",
    )
