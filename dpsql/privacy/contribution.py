"""Contribution bounds chosen privately: ``max_rows_per_unit = "auto"`` and
``max_groups_per_unit = "auto"``.

What is released. Over the whole table at one data version (no WHERE: the bound is the
table's, not one query's), the engine counts the privacy units by how much each contributes —
its rows (for R) or its distinct groups of a GROUP BY key set (for G) — in public bins whose
tops are the candidate bounds :data:`CANDIDATES` (1, 2, ..., 6, 8, 10, 12, 16, ..., 64) and one
overflow bin (more than 64). Each unit lies in exactly one bin, so adding or removing a unit
moves the histogram by 1 in L1: discrete Laplace noise of scale 1/ε_c on every bin makes it
ε_c-DP (:class:`ContributionHistogram`). Nothing else about the data is read.

How a bound is chosen (post-processing of the noisy histogram, free). The bins from the first
whose noisy count is below τ upwards are taken as empty (τ: an empty bin passes with
probability at most ``false_bin``/#bins). Without this the noise of the many empty bins above
the data reads as a long tail, and a single empty bin passing τ far above the data would cost
the query a bound many times too large; with it, a false pass can only extend the bound by one
candidate. The price: a thin tail of heavy units (fewer than about τ per bin, or past an empty
bin) is not seen, and the bound cuts it; the answer's note states the estimated share cut.
Then, as PipelineDP's ``tune()`` does offline over its contribution histograms, the candidate c
minimising the expected error of the query's measures is taken:

    error(c) = bias(c) + c · noise_per_unit,
    bias(c)  = Σ_b n̂_b · (r_b − c)₊          (r_b: the bin's representative count),

with noise_per_unit the expected |noise| a measure pays per unit of the bound (for a COUNT
released with ε_m and the other bound B: B/ε_m, in rows). The bias is in rows (R) or in
(unit, group) pairs (G); a SUM's bias and noise both scale with its clamp, so the same
trade-off is used for every measure. Each query may choose from the same released histogram
(post-processing): a query with more measures, or a smaller ε, chooses a smaller bound.

Who pays (dpsql.service.bounds): the first query of an analyst that needs the histogram on a
data version spends ``bounds_share`` of its ε on it (recorded in the ledger as its own charge);
the histogram is kept in that analyst's answer cache for the data version and every later
query chooses from it for free. Another analyst pays for their own histogram: a per-analyst
budget bounds what that analyst's answers reveal, and the bounds are part of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dpsql.privacy.accounting import Cost
from dpsql.privacy.mechanisms import Laplace
from dpsql.privacy.samplers import NoiseSource

#: the bounds a choice may return, each the top of one bin (bin i holds the units whose
#: contribution n has CANDIDATES[i-1] < n <= CANDIDATES[i]); one more bin holds n > 64
CANDIDATES: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
#: the representative contribution of the overflow bin (more than the last candidate)
OVERFLOW = 2 * CANDIDATES[-1]
#: the share of a choice's ε that buys the rows histogram when one query needs both (the rows
#: histogram must see a thin tail of heavy units; the groups one is usually concentrated)
ROWS_PART = 0.75


def bin_of(n: int) -> int:
    """The bin of a unit contributing ``n`` >= 1 (rows or groups)."""
    for i, top in enumerate(CANDIDATES):
        if n <= top:
            return i
    return len(CANDIDATES)


def representatives() -> np.ndarray:
    """r_b: the middle of each bin's counts (the count itself for a one-value bin)."""
    lows = (0, *CANDIDATES[:-1])
    reps = [(lo + 1 + top) / 2 for lo, top in zip(lows, CANDIDATES, strict=True)]
    return np.array([*reps, float(OVERFLOW)], dtype=np.float64)


@dataclass(frozen=True)
class ContributionHistogram:
    """Spend ``epsilon`` on the noisy histogram of per-unit contributions (rows or groups)."""

    epsilon: float
    # P(some empty bin passes τ) <= this: a false pass extends the bound by one candidate at
    # most (the contiguous rule of choose), so it may be large; 0.5 measured best on the
    # fixture and PUMS_dup (bench/bench_utility.py --auto-bounds)
    false_bin: float = 0.5

    name = "contribution_histogram"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError("choosing a contribution bound needs an epsilon > 0")

    @property
    def bins(self) -> int:
        return len(CANDIDATES) + 1

    @property
    def mechanism(self) -> Laplace:
        # one unit is in one bin: L1 sensitivity 1 under add/remove-one-unit
        return Laplace(l1=1.0, epsilon=self.epsilon)

    @property
    def cost(self) -> Cost:
        return self.mechanism.cost

    @property
    def threshold(self) -> float:
        """τ: an empty bin's noisy count reaches τ with probability <= false_bin / #bins."""
        return self.mechanism.threshold(self.false_bin, self.bins) - 1

    def counts(self, per_count: Mapping[int, int]) -> np.ndarray:
        """The exact bin counts from {contribution n: units with n} (the engine's rows)."""
        out = np.zeros(self.bins, dtype=np.int64)
        for n, units in per_count.items():
            if n >= 1 and units > 0:
                out[bin_of(int(n))] += int(units)
        return out

    def release(self, per_count: Mapping[int, int], source: NoiseSource) -> np.ndarray:
        """The noisy bin counts (ε-DP); every later choice is post-processing of them."""
        exact = self.counts(per_count)
        return exact + self.mechanism.sample(source, exact.size)


def passing(noisy: np.ndarray, threshold: float) -> np.ndarray:
    """The noisy counts with every bin from the first below ``threshold`` upwards set to 0."""
    n = np.asarray(noisy, dtype=np.float64)
    below = np.flatnonzero(n < threshold)
    if below.size:
        n = n.copy()
        n[below[0] :] = 0.0
    return n


def choose(noisy: np.ndarray, threshold: float, noise_per_unit: float) -> int:
    """The candidate bound minimising bias(c) + c · noise_per_unit over the noisy histogram
    (:func:`passing` bins only); 1 when no bin passes. Post-processing."""
    n = passing(noisy, threshold)
    reps = representatives()
    best, best_error = CANDIDATES[0], math.inf
    for c in CANDIDATES:
        error = float((n * np.maximum(reps - c, 0.0)).sum()) + c * noise_per_unit
        if error < best_error - 1e-12:
            best, best_error = c, error
    return best


def dropped_share(noisy: np.ndarray, threshold: float, bound: int) -> float:
    """The estimated share of the contributions (rows or pairs) a bound cuts, from the same
    noisy histogram: what EXPLAIN and the answer's note say the choice costs."""
    n = passing(noisy, threshold)
    reps = representatives()
    total = float((n * reps).sum())
    if total <= 0:
        return 0.0
    return float((n * np.maximum(reps - bound, 0.0)).sum()) / total
