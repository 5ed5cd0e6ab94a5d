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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction

from dpsql.aggregates import KINDS
from dpsql.errors import NotSupportedError, PrivacyError
from dpsql.privacy.accounting import Cost
from dpsql.privacy.mechanisms import Gaussian, Laplace, Mechanism
from dpsql.privacy.partition import OptimalSelection, Unreleased
from dpsql.sql import sharing
from dpsql.sql.bind import AggregateCall, BoundQuery, GroupKey

# Measure kinds and the value one row contributes (before summing):
#   rows   - 1 for every row                       (COUNT(*))
#   values - 1 if the column is not NULL           (COUNT(col), denominators)
#   units  - 1 per (unit, group)                   (COUNT(DISTINCT unit), thresholding)
#   sum    - round(clamp(x)/g) - center, 0 if NULL (SUM, AVG, VAR)
#   sumsq  - (round(clamp(x)/g) - center)^2 - center2, 0 if NULL (VAR, STDDEV)
MEASURE_KINDS = ("rows", "values", "units", "sum", "sumsq")


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
    mechanism: Mechanism | Unreleased  # Unreleased: exact, read by the selection only
    count: str | None = None  # sum/sumsq centred: the count measure the centre multiplies


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
class Selection:
    """How the non-public keys are released, and why (EXPLAIN shows both).

    ``mode`` "optimal": the optimal partition selection (``mechanism``) reads the exact unit
    count ``measure`` (never released) and charges ``mechanism.cost``; "threshold": the noisy
    unit count of :class:`Threshold`, reused by the outputs that count units. ``n_half``: the
    unit count at which a key is kept with probability >= 1/2, for each candidate compared.
    """

    mode: str
    requested: str  # the partition_selection setting: auto | optimal | threshold
    measure: str | None = None
    mechanism: OptimalSelection | None = None
    epsilon: float = 0.0
    delta: float = 0.0
    n_half: tuple[tuple[str, int], ...] = ()


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
    selection: Selection | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def measure(self, name: str) -> Measure:
        return next(m for m in self.measures if m.name == name)

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
            f"{self.max_rows}:{self.max_groups}:{self.mechanism}:{self.epsilon!r}:{self.delta!r}",
            self.data_version,
        ]
        if self.selection is not None:
            parts.append(repr(self.selection))
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
    query: BoundQuery,
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
    query: BoundQuery,
    domains: Sequence[tuple | None],
    *,
    epsilon: float,
    delta: float,
    mechanism: str,
    data_version: str = "",
    partition_selection: str = "auto",
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

    threshold_delta = 0.0
    if thresholded:
        threshold_delta = delta if mechanism == "laplace" else delta / 2
    layout = _choose_layout(
        query, thresholded, partition_selection, epsilon, delta, threshold_delta, mechanism, R, G
    )
    specs, output_specs, eps_shares, selection = layout
    # k = 0: only public keys are asked for (SELECT grp ... GROUP BY grp): nothing to noise.
    k = max(len(specs), 1)
    measure_delta = 0.0
    if mechanism == "gaussian":
        measure_delta = (delta - threshold_delta) / k

    # Centre sums on the midpoint when a count of the same column is released anyway.
    count_of = _count_specs(query, specs, R)
    counted = set(count_of)
    measures: list[Measure] = []
    names: dict[tuple[str, str | None], str] = {spec: f"m{i}" for i, spec in enumerate(specs)}
    for i, (kind, column) in enumerate(specs):
        name = f"m{i}"
        names[(kind, column)] = name
        eps_share = eps_shares[i]
        g = 1.0
        lo = hi = center = center2 = 0
        if kind in ("rows", "values") or kind == "units":
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
                count=names[count_of[column]] if center and column in count_of else None,
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
    if selection is not None and selection.mode == "threshold":
        units = measures[specs.index(("units", None))]
        tau = units.mechanism.threshold(threshold_delta, G)  # type: ignore[union-attr]
        threshold = Threshold(measure=units.name, tau=tau, delta=threshold_delta)

    cost = Cost(delta=threshold_delta if threshold is not None else 0.0)
    for m in measures:
        cost = cost + m.mechanism.cost
    if selection is not None and selection.mechanism is not None:
        # the selection reads an exact unit count: one more measure, never noised or released
        exact = f"m{len(measures)}"
        measures.append(_exact_units(exact, G))
        cost = cost + selection.mechanism.cost
        selection = replace(selection, measure=exact)
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
        selection=selection,
    )
    from dpsql.ir.check import check_plan

    check_plan(plan)  # charged cost == the sum of the plan tree's privacy maps
    return plan


# -- shared measures, the ε split and partition selection (dpsql.sql.sharing) ------------------


def _count_specs(
    query: BoundQuery, specs: list[tuple[str, str | None]], R: int
) -> dict[str, tuple[str, str | None]]:
    """Per summed column, the measure counting its values, when the query measures it anyway
    (the sum is then centred on its range's midpoint and the count adds centre × it back)."""
    units = ("units", None) in specs
    out = {}
    for kind, column in specs:
        if kind == "sum" and column is not None:
            spec = sharing.count_spec(query.table, column, units, R)
            if spec in specs:
                out[column] = spec
    return out


def _sum_scale(query: BoundQuery, column: str, centred: bool) -> tuple[float, float, float]:
    """(h, c, M) of a column's fixed-point range: per-row bound after centring, the centre,
    the largest |value| (as the measure loop computes them)."""
    col = query.table.columns[column]
    lo, hi = fixed_point_bounds(col.lower, col.upper, col.granularity)  # type: ignore[arg-type]
    center = (lo + hi) // 2 if centred else 0
    h = max(abs(lo - center), abs(hi - center))
    return float(h), float(center), float(max(abs(lo), abs(hi), 1))


def _split_weights(
    query: BoundQuery,
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
        if call.kind == "sum" and call.column in count_of:
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


def _choose_layout(
    query: BoundQuery,
    thresholded: bool,
    requested: str,
    epsilon: float,
    delta: float,
    threshold_delta: float,
    mechanism: str,
    R: int,
    G: int,
) -> tuple[
    list[tuple[str, str | None]],
    list[tuple[AggregateCall, list[tuple[str, str | None]]]],
    list[float],
    Selection | None,
]:
    """The measures, each one's ε, and the partition selection (optimal or threshold,
    whichever keeps a key at the smaller unit count; see dpsql.sql.sharing)."""
    if requested not in sharing.SELECTION_MODES:
        raise PrivacyError(
            f"unknown partition_selection {requested!r}",
            construct="partition_selection",
            hint="SET partition_selection = 'auto', 'optimal' or 'threshold'",
        )
    units_measured = thresholded or any(c.kind == "count_units" for c in query.aggregates)

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
            n_half = sharing.half_keep(sharing.threshold_suppression(units, tau))
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
    query: BoundQuery,
    specs: list[tuple[str, str | None]],
    output_specs: list[tuple[AggregateCall, list[tuple[str, str | None]]]],
    R: int,
    shares: list[float],
) -> float:
    """Σ_i C_i / ε_i² of the released values only (the split's objective without the
    selection's weight): breaks a tie in n½ between the two selections."""
    weights = _split_weights(query, specs, output_specs, R, False)
    return sum(c / e / e if e > 0 else math.inf for c, e in zip(weights, shares, strict=True) if c)


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
