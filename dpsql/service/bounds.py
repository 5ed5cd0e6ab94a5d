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
  (dpsql.sql.bias: ``TablePolicy.bias_by_histogram``); the histogram's estimate of what R
  cuts is its note. Later queries, choosing free, spend their bias share on the measures.
- An unstated bound of a table with a privacy unit is "auto" (dpsql.policy); where no
  choice is made (private joins, per-unit relations, estimators) it plans at 1, a declared
  "auto" at the cap (``TablePolicy.unchosen_bounds``).

Tables without a privacy unit plan with R = G = 1.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dpsql.boundary import remember_paid
from dpsql.privacy.accounting import Cost
from dpsql.privacy.contribution import (
    CANDIDATES,
    ROWS_PART,
    ContributionHistogram,
    choose,
    dropped_share,
)

# This module sits below the planner and compiler (it imports neither: tests/test_layering.py):
# a bound query is passed in as ``Any`` (dpsql.sql.bind.BoundQuery), the engine query of a
# histogram is built by the caller's ``histogram_query`` (dpsql.sql.compile.contribution_query).
BoundQuery = Any


@dataclass(frozen=True)
class Need:
    """One histogram a query chooses from: of rows per unit, or of groups per unit for the
    key set ``keys`` (the keys' SQL), at ``version``; ``cache_key`` is where it is kept."""

    kind: str  # "rows" | "groups"
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
        return f"groups per unit of {self.table} by {', '.join(self.keys)}"


@dataclass(frozen=True)
class Pending:
    """Histograms a query must buy before it runs: ``mechanisms[i]`` for ``needs[i]``."""

    needs: tuple[Need, ...]
    mechanisms: tuple[ContributionHistogram, ...]
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
        return (
            f"choose contribution bounds: {'; '.join(n.label for n in self.needs)} at data "
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

    def notes(self) -> list[str]:
        if self.pending is not None:
            return [
                f"contribution bounds chosen at run time from a DP histogram (ε "
                f"{self.pending.epsilon:.3g} of this query's, charged once per data version)"
            ]
        out = []
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


def needs_of(query: BoundQuery, version: str) -> tuple[Need, ...]:
    """The histograms ``query`` chooses its bounds from (none for a table without "auto")."""
    table = query.table
    if not table.auto_bounds or table.privacy_unit is None or table.joined is not None:
        return ()
    out = []
    if "groups" in table.auto_bounds and query.keys:
        out.append(Need("groups", table.name, version, tuple(k.sql for k in query.keys)))
    if "rows" in table.auto_bounds:
        out.append(Need("rows", table.name, version))
    return tuple(out)


def measure_count(query: BoundQuery) -> int:
    """How many noisy measures share the query's ε (as dpsql.sql.plan splits it, roughly:
    COUNT one, SUM one per column, AVG a sum and the count, VAR/STDDEV a sum of squares too)."""
    parts: set[tuple[str, str | None]] = set()
    for call in query.aggregates:
        if call.summed:  # the kind's object says so (dpsql.sql.bind.AggregateCall.summed)
            parts |= {("sum", call.column), ("count", None)}
            if call.kind not in ("sum", "avg"):
                parts.add(("sumsq", call.column))
        elif call.kind in ("count", "count_units"):
            parts.add(("count", None))
        else:
            parts.add((call.kind, call.column))
    return max(1, len(parts))


def _stored(entry: str) -> dict[str, Any] | None:
    try:
        data = json.loads(entry)
    except ValueError:
        return None
    return data if isinstance(data, dict) and "noisy" in data else None


def resolve(
    service: Any, query: BoundQuery, epsilon: float, analyst: str | None
) -> tuple[BoundQuery, float, Chosen | None]:
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
            tuple(ContributionHistogram(e) for e in _split(choice_eps, missing)),
            choice_eps,
            measured,
            payer,
        )
        return query, measured, Chosen(None, None, None, None, pending, measured)
    paid_here = any(tuple(d.get("payer", ())) == payer for d in found.values())
    measured = measured if paid_here else epsilon
    return _with_chosen(query, found, measured, paid=paid_here)


def _split(epsilon: float, needs: tuple[Need, ...]) -> list[float]:
    """How a choice's ε is split over the histograms it buys (rows ROWS_PART of it when it
    buys both; the parts add up to ``epsilon``)."""
    if len(needs) == 1:
        return [epsilon]
    rows = epsilon * ROWS_PART
    return [rows if n.kind == "rows" else epsilon - rows for n in needs]


def _with_chosen(
    query: BoundQuery, found: dict[Need, dict[str, Any]], measured: float, paid: bool
) -> tuple[BoundQuery, float, Chosen]:
    """Choose G first (its noise per unit: one group's), then R given G (post-processing).
    ``paid``: this statement bought a histogram; its overhead share went there, so no bias
    measure is planned for it (the histogram's estimate of what R cuts is its note)."""
    k = measure_count(query)
    table = query.table
    rows = table.max_rows_per_unit
    groups = table.max_groups_per_unit
    chosen_rows = chosen_groups = None
    dropped_rows = dropped_pairs = None
    by_kind = {n.kind: d for n, d in found.items()}
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
    # chosen: no longer "auto", so planning it again never asks for another choice
    bounded = replace(
        table,
        max_rows_per_unit=rows,
        max_groups_per_unit=groups,
        auto_bounds=(),
        bias_by_histogram=paid,
    )
    chosen = Chosen(chosen_rows, chosen_groups, dropped_rows, dropped_pairs, None, measured, paid)
    return replace(query, table=bounded), measured, chosen


def buy(
    service: Any,
    pending: Pending,
    query: BoundQuery,
    analyst: str,
    handle: Any,
    histogram_query: Callable[..., Any],
) -> tuple[BoundQuery, float, Chosen]:
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
