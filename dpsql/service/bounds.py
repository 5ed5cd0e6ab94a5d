"""``"auto"`` contribution bounds in the service: which noisy histograms a query needs, who
pays for them, and the query with the bounds chosen from them.

The design (docs/mechanisms.md "Contribution bounds chosen privately", docs/threat_model.md):

- A table declaring ``max_rows_per_unit = "auto"`` needs, per data version, one noisy
  histogram of rows per unit; ``max_groups_per_unit = "auto"`` one of distinct groups per unit
  for each GROUP BY key set (dpsql.privacy.contribution releases them, ε_c-DP each).
- The analyst's first query that needs a missing histogram pays for it: ``bounds_share`` of
  the query's ε (the statement never costs more than its ε), recorded in the ledger as a
  charge of its own ("choose contribution bounds of T at data version V"), the rest planned
  for the query's measures. The histogram is kept in that analyst's answer cache under the
  data version, so it is charged exactly once per analyst and data version; every later query
  chooses its R and G from it by post-processing, free, and spends its whole ε on its
  measures. A new data version needs (and pays for) a new histogram.
- Per analyst, never shared: each analyst's budget bounds what their answers reveal, and the
  chosen bounds are part of every answer, so an analyst who used another's histogram would
  learn something their ledger never paid for. (A dataset-wide cap sees each analyst's charge:
  conservative, never an under-count.) With the answer cache off (``Service(cache=False)``)
  nothing is kept: every query pays its share and chooses afresh.
- The statement that paid keeps its plan: replanned with the same text and ε it is planned at
  ε·(1 − share) again, so its cached answer is found (a re-run is free, as every re-run is).
- Planning is free and reads nothing: a query whose histogram is missing is planned with the
  cap (64) as placeholder bounds and a :class:`Pending` choice; the service pays, releases
  the histograms, and plans it again with the chosen bounds before anything else is read
  (dpsql.pipeline). EXPLAIN shows the placeholder and says the bounds are chosen at run time.

- One overhead share per query: the statement that pays for a histogram plans no bias measure
  (dpsql.plan.bias: ``TablePolicy.bias_by_histogram``); the histogram's estimate of what R
  cuts is its note. Later queries, choosing free, spend their bias share on the measures.
- An unstated bound of a table with a privacy unit is "auto" (dpsql.policy); where no
  choice is made (private joins, per-unit relations, estimators) it plans at 1, a declared
  "auto" at the cap (``TablePolicy.unchosen_bounds``).

Tables without a privacy unit plan with R = G = 1.

Default clamp ranges (kind ``"clip"``, issue 31 item 7), the same design for values: a SUM, AVG,
VAR or STDDEV of a stored number column whose policy states no ``clip`` (ColumnPolicy ``clip ==
"default"``) and declares bounds [L, U] is clamped to a range chosen from a DP histogram of |x|
over public log bins (dpsql.privacy.clipping.LogHistogram, the ApproxBounds histogram:
Laplace(R/ε) per bin, each unit's <= R values one count each, so ε-DP). It is bought once per
analyst, column and data version by the first such query (``bounds_share`` of its ε, its own
ledger entry), kept, and each query then chooses its range from it by post-processing, free
(:func:`clamp_range`: per group, the ``clip_quantile`` of |x|; a single total, the bound
minimising the expected squared bias + noise variance of a SUM at the query's per-measure ε,
the bins' true counts estimated from the noisy ones, "posterior"). The range is a function of
released DP output only, so the query is planned with it as
the column's declared bounds (a plan constant: the compiled store pass and the SQL fast paths
are unchanged; the engine clamps every row to it as to declared bounds; the sensitivities use it
as a public bound). Not chosen (declared bounds kept): a column the query also filters, groups
or measures otherwise (its grid, MIN/MAX, WHERE would change), computed columns and private
joins. Where R is itself "auto" the histogram counts one value per unit (:func:`clip_rows`:
sensitivity 1, bought in the same choice as R's histogram), each weighted by the mean rows a
unit keeps at the chosen R, and the query keeps its ``clamped`` bias measure; elsewhere a single
total's clamp bias is the kept histogram's estimate (no measure).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from sqlglot import exp

from dpsql.aggregates import KINDS
from dpsql.boundary import remember_paid
from dpsql.frontend.statements import DPQuery
from dpsql.plan.measure_kinds import MEASURE_KINDS
from dpsql.policy import ColumnPolicy
from dpsql.privacy.accounting import Cost
from dpsql.privacy.clipping import ApproxBounds, LogHistogram
from dpsql.privacy.contribution import (
    CANDIDATES,
    ROWS_PART,
    ContributionHistogram,
    choose,
    dropped_share,
    passing,
    representatives,
)

# This module sits below the planner and compiler (it imports neither: tests/test_layering.py):
# it reads the bound tree (dpsql.frontend.statements.DPQuery), the engine query of a
# histogram is built by the caller's ``histogram_query`` (dpsql.lower.compile.contribution_query).
#: ColumnPolicy.clip of a column whose policy states none (dpsql.policy)
CLIP_DEFAULT = "default"
#: ... and of that column in a query planned with the range chosen from its kept histogram
#: (dpsql.plan.bias.CLIP_CHOSEN, the same text: that leaf module imports nothing)
CLIP_CHOSEN = "chosen"
#: the clamp histogram's bin ratio (as dpsql.plan.values's ClipEstimate: 4 bins per doubling)
CLIP_RATIO = 2**0.25


@dataclass(frozen=True)
class Need:
    """One histogram a query chooses from: of rows per unit, or of groups per unit for the
    key set ``keys`` (the keys' SQL), at ``version``; ``cache_key`` is where it is kept."""

    kind: str  # "rows" | "groups" | "clip" (keys: the column, its histogram's identity)
    table: str
    version: str
    keys: tuple[str, ...] = ()

    @property
    def cache_key(self) -> str:
        keys = "|".join(self.keys)
        return f"bounds:{self.table}:{self.version}:{self.kind}:{keys}"

    @property
    def label(self) -> str:
        if self.kind == "rows":
            return f"rows per unit of {self.table}"
        if self.kind == "clip":
            return f"values of {self.table}.{self.keys[0]}"
        return f"groups per unit of {self.table} by {', '.join(self.keys)}"


@dataclass(frozen=True)
class Pending:
    """Histograms a query must buy before it runs: ``mechanisms[i]`` for ``needs[i]``."""

    needs: tuple[Need, ...]
    mechanisms: tuple[ContributionHistogram | ApproxBounds, ...]
    epsilon: float  # the query's ε given to the choice (ε − measured: share · ε)
    measured: float  # the ε left for the query's measures, ε · (1 − share)
    payer: tuple[str, float]  # (query text, ε) of the statement paying

    @property
    def cost(self) -> Cost:
        total = Cost()
        for m in self.mechanisms:
            total = total + m.cost
        return total

    def describe(self) -> str:
        what = (
            "clamp ranges" if all(n.kind == "clip" for n in self.needs) else "contribution bounds"
        )
        return (
            f"choose {what}: {'; '.join(n.label for n in self.needs)} at data "
            f"version {self.needs[0].version}"
        )


@dataclass(frozen=True)
class Chosen:
    """What EXPLAIN and the answer's notes say about the bounds a query was planned with."""

    rows: int | None
    groups: int | None
    dropped_rows: float | None  # the estimated share of rows R cuts
    dropped_pairs: float | None  # ... of (unit, group) pairs G cuts
    pending: Pending | None = None
    epsilon_measures: float = 0.0
    paid: bool = False  # this statement bought the histogram (no bias measure of its own)
    # (column, lower, upper, estimated SUM bias, estimated share of values beyond): the clamp
    # range chosen from the kept histogram of the column's values, and that histogram's
    # estimate of what it cuts over the whole table
    clamps: tuple[tuple[str, float, float, float, float], ...] = ()
    # the columns whose clamp the run chooses per group (dpsql.service.group_clamps): each
    # AVG's count released first, each group's clamp chosen from it and the kept histogram
    per_group: tuple[PerGroupClamp, ...] = ()

    def notes(self) -> list[str]:
        if self.pending is not None:
            what = (
                "clamp ranges"
                if all(n.kind == "clip" for n in self.pending.needs)
                else "contribution bounds"
            )
            return [
                f"{what} chosen at run time from a DP histogram (ε "
                f"{self.pending.epsilon:.3g} of this query's, charged once per data version)"
            ]
        out = [
            f"{column} clamped to [{lo:g}, {hi:g}], chosen privately from a kept DP histogram "
            + (
                "of its values (one per unit)"
                if math.isnan(bias)
                else f"of its values, which shows about {share:.1%} of them beyond it: over the "
                f"whole table a SUM is biased towards zero by about {bias:.3g} (at most that "
                "under a WHERE or in one group)"
            )
            + '; no clip stated, clip = "declared" keeps the declared bounds'
            for column, lo, hi, bias, share in self.clamps
            if column not in {p.column for p in self.per_group}
        ]
        out.extend(p.note() for p in self.per_group)
        if self.rows is not None:
            out.append(
                f"max_rows_per_unit = {self.rows} chosen privately (auto): the DP histogram "
                f"shows about {self.dropped_rows or 0:.1%} of the rows beyond it (a thin tail "
                "of heavier units may not show)"
            )
        if self.groups is not None:
            out.append(
                f"max_groups_per_unit = {self.groups} chosen privately (auto): the DP "
                f"histogram shows about {self.dropped_pairs or 0:.1%} of the (unit, group) "
                "pairs beyond it"
            )
        if self.paid:
            out.append(
                "bias: this query's overhead share bought the contribution histogram, so the "
                "estimate above stands for its own bias measures (the clamps' cut is not "
                "estimated here; a later query on this data version measures both)"
            )
        return out


@dataclass(frozen=True)
class PerGroupClamp:
    """A column whose clamp a grouped AVG chooses per group at run time, and the kept DP
    histogram of its |x| it is chosen from (released values only: public to the analyst)."""

    column: str
    noisy: tuple[float, ...]  # the kept histogram's noisy bin counts (clamp_histogram bins)
    noise_scale: float  # their noise's scale (its R over the ε it was bought with)
    weight: float  # the rows each count stands for (a histogram of units, R "auto")
    declared: tuple[float, float]  # the column's declared bounds: the histogram's bins

    def note(self) -> str:
        return (
            f"{self.column}: its clamp is chosen per group at run time (each AVG's count is "
            "released first; a group's clamp minimises the expected squared bias plus noise of "
            "a group of that size, from a kept DP histogram of its values); no clip stated, "
            'clip = "declared" keeps the declared bounds'
        )


def per_group_columns(query: DPQuery, columns: tuple[str, ...]) -> tuple[str, ...]:
    """Of the default-clamped ``columns``, those whose clamp is chosen per group: the query
    has GROUP BY keys, the column's ``clip_method`` is "auto", and only AVG reads it (each
    AVG releases the count its group's clamp is chosen from). Decided from policy and text;
    whether every key is public (no thresholding) is the plan's, checked at the run."""
    if not query.keys:
        return ()
    out = []
    for column in columns:
        calls = [c for c in query.aggregates if c.column == column]
        col = query.table.columns[column]
        per_group = all(KINDS[c.kind].group_clamp for c in calls)  # AVG's (its object's)
        if calls and per_group and col.clip_method == "auto":
            out.append(column)
    return tuple(out)


def clamp_columns(query: DPQuery) -> tuple[str, ...]:
    """The columns whose clamp range ``query`` chooses from a kept histogram (module doc):
    summed by SUM/AVG/VAR/STDDEV, no clip stated, stored, a number with bounds wider than its
    resolution, and used by nothing else in the query. Decided from policy and text: public."""
    table = query.table
    if table.joined is not None or table.public:
        return ()
    others: set[str] = set()
    if query.where is not None:
        others |= {c.name.lower() for c in query.where.find_all(exp.Column)}
    for key in query.keys:
        others |= {w.lower() for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", key.sql)}
    summed = []
    for call in query.aggregates:
        if call.column is None:
            continue
        if not call.summed:
            if KINDS[call.kind].reads_values:  # not COUNT(col): its kind's object says
                others.add(call.column)
            continue
        col = table.columns.get(call.column)
        if col is None or getattr(col, "clip", None) != CLIP_DEFAULT or col.expr is not None:
            continue
        if col.type not in ("int", "float") or col.lower is None or col.upper is None:
            continue
        if max(abs(col.lower), abs(col.upper)) <= col.granularity:
            continue  # nothing narrower to choose
        summed.append(call.column)
    return tuple(dict.fromkeys(c for c in summed if c not in others))


def _histogram_identity(table: Any, column: str) -> str:
    """What a kept clamp histogram was released under besides the data version: its bins (the
    column's declared bounds and resolution) and R. Part of its cache key, so a curator's edit
    of either buys a new one rather than reading counts on other bins."""
    col = table.columns[column]
    return f"[{col.lower!r}, {col.upper!r}] / {col.granularity!r}, R {clip_rows(table)}"


def clip_rows(table: Any) -> int:
    """The values per unit a clamp histogram counts: the table's R, or 1 where R is itself
    "auto" (not chosen yet when the histogram is bought, and its cap would be the histogram's
    sensitivity: one value per unit, chosen by keyed hash, keeps it at 1). Such a histogram
    counts units, not rows, so its estimate of a SUM's clamp bias is not given (the query
    keeps its ``clamped`` measure)."""
    return 1 if "rows" in table.auto_bounds else int(table.max_rows_per_unit)


def clamp_histogram(col: Any) -> LogHistogram:
    """The public log bins of |x| a column's clamp range is chosen on (declared bounds only)."""
    return LogHistogram.for_bounds(
        col.lower, col.upper, resolution=col.granularity, ratio=CLIP_RATIO
    )


def needs_of(query: DPQuery, version: str) -> tuple[Need, ...]:
    """The histograms ``query`` chooses its bounds from (none for a table without "auto" and
    no default clamp): contribution histograms first, then the columns' value histograms."""
    table = query.table
    clips = tuple(
        Need("clip", table.name, version, (c, _histogram_identity(table, c)))
        for c in clamp_columns(query)
    )
    if not table.auto_bounds or table.privacy_unit is None or table.joined is not None:
        return clips
    out = []
    if "groups" in table.auto_bounds and query.keys:
        out.append(Need("groups", table.name, version, tuple(k.sql for k in query.keys)))
    if "rows" in table.auto_bounds:
        out.append(Need("rows", table.name, version))
    return (*out, *clips)


def measure_count(query: DPQuery, *, sum_counts: bool = True) -> int:
    """How many noisy measures share the query's ε (as dpsql.plan.values splits it, roughly:
    COUNT one, SUM one per column, AVG a sum and the count, VAR/STDDEV a sum of squares too).
    ``sum_counts=False``: a SUM alone measures no count (the plan of a single total's SUM)."""
    parts: set[tuple[str, str | None]] = set()
    for call in query.aggregates:
        reads = KINDS[call.kind].measures(call.column)  # the measures its kind's object reads
        if not reads:  # released from a histogram measure of its own (quantiles, MODE)
            parts.add((call.kind, call.column))
        for name, column in reads:
            measure = MEASURE_KINDS[name]
            if measure.counted and not measure.distinct:  # rows, values, units: one count
                parts.add(("count", None))
            else:
                parts.add((name, column))
            if measure.centred and sum_counts:  # a centred sum measures a count
                parts.add(("count", None))
    return max(1, len(parts))


def _stored(entry: str) -> dict[str, Any] | None:
    try:
        data = json.loads(entry)
    except ValueError:
        return None
    return data if isinstance(data, dict) and "noisy" in data else None


def resolve(
    service: Any, query: DPQuery, epsilon: float, analyst: str | None
) -> tuple[DPQuery, float, Chosen | None]:
    """The query with its "auto" bounds chosen (or the cap as placeholders and a pending
    choice), and the ε its measures are planned with. Free: reads the analyst's cached
    histograms only."""
    version = service.data_version(query.table)
    needs = needs_of(query, version)
    if not needs:
        return query, epsilon, None
    table = query.table
    share = table.bounds_share
    found: dict[Need, dict[str, Any]] = {}
    if service.cache and analyst is not None:
        for need in needs:
            entry = service.ledger.cached(analyst, service.policy.dataset, need.cache_key)
            data = _stored(entry) if entry is not None else None
            if data is not None:
                found[need] = data
    missing = tuple(n for n in needs if n not in found)
    payer = (query.text, float(epsilon))
    measured = epsilon * (1 - share)
    if missing:
        choice_eps = epsilon - measured  # exact (share <= 1/2); the two add up to ε
        pending = Pending(
            missing,
            tuple(
                _mechanism(query, n, e)
                for n, e in zip(missing, _split(choice_eps, missing), strict=True)
            ),
            choice_eps,
            measured,
            payer,
        )
        return query, measured, Chosen(None, None, None, None, pending, measured)
    paid_here = any(tuple(d.get("payer", ())) == payer for d in found.values())
    measured = measured if paid_here else epsilon
    return _with_chosen(query, found, measured, paid=paid_here)


def _mechanism(query: DPQuery, need: Need, epsilon: float) -> ContributionHistogram | ApproxBounds:
    """The histogram release a need buys: a contribution histogram, or (kind "clip") the
    ApproxBounds histogram of the column's |x|, Laplace(R/ε) per bin."""
    if need.kind != "clip":
        return ContributionHistogram(epsilon)
    col = query.table.columns[need.keys[0]]
    return ApproxBounds(
        clamp_histogram(col),
        epsilon,
        max_values=clip_rows(query.table),
        method="quantile",
        q=col.clip_quantile,
    )


def _split(epsilon: float, needs: tuple[Need, ...]) -> list[float]:
    """How a choice's ε is split over the histograms it buys: the value histograms (kind
    "clip") equal parts of it, or of half of it next to contribution histograms; of those,
    rows ROWS_PART when it buys both. The parts add up to ``epsilon``."""
    clips = [n for n in needs if n.kind == "clip"]
    contribution = [n for n in needs if n.kind != "clip"]
    if not clips:
        return _split_contribution(epsilon, needs)
    if not contribution:
        return [epsilon / len(clips)] * len(clips)
    clip_eps = epsilon / 2
    parts = iter(_split_contribution(epsilon - clip_eps, tuple(contribution)))
    return [clip_eps / len(clips) if n.kind == "clip" else next(parts) for n in needs]


def _split_contribution(epsilon: float, needs: tuple[Need, ...]) -> list[float]:
    if len(needs) == 1:
        return [epsilon]
    rows = epsilon * ROWS_PART
    return [rows if n.kind == "rows" else epsilon - rows for n in needs]


def clamp_range(
    query: DPQuery,
    column: str,
    data: dict[str, Any],
    measured: float,
    rows: int,
    weight: float = 1.0,
) -> tuple[float, float, float, float]:
    """The clamp range of ``column`` for ``query``, chosen from the kept noisy histogram
    (post-processing, free), and that histogram's estimate of what it cuts over the whole
    table (the SUM's bias, the share of values beyond): per public group (small groups: noise
    dominates), the column's ``clip_quantile`` of |x|; a single total, the bound minimising
    the expected squared bias plus the noise variance of a SUM at the query's per-measure ε,
    the bins' true counts estimated from their noisy ones (ApproxBounds "posterior", at the
    histogram's own noise scale: its R over the ε it was bought with). ``weight``: the rows
    each count stands for (a histogram of units, R "auto"). ``clip_method`` other than "auto"
    fixes the rule. Inside the declared bounds; an int column's on integers."""
    col = query.table.columns[column]
    method = col.clip_method
    if method == "auto":
        # "posterior" needs the histogram's noise scale: the ε it was bought with, kept with it
        method = "quantile" if query.keys else "posterior" if "epsilon" in data else "mse"
    noisy = np.asarray(data["noisy"], dtype=np.float64)
    posterior = method == "posterior"
    chooser = ApproxBounds(
        clamp_histogram(col),
        1.0,  # unused: nothing is released here
        max_values=int(rows),  # the SUM's R (chosen, where "auto"): its noise is R·C/ε_s
        method=method,
        q=col.clip_quantile,
        sum_epsilon=measured / measure_count(query, sum_counts=False),
        noise_scale=clip_rows(query.table) / float(data["epsilon"]) if posterior else None,
        weight=weight if posterior else 1.0,
    )
    chosen = chooser.choose(noisy if posterior else noisy * weight, *declared_bounds(col))
    bias = chosen.bias()
    return (*declared_range(col, chosen.lower, chosen.upper), bias.sum_bias, bias.clipped_share)


def declared_bounds(col: ColumnPolicy) -> tuple[float, float]:
    """A clamped column's declared bounds: the planner asks for a clamp range only for a
    column it clamps, and it clamps only a column whose policy declares both bounds
    (dpsql.policy checks a clip's bounds at load), so a missing one is a planner bug."""
    lower, upper = col.lower, col.upper
    assert lower is not None and upper is not None, f"clamped column {col.name!r} has no bounds"
    return lower, upper


def declared_range(col: Any, lo: float, hi: float) -> tuple[float, float]:
    """A chosen clamp range as a column takes it: on integers for an int column (outwards),
    within its declared bounds."""
    if col.type == "int":
        lo, hi = math.floor(lo), math.ceil(hi)
    return float(max(lo, col.lower)), float(min(hi, col.upper))


def _with_chosen(
    query: DPQuery, found: dict[Need, dict[str, Any]], measured: float, paid: bool
) -> tuple[DPQuery, float, Chosen]:
    """Choose G first (its noise per unit: one group's), then R given G (post-processing).
    ``paid``: this statement bought a histogram; its overhead share went there, so no bias
    measure is planned for it (the histogram's estimate of what R cuts is its note)."""
    k = measure_count(query)
    table = query.table
    per_unit = clip_rows(table) == 1 and "rows" in table.auto_bounds  # units, not rows
    contribution_paid = paid and any(n.kind != "clip" for n in found)
    rows = table.max_rows_per_unit
    groups = table.max_groups_per_unit
    chosen_rows = chosen_groups = None
    dropped_rows = dropped_pairs = None
    by_kind = {n.kind: d for n, d in found.items() if n.kind != "clip"}
    if "groups" in by_kind:
        d = by_kind["groups"]
        noisy = np.asarray(d["noisy"], dtype=np.float64)
        groups = chosen_groups = choose(noisy, d["threshold"], k / measured)
        dropped_pairs = dropped_share(noisy, d["threshold"], groups)
    if "rows" in by_kind:
        d = by_kind["rows"]
        noisy = np.asarray(d["noisy"], dtype=np.float64)
        g = groups if query.keys else 1
        rows = chosen_rows = choose(noisy, d["threshold"], g * k / measured)
        dropped_rows = dropped_share(noisy, d["threshold"], rows)
    # the clamp ranges, given the chosen R (a SUM's noise grows with it); a histogram of one
    # value per unit weighs each by the rows a unit keeps (the rows histogram's mean, at R)
    weight = _rows_kept(by_kind["rows"], int(rows)) if per_unit and "rows" in by_kind else 1.0
    clamps = tuple(
        (n.keys[0], *clamp_range(query, n.keys[0], d, measured, int(rows), weight))
        for n, d in found.items()
        if n.kind == "clip"
    )
    if clamps:
        columns = dict(table.columns)
        for column, lo, hi, _, _ in clamps:
            col = columns[column]
            bound: Any = (lambda v: int(v)) if col.type == "int" else float
            # CLIP_CHOSEN: planned as declared bounds; the kept histogram estimates the bias
            # of a single total over it, so no bias measure is planned there (dpsql.plan.bias);
            # one counting units (R auto) does not: "declared", its bias measured as usual
            clip = "declared" if per_unit else CLIP_CHOSEN
            columns[column] = replace(col, lower=bound(lo), upper=bound(hi), clip=clip)
        table = replace(table, columns=columns)
        if per_unit:  # no bias estimate from a histogram of units (the note leaves it out)
            clamps = tuple((c, lo, hi, math.nan, math.nan) for c, lo, hi, _, _ in clamps)
    kept = {n.keys[0]: d for n, d in found.items() if n.kind == "clip" and "epsilon" in d}
    per_group = tuple(
        PerGroupClamp(
            column,
            tuple(float(v) for v in kept[column]["noisy"]),
            clip_rows(query.table) / float(kept[column]["epsilon"]),
            weight,
            declared_bounds(query.table.columns[column]),
        )
        for column in per_group_columns(query, tuple(kept))
    )
    # chosen: no longer "auto", so planning it again never asks for another choice
    bounded = replace(
        table,
        max_rows_per_unit=rows,
        max_groups_per_unit=groups,
        auto_bounds=(),
        bias_by_histogram=contribution_paid,
    )
    chosen = Chosen(
        chosen_rows,
        chosen_groups,
        dropped_rows,
        dropped_pairs,
        None,
        measured,
        contribution_paid,
        clamps,
        per_group,
    )
    return query.with_table(bounded), measured, chosen


def _rows_kept(d: dict[str, Any], rows: int) -> float:
    """The mean rows a unit keeps at R = ``rows``, from the noisy rows-per-unit histogram
    (post-processing; at least 1)."""
    n = passing(np.asarray(d["noisy"], dtype=np.float64), d["threshold"])
    units = float(n.sum())
    if units <= 0:
        return 1.0
    return max(1.0, float((n * np.minimum(representatives(), rows)).sum()) / units)


def buy(
    service: Any,
    pending: Pending,
    query: DPQuery,
    analyst: str,
    handle: Any,
    histogram_query: Callable[..., Any],
    clamp_query: Callable[..., Any] | None = None,
) -> tuple[DPQuery, float, Chosen]:
    """Release the pending histograms (already charged), keep them for the analyst at the
    data version, and return the query with the bounds chosen from them (and any histogram
    already kept). Runs after the charge: every failure here is the charged boundary's."""
    found: dict[Need, dict[str, Any]] = {}
    version = pending.needs[0].version
    if service.cache:
        for need in needs_of(query, version):
            entry = service.ledger.cached(analyst, service.policy.dataset, need.cache_key)
            data = _stored(entry) if entry is not None else None
            if data is not None:
                found[need] = data
    for need, mech in zip(pending.needs, pending.mechanisms, strict=True):
        if isinstance(mech, ApproxBounds):
            assert clamp_query is not None
            counted = replace(query.table, max_rows_per_unit=clip_rows(query.table))
            compiled = clamp_query(counted, need.keys[0], mech.histogram)
            result = service.engine.execute(compiled, handle)
            counts = np.zeros(mech.histogram.bins, dtype=np.int64)
            for row, c in zip(result.key_rows, result.measures[0], strict=True):
                counts[int(row[0])] += int(c)
            noisy_values = counts + mech.mechanism.sample(service.noise, counts.size)
            data = {
                "noisy": [int(v) for v in noisy_values],
                "threshold": 0.0,
                "epsilon": mech.epsilon,
                "payer": list(pending.payer),
            }
            found[need] = data
            if service.cache:
                remember_paid(
                    service.ledger, analyst, service.policy.dataset, need.cache_key,
                    json.dumps(data),
                )  # fmt: skip
            continue
        compiled = histogram_query(query.table, query.keys, need.kind, CANDIDATES[-1] + 1)
        result = service.engine.execute(compiled, handle)
        per_count = {
            int(row[0]): int(c) for row, c in zip(result.key_rows, result.measures[0], strict=True)
        }
        noisy = mech.release(per_count, service.noise)
        data = {
            "noisy": [int(v) for v in noisy],
            "threshold": float(mech.threshold),
            "epsilon": mech.epsilon,
            "payer": list(pending.payer),
        }
        found[need] = data
        if service.cache:  # kept for the analyst; a failed write only costs a later re-buy
            remember_paid(
                service.ledger, analyst, service.policy.dataset, need.cache_key, json.dumps(data)
            )
    return _with_chosen(query, found, pending.measured, paid=True)
