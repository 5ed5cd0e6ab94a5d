"""The values a plan is made of: what the engine computes and how each value is noised.

The plan itself is its annotated tree (dpsql.plan.annotated.Plan); these are the frozen
records its nodes hold. Every *measure* (an exact integer aggregate the engine returns) carries
its per-row range in fixed-point units, the per-unit bound after contribution bounding, its L1 and
L2 sensitivity, its mechanism (scale, cost) and its share of the query's ε/δ. Output aggregates
(COUNT, SUM, AVG, VAR, STDDEV) are post-processing of measures.

Neighbouring relation: add or remove one privacy unit with all of its rows. After bounding, a
unit keeps at most R = max_rows_per_unit rows in each of at most G = max_groups_per_unit groups
(G = 1 without GROUP BY; G = min(G, number of public bins) for a public domain).

How a unit's pair over R is brought down to R rows (the table's ``bounding``):

- ``sample``: the R rows of smallest keyed hash are kept (the secret is fresh per query);
- ``scale``:  all its rows are kept, their partial sums multiplied by R/n (n = the pair's rows
              after the WHERE), truncated toward zero on a finer grid of ``scale`` units per
              integer (:func:`rescale_factor`). A pair's |contribution| is then
              <= (R/n)·n·row_bound = R·row_bound, the bound sampling gives, so every
              sensitivity below holds unchanged (in fine units: times ``scale``). Its
              expectation equals sampling's (E[a uniform R-of-n sample's sum] = R/n of the
              pair's sum) with no sampling variance.

              Groups beyond G: with public keys (every bin released, no threshold) a unit in
              k > G groups keeps all of them, each pair's scaled partial times G/k (again
              truncated toward zero; row and unit counts then in a fine grid too, and every
              count rounded per unit back to integers: ROUNDED_KINDS): per group
              <= R·row_bound·G/k, over its k groups L1 <= G·R·row_bound and
              L2 <= sqrt(k)·R·row_bound·G/k <= sqrt(G)·R·row_bound — the bounds of keeping G
              groups. With thresholded keys a group's presence is released, so G groups are
              kept by keyed hash of (unit, key), as with sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpsql.errors import NotSupportedError
from dpsql.frontend.statements import AggregateCall, GroupKey
from dpsql.plan.measure_kinds import MEASURE_KINDS, MeasureKind
from dpsql.policy import ColumnPolicy
from dpsql.privacy.accounting import Cost
from dpsql.privacy.clipping import ApproxBounds, LogHistogram
from dpsql.privacy.defaults import quantile_grid as default_quantile_grid
from dpsql.privacy.mechanisms import Mechanism
from dpsql.privacy.partition import OptimalSelection, Unreleased
from dpsql.privacy.quantiles import Grid, exponential_map

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
DISTINCT_KINDS = tuple(name for name, kind in MEASURE_KINDS.items() if kind.distinct)


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
    # engine units per released unit: 1, or the fine grid of a rescaled bounding (the engine
    # returns the measure times ``scale``; l1, l2, per_group_bound and the mechanism are in
    # those fine units, the release divides the noisy integer by ``scale``)
    scale: int = 1
    # counts (rows, values, units) of a rescaled plan: the engine computes each pair's share
    # on this fine grid (units per row), then rounds each unit's shares to integers by
    # systematic rounding (:data:`ROUNDED_KINDS`), so the measure is an integer count
    # (``scale`` 1) with the sensitivities of sampling; 1: no rounding step
    fine: int = 1

    @property
    def measure_kind(self) -> MeasureKind:
        """Its kind's object: what differs between kinds is asked of it
        (dpsql.plan.measure_kinds), not switched on ``kind``."""
        return MEASURE_KINDS[self.kind]

    @property
    def pair_scale(self) -> int:
        """The grid of this measure's per-pair partials in the engine: ``fine`` before the
        per-unit rounding, else ``scale``."""
        return self.fine if self.fine > 1 else self.scale

    @property
    def unit(self) -> float:
        """The released value of one engine unit: noise, sensitivities and intervals in
        engine units times this are in the answer's units."""
        return self.granularity / self.scale


# SUMMED_KINDS: aggregates that sum a column's values (automatic clipping applies to them),
# declared by each kind's object (dpsql.aggregates), as QUANTILE_KINDS are
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

    kind = "quantile"  # the histogram kind (dpsql.aggregates: AggregateKind.histogram)

    @property
    def bins(self) -> int:
        return self.grid.bins

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
        return exponential_map(self.part_epsilon, len(self.parts) * self.groups)


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


def quantile_grid(col: ColumnPolicy) -> Grid:
    """The column's public grid: unit bins for a small integer range, else its declared
    ``quantile_bins`` bins (linear, log, or "auto": chosen from the declared range)."""
    lower, upper = float(col.lower), float(col.upper)  # type: ignore[arg-type]
    integer = col.type == "int"
    if not integer and not upper > lower:
        raise NotSupportedError(
            f"{col.name}: its declared range is a single value; its quantiles are that value",
            construct=col.name,
            hint=f"declare a wider range for {col.name}, or select the constant",
        )
    # the policy's grid, or the default for its declared range (dpsql.privacy.defaults)
    return default_quantile_grid(
        lower, upper, integer=integer, scale=col.quantile_grid, bins=col.quantile_bins
    )


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
    # a key whose noisy count is τ − 1 is kept with this probability, so the threshold spends
    # all of ``delta`` (dpsql.privacy.mechanisms.threshold_below)
    below: float = 0.0

    def privacy_map(self) -> Cost:
        """Thresholding costs the δ it is calibrated to (its noisy count is a measurement of
        its own, charged there)."""
        return Cost(delta=self.delta)

    def describe(self) -> str:
        return (
            f"Threshold: release a group when noisy {self.measure} >= {self.tau:g} "
            f"(delta {self.delta:g})"
        )


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


# measure kinds summed from row values: the ones a rescaled bounding multiplies by R/n (a row
# count is min(n, R) exactly, a unit count is not bounded by R)
RESCALED_KINDS = tuple(
    name for name, kind in MEASURE_KINDS.items() if kind.row_scaled and not kind.bias
)
# the fine grid of a rescaled measure holds a row's largest value in >= 2^20 units: the
# truncation of a pair's R/n share loses < 1 unit, <= 2^-20 of a row, per pair
RESCALE_UNITS = 1 << 20


# Counts of a rescaled plan are rounded back to integers per unit (issue 31 item 3). A count's
# pair shares w_g >= 0 (rows: min(n, R)·F·min(k, G)/k; units: F·min(k, G)/k; COUNT(col):
# its non-NULL rows times F·min(n, R)/n, then times min(k, G)/k; each truncated toward zero,
# F = Measure.fine = 2^20) are integers on the fine grid. For unit u, its kept pairs in a
# fixed order (the group keys ascending, NULL last), A_g = Σ_{h <= g} w_h, and an offset
# U_u in [0, F) that is a function of u's id alone (:data:`ROUNDING_MULTIPLIER`):
#
#     c_g = floor((A_g + U_u) / F) - floor((A_g - w_g + U_u) / F)      (an integer >= 0)
#
# Proof that the sensitivities are those of sampling, for every U_u:
# (1) floor(x + y) - floor(x) <= ceil(y), so c_g <= ceil(w_g / F) <= R (w_g <= R·F; a unit
#     count: <= 1), the per-group bound;
# (2) the c_g telescope: Σ_g c_g = floor((A + U_u) / F) - floor(U_u / F) <= ceil(A / F) with
#     A = Σ_g w_g <= G·R·F (k pairs of <= R·F·min(k, G)/k; without group scaling <= G pairs
#     of <= R·F), so Σ_g c_g <= G·R: the L1 bound; with (1), Σ_g c_g² <= G·R², so L2 <= √G·R;
# (3) c_g depends on u's rows only (its pairs, their keys, its id), so adding or removing u
#     changes no other unit's c: the measure's sensitivities are G·R (L1), √G·R (L2), R per
#     group (units: G, √G, 1), as sampled, and the mechanism draws integer noise at them.
# A unit within R and G has every w_g a multiple of F, so c_g = w_g / F exactly whatever U_u:
# such units count as the sampled plan counts them. For a rescaled unit, over U_u uniform in
# [0, F) the expectation of c_g is w_g / F (the scaling's expectation, unbiased), and
# |c_g - w_g / F| < 1. U_u is public (privacy does not need it secret, as shown); it is mixed
# from the id so that the rounding errors of different units do not line up:
# U_u = ((u mod F) · ROUNDING_MULTIPLIER) mod F for an integer unit (an odd multiplier: a
# bijection of the residues, consecutive ids spread as a golden-ratio sequence), the hash
# of u (the engine's HASH / XXHASH64, no secret) mod F for any other unit type.
ROUNDED_KINDS = tuple(name for name, kind in MEASURE_KINDS.items() if kind.rounded)
ROUNDING_MULTIPLIER = 648_055  # odd, ~ 0.618 · 2^20


def rescale_factor(row_bound: int) -> int:
    """The fine grid (a power of two) of a rescaled measure whose rows are at most
    ``row_bound`` in magnitude: the smallest M with M·row_bound >= 2^20 (1 when the row range
    is already that fine), so a pair's scaled total M·R/n·v is exact to within one unit."""
    needed = -(-RESCALE_UNITS // max(row_bound, 1))  # ⌈2^20 / row_bound⌉: M >= it
    return 1 << (needed - 1).bit_length()  # the smallest power of two >= needed
