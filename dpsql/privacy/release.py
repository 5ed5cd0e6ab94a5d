"""Noisy release: exact bounded aggregates -> noised measures -> output aggregates.

Only this module adds noise. Everything after the noise draw is post-processing and costs
no privacy: thresholding compares a *noisy* unit count with τ, AVG divides two noisy values,
counts are clamped at zero, AVG at its column's bounds, VAR at [0, (range/2)²].
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, cast

import numpy as np

from dpsql.aggregates import Mean, Sum, Variance, kind_of
from dpsql.aggregates.mode import ModeMeasure
from dpsql.engine.api import EngineResult
from dpsql.errors import PrivacyError
from dpsql.frontend.typecheck import canonical_key_value, key_sort_value
from dpsql.plan.annotated import Plan
from dpsql.plan.values import (
    OutputAggregate,
    QuantileMeasure,
    Threshold,
)
from dpsql.privacy import bias
from dpsql.privacy.coverage import (
    pivot_quantiles,
    ratio_set,
    sample_factor,
    variance_pivot_quantiles,
    variance_set,
)
from dpsql.privacy.mechanisms import Mechanism
from dpsql.privacy.partition import Unreleased
from dpsql.privacy.quantiles import ExponentialQuantile, JointQuantiles, SmoothMedian, target
from dpsql.privacy.samplers import NoiseSource

INTERVAL_DRAWS = 2000


@dataclass(frozen=True)
class Released:
    """The released table: one row per group, keys then output aggregates, with intervals."""

    key_values: list[tuple[Any, ...]]
    outputs: list[np.ndarray]  # one float array per plan output
    intervals: list[np.ndarray]  # per output: (n_groups, 2) 95% noise interval
    suppressed_probability: np.ndarray | None  # per group, where thresholding applies
    # per output: (n_groups, 2) bias estimate and its half-width, or None (dpsql.privacy.bias)
    biases: list[np.ndarray | None] = field(default_factory=list)


def _canonical(key: tuple) -> tuple:
    """Sort key for group keys: a total order (NaN after every number, NULL last; each key
    column holds one type), so the release order depends on the released keys only."""
    return tuple(key_sort_value(v) for v in key)


def group_index(plan: Plan, result: EngineResult) -> tuple[list[tuple], np.ndarray]:
    """The groups to release and, per measure, the exact value of each (0 for empty bins)."""
    n_measures = len(plan.measures)
    # One Python value per key value (NaN is one object, so dict look-ups find it).
    key_rows = [tuple(canonical_key_value(v) for v in key) for key in result.key_rows]
    if not plan.keys:
        exact = np.array([[m[0] if m else 0 for m in result.measures]], dtype=object).reshape(
            1, n_measures
        )
        _fill_distinct(plan, result, {(): 0}, exact)
        return [()], exact
    if plan.threshold is None and plan.selection is None:
        # without a threshold the groups are the declared domains: every key has one
        domains = [cast(tuple, kp.domain) for kp in plan.keys]
        size = math.prod([len(d) for d in domains])
        if size > 1_000_000:
            raise PrivacyError(
                f"the GROUP BY has {size} public bins", hint="use coarser bins or fewer keys"
            )
        groups = list(itertools.product(*domains))
    else:
        # Sorted: the engine's (hash-table) row order depends on every key present, including
        # keys that thresholding suppresses, so releasing it would leak them.
        groups = sorted(dict.fromkeys(key_rows), key=_canonical)
        # A public key's value outside its declared domain is dropped here too (a row-level
        # plan does not filter such rows in the engine).
        allowed = [set(kp.domain) if kp.domain is not None else None for kp in plan.keys]
        groups = [
            g for g in groups if all(d is None or v in d for v, d in zip(g, allowed, strict=True))
        ]
    position = {g: i for i, g in enumerate(groups)}
    exact = np.zeros((len(groups), n_measures), dtype=object)
    for row, key in enumerate(key_rows):
        i = position.get(key)
        if i is None:  # outside the public domain: never released
            continue
        for j in range(n_measures):
            exact[i, j] += result.measures[j][row]
    _fill_distinct(plan, result, position, exact)
    return groups, exact


def _fill_distinct(
    plan: Plan, result: EngineResult, position: dict[tuple, int], exact: np.ndarray
) -> None:
    """COUNT(DISTINCT col) and SUM(DISTINCT col) of a bounded plan: from its own query over
    the bounded rows (the main query holds 0 for it), after the quantiles' bin counts in
    ``result.extras``."""
    extras = result.extras[len(plan.quantiles) :]
    if not extras:
        return
    distinct = [j for j, m in enumerate(plan.measures) if m.measure_kind.distinct]
    for j, counts in zip(distinct, extras, strict=True):
        for i, _, c in _released_rows(counts, position, len(plan.keys)):
            exact[i, j] += c


def _released_rows(
    extra: EngineResult, position: dict[tuple, int], n_keys: int
) -> Iterator[tuple[int, tuple, int]]:
    """An extra query's rows (keys, then more columns, then a count) of the released groups:
    (the group's index, the columns after its keys, the count). Rows of a suppressed group or
    of a key outside its public domain are skipped."""
    for row, count in zip(extra.key_rows, extra.measures[0], strict=True):
        i = position.get(tuple(canonical_key_value(v) for v in row[:n_keys]))
        if i is not None:
            yield i, tuple(row[n_keys:]), int(count)


def _evaluate(output: OutputAggregate, plan: Plan, values: dict[str, np.ndarray]) -> np.ndarray:
    """An output aggregate from (noisy) measure values, in released units (its kind's own
    formula: dpsql.aggregates)."""
    return kind_of(output).evaluate(output, plan, values)


def _no_check() -> None:
    return None


def release(
    plan: Plan,
    result: EngineResult,
    source: NoiseSource,
    check: Callable[[], None] = _no_check,
    given: dict[str, np.ndarray] | None = None,
) -> Released:
    """The released table. ``check`` is called between groups of the per-group Python work
    (quantile releases): the query handle's cancel and statement timeout reach it (it raises
    the 57014 cancel, which the charged boundary reports as a charged cancel).

    ``given``: measures already released (their noisy values, per group in release order),
    used as they are instead of drawing their noise again (dpsql.service.group_clamps releases
    each AVG's count first and chooses each group's clamp from it)."""
    groups, exact = group_index(plan, result)
    n = len(groups)
    noisy = released_measures(plan, exact, source, given or {})
    keep = np.ones(n, dtype=bool)
    suppressed = None
    if plan.threshold is not None:
        units = noisy[plan.threshold.measure]
        keep = _over_threshold(plan.threshold, units, source)
        mech = _noised(plan, plan.threshold.measure)
        (sim,) = simulated_noise(0, (mech,), INTERVAL_DRAWS)
        suppressed = _threshold_loss(plan.threshold, units[keep], sim)
    selection = plan.selection
    if selection is not None and selection.mechanism is not None:
        keep, suppressed = _select(plan, exact, noisy, source)
    kept = {k: v[keep] for k, v in noisy.items()}
    key_values = [g for g, k in zip(groups, keep, strict=True) if k]
    for qm, bins in zip(plan.quantiles, result.extras[: len(plan.quantiles)], strict=True):
        counts = _bin_counts(qm, bins, key_values, len(plan.keys))
        if isinstance(qm, QuantileMeasure):
            kept[qm.name] = _release_quantiles(qm, counts, source, check)
        else:  # another histogram measure releases itself (MODE: dpsql.aggregates.mode)
            kept[qm.name] = qm.release_all(counts, source, check)
    outputs = [_evaluate(o, plan, kept) for o in plan.outputs]
    token = _SHARED_SETS.set({})  # VAR and STDDEV of one column share one set (this call)
    try:
        intervals = [
            _interval(o, plan, kept, value) for o, value in zip(plan.outputs, outputs, strict=True)
        ]
    finally:
        _SHARED_SETS.reset(token)
    biases = bias.estimates(plan, kept, outputs)  # what the bounds cut: post-processing
    return Released(key_values, outputs, intervals, suppressed, biases)


def released_measures(
    plan: Plan,
    exact: np.ndarray,
    source: NoiseSource,
    given: dict[str, np.ndarray],
    names: tuple[str, ...] | None = None,
) -> dict[str, np.ndarray]:
    """Each measure's noisy value per group (of ``names``, or all), in released units: the
    exact value plus its mechanism's noise, or the value ``given`` for it."""
    noisy: dict[str, np.ndarray] = {}
    for j, m in enumerate(plan.measures):
        if names is not None and m.name not in names:
            continue
        if m.name in given:
            noisy[m.name] = np.asarray(given[m.name], dtype=float)
            continue
        column = [int(v) for v in exact[:, j].tolist()]
        noise = np.asarray(m.mechanism.sample(source, len(exact))).tolist()
        # exact integer sums (Python ints), each rounded once to a float (as an object
        # array's astype(float) rounds it), without the object arrays
        noisy[m.name] = np.array(
            [float(v + int(x)) for v, x in zip(column, noise, strict=True)], dtype=float
        )
        if m.scale != 1:  # a rescaled measure's fine grid (dpsql.plan.values): post-processing
            noisy[m.name] = noisy[m.name] / m.scale
    return noisy


def _over_threshold(threshold: Threshold, units: np.ndarray, source: NoiseSource) -> np.ndarray:
    """Which groups the threshold keeps: noisy unit count >= τ, or = τ − 1 with probability
    ``threshold.below`` (the fitted share that spends all of δ: mechanisms.threshold_below).
    One coin per group, in release order, drawn whatever the counts (the draws' number is
    public); the coin is independent of the data, so keeping is post-processing of the count."""
    keep = units >= threshold.tau
    if threshold.below > 0:
        # u >= 1 − p (not u < p): a noise-off source (all zeros) keeps the integer threshold
        coins = source.uniform(len(units)) >= 1.0 - threshold.below
        keep |= (units == threshold.tau - 1) & coins
    return keep


def _threshold_loss(threshold: Threshold, units: np.ndarray, sim: np.ndarray) -> np.ndarray:
    """Per released group, P(suppressed) at its noisy unit count u over simulated noise
    ``sim``: P(u + X < τ − 1) + (1 − p)·P(u + X = τ − 1), by binary search in the sorted
    draws (O(log draws) per group)."""
    ordered = np.sort(sim)
    edge = threshold.tau - 1 - units
    below = np.searchsorted(ordered, edge, side="left")
    at = np.searchsorted(ordered, edge, side="right") - below
    return (below + at * (1.0 - threshold.below)) / len(ordered)


def _bin_counts(
    qm: QuantileMeasure | ModeMeasure, bins: EngineResult, groups: list[tuple], n_keys: int
) -> np.ndarray:
    """Per released group (in release order), the count of its bounded values in each bin;
    groups without a value have all-zero counts (their release is uniform on the grid)."""
    position = {g: i for i, g in enumerate(groups)}
    counts = np.zeros((len(groups), qm.bins), dtype=np.int64)
    for i, (b,), c in _released_rows(bins, position, n_keys):
        counts[i, int(b)] += c
    return counts


def _release_quantiles(
    qm: QuantileMeasure,
    counts: np.ndarray,
    source: NoiseSource,
    check: Callable[[], None] = _no_check,
) -> np.ndarray:
    """Each group's targets (in ``qm.targets`` order) from its bin counts: MIN and MAX one
    EM each, the levels in (0, 1) one joint release, each of ε ``qm.part_epsilon``. O(B) per
    part and group (B the public grid's bins); ``check`` runs before each group."""
    out = np.zeros((len(counts), len(qm.targets)))
    if qm.method == "smooth":  # MEDIAN alone (the planner refuses anything else)
        smooth = SmoothMedian(qm.grid, qm.part_epsilon, max_values=qm.max_values)
        for i, row in enumerate(counts):
            check()
            out[i, 0] = smooth.release(row, source)
        return out
    method = "pf" if qm.method == "pf" else "em"
    single = ExponentialQuantile(qm.grid, qm.part_epsilon, max_values=qm.max_values, method=method)
    joint = JointQuantiles(qm.grid, qm.part_epsilon, max_values=qm.max_values, score="cdf")
    for i, row in enumerate(counts):
        check()
        for part in qm.parts:
            kind = part[0][0]
            if kind in ("min", "max") or (method == "pf" and len(part) == 1):
                tgt = target(kind, part[0][1], score="cdf" if kind == "quantile" else "rank")
                values = [single.release(row, tgt, source).value]
            else:
                values = [
                    r.value for r in joint.release(row, [float(q or 0) for _, q in part], source)
                ]
            for t, v in zip(part, values, strict=True):
                out[i, qm.targets.index(t)] = v
    return out


def _noised(plan: Plan, name: str) -> Mechanism:
    """A measure's noise (never the selection's exact count: dpsql.plan.check)."""
    mechanism = plan.measure(name).mechanism
    assert not isinstance(mechanism, Unreleased)
    return mechanism


def _select(
    plan: Plan, exact: np.ndarray, noisy: dict[str, np.ndarray], source: NoiseSource
) -> tuple[np.ndarray, np.ndarray | None]:
    """Optimal partition selection on the exact unit counts (which then leave ``noisy``:
    nothing may read them). Groups come sorted by key (group_index), so neither the keep
    draws nor the released order depend on the engine's row order.

    A released group's suppression probability is 1 − π(n̂) at a *noisy* unit count n̂ the
    query releases anyway (post-processing); without one it is not given (NULL).
    """
    selection = plan.selection
    assert selection is not None and selection.mechanism is not None and selection.measure
    j = next(i for i, m in enumerate(plan.measures) if m.name == selection.measure)
    counts = np.array([int(v) for v in exact[:, j]], dtype=np.int64)
    del noisy[selection.measure]
    keep = selection.mechanism.keep(counts, source)
    noisy_units = next(
        (noisy[m.name] for m in plan.measures if m.kind == "units" and m.name in noisy), None
    )
    if noisy_units is None:
        return keep, None
    sel = selection.mechanism
    suppressed = np.array(
        [sel.suppression_probability(max(1, round(float(u)))) for u in noisy_units[keep]]
    )
    return keep, suppressed


# per release() call (a context variable: releases run in many threads at once)
_SHARED_SETS: ContextVar[dict[tuple, tuple[np.ndarray, np.ndarray]] | None] = ContextVar(
    "dpsql_shared_sets", default=None
)


def _interval(
    output: OutputAggregate, plan: Plan, noisy: dict[str, np.ndarray], value: np.ndarray
) -> np.ndarray:
    """95% interval of the released value's noise, by simulating the plan's own mechanisms.

    Treats the released measures as the truth, redraws the (public) noise distribution and
    recomputes the output formula: post-processing, so it costs nothing and leaks nothing.
    """
    n = len(value)
    if n == 0:
        return np.zeros((0, 2))
    if not output.measures:  # a quantile: its guarantee is in ranks (EXPLAIN), not values
        return np.full((n, 2), np.nan)
    first = plan.measure(output.measures[0])
    kind = kind_of(output)
    if kind.single_measure(first):
        # One measure, no formula: the exact half-width of the discrete noise itself.
        half = first.mechanism.interval_halfwidth() * first.granularity / first.scale
        low = value - half
        if kind.floor_zero:
            low = np.maximum(low, 0.0)  # counts are released clamped at zero
        return np.stack([low, value + half], axis=1)
    if isinstance(kind, Mean | Variance):
        # a ratio of noisy measures: the range over the box they allow (dpsql.privacy.coverage)
        memo = _SHARED_SETS.get()
        return _box_interval(output, plan, kind, noisy, value, {} if memo is None else memo)
    names = kind.interval_measures(output, plan)
    draws = min(INTERVAL_DRAWS, max(200, 200_000 // max(n, 1)))
    order = sorted(names)  # a set, whose order follows the hash seed
    noises = simulated_noise(12345, tuple(_noised(plan, k) for k in order), draws * n)
    sims = {
        name: noisy[name][None, :] + noise.reshape(draws, n) / plan.measure(name).scale
        for name, noise in zip(order, noises, strict=True)
    }
    simulated = _evaluate(output, plan, sims)
    error = simulated - _evaluate(output, plan, {k: noisy[k][None, :] for k in names})
    lower, upper = error_quantiles(error)
    return np.stack([value + lower, value + upper], axis=1)


def _half(plan: Plan, name: str, alpha: float) -> float:
    """A measure's noise half-width at level 1 − α, in the units of its released value."""
    m = plan.measure(name)
    return _noised(plan, name).interval_halfwidth(1.0 - alpha) / m.scale


_PIVOT_DRAWS = 20_000  # noise draws behind a pivot's quantiles (error in level ~0.0015)
_VARIANCE_DRAWS = 8_000  # ... behind the variance pivot's (17 x 129 quantiles; ~0.0024)
# VAR / STDDEV: the mean's set, the variance's set at a candidate mean, and the count's
# interval (for N/(N − 1)) at these shares of α (Bonferroni: together the stated level; the
# population variants use the same sets, so VAR and STDDEV of one column share them)
VARIANCE_ALPHAS = (0.01, 0.035, 0.005)


@lru_cache(maxsize=256)
def _pivot_grid(
    mech_a: Mechanism,
    scale_a: int,
    mech_b: Mechanism,
    scale_b: int,
    level: float,
    x_lo: float,
    x_hi: float,
) -> tuple[np.ndarray, np.ndarray]:
    """The pivot quantiles of :func:`dpsql.privacy.coverage.pivot_quantiles` for two measures'
    noises (in released units): public parameters only, so cached across queries."""
    noise_a, noise_b = simulated_noise(24680, (mech_a, mech_b), _PIVOT_DRAWS)
    return pivot_quantiles(noise_a / scale_a, noise_b / scale_b, level, x_lo, x_hi)


@lru_cache(maxsize=64)
def _variance_grid(
    mechanisms: tuple[Mechanism, ...],
    scales: tuple[int, ...],
    center2: float,
    level: float,
    y_lo: float,
    y_hi: float,
    cap: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The variance pivot's quantiles (dpsql.privacy.coverage.variance_pivot_quantiles) for
    the sum, count and sumsq noises: public parameters only, cached across queries."""
    draws = simulated_noise(13579, mechanisms, _VARIANCE_DRAWS)
    z_s, z_n, z_q = (d / k for d, k in zip(draws, scales, strict=True))
    return variance_pivot_quantiles(z_s, z_n, z_q, center2, level, y_lo, y_hi, cap)


def _ratio(
    plan: Plan,
    a: str,
    b: str,
    noisy: dict[str, np.ndarray],
    level: float,
    x_lo: float,
    x_hi: float,
) -> tuple[np.ndarray, np.ndarray]:
    """The confidence set (hull) of a*/b* from the noisy measures ``a`` and ``b``."""
    ma, mb = plan.measure(a), plan.measure(b)
    xs, qs = _pivot_grid(_noised(plan, a), ma.scale, _noised(plan, b), mb.scale, level, x_lo, x_hi)
    return ratio_set(noisy[a], noisy[b], xs, qs)


def _population_variance_set(
    plan: Plan,
    output: OutputAggregate,
    noisy: dict[str, np.ndarray],
    y_lo: float,
    y_hi: float,
    cap: float,
) -> tuple[np.ndarray, np.ndarray]:
    """The population variance's set (fixed-point units²) over the mean's set."""
    s, n, sq = output.measures[0], output.measures[1], output.measures[2]
    a_mean, a_square, _ = VARIANCE_ALPHAS
    center2 = float(plan.measure(sq).center2)
    m_lo, m_hi = _ratio(plan, s, n, noisy, 1.0 - a_mean, y_lo, y_hi)
    grid = _variance_grid(
        tuple(_noised(plan, k) for k in (s, n, sq)),
        tuple(plan.measure(k).scale for k in (s, n, sq)),
        center2,
        1.0 - a_square,
        y_lo,
        y_hi,
        cap,
    )
    low, high = variance_set(noisy[s], noisy[n], noisy[sq], m_lo, m_hi, center2, grid)
    return np.clip(low, 0.0, cap), np.clip(high, 0.0, cap)


def _box_interval(
    output: OutputAggregate,
    plan: Plan,
    kind: Mean | Variance,
    noisy: dict[str, np.ndarray],
    value: np.ndarray,
    memo: dict[tuple, tuple[np.ndarray, np.ndarray]],
) -> np.ndarray:
    """AVG / VAR / STDDEV: confidence sets by test inversion (dpsql.privacy.coverage), which
    cover at the stated level for groups of any size instead of describing the spread of a
    formula around its own noisy value."""
    first = plan.measure(output.measures[0])
    s, n = output.measures[0], output.measures[1]
    g = first.granularity
    c = first.center
    y_lo, y_hi = float(first.lo - c), float(first.hi - c)  # a centred row value's range
    if isinstance(kind, Mean):
        low, high = _ratio(plan, s, n, noisy, DEFAULT_CONFIDENCE, y_lo, y_hi)
        low = np.clip((c + low) * g, output.lower, output.upper)
        high = np.clip((c + high) * g, output.lower, output.upper)
    else:
        a_count = VARIANCE_ALPHAS[2]
        cap = ((first.hi - first.lo) / 2.0) ** 2
        key = tuple(output.measures)
        if key not in memo:  # VAR_POP, VAR_SAMP, STDDEV_*: one set of the same measures
            memo[key] = _population_variance_set(plan, output, noisy, y_lo, y_hi, cap)
        low, high = memo[key]
        if kind.sample:
            h_n = _half(plan, n, a_count)
            low, high, cap = sample_factor(low, high, noisy[n], h_n, cap)
        empty = high <= low
        low, high = np.where(empty, 0.0, low), np.where(empty, cap, high)
        low, high = low * g * g, high * g * g
        if kind.root:
            low, high = np.sqrt(low), np.sqrt(high)
    # the released value stays inside its interval (it may sit outside a set by clamping)
    return np.stack([np.minimum(low, value), np.maximum(high, value)], axis=1)


def error_quantiles(error: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column, ``np.quantile(error, 0.025, axis=0, method="lower")`` and ``(0.975,
    "higher")``: the same order statistics from one partition (~5 us instead of ~25 us).

    The ranks are numpy's own (floor and ceil of ``(m - 1) * q`` in float); a column holding
    a NaN gives NaN, as numpy does (NaN sorts last, so the partition's last row shows it).
    """
    m = error.shape[0]
    lo, hi = math.floor((m - 1) * 0.025), math.ceil((m - 1) * 0.975)
    part = np.partition(error, (lo, hi, m - 1), axis=0)
    lower, upper = part[lo], part[hi]
    nan = np.isnan(part[m - 1])
    if nan.any():
        lower, upper = np.where(nan, np.nan, lower), np.where(nan, np.nan, upper)
    return lower, upper


_SIMULATION_CACHE_SIZE = 20_000  # draws: up to this many, 64 simulations are kept
_LARGE_SIMULATION_SIZE = 250_000  # ... and 8 of up to this many (many groups: ~2 MB each)


def simulated_noise(
    seed: int, mechanisms: tuple[Mechanism, ...], size: int
) -> tuple[np.ndarray, ...]:
    """``size`` approximate draws per mechanism, in order, from one generator seeded ``seed``.

    Deterministic in its arguments and independent of the data, so small simulations are
    cached (read-only arrays): the same values, without redrawing them for every query.
    """
    if size <= _SIMULATION_CACHE_SIZE:
        return _simulated_noise_cached(seed, mechanisms, size)
    if size <= _LARGE_SIMULATION_SIZE:
        return _large_simulated_noise_cached(seed, mechanisms, size)
    return _draw_noise(seed, mechanisms, size)


def _draw_noise(seed: int, mechanisms: tuple[Mechanism, ...], size: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    out = tuple(_approximate_noise(m, rng, size) for m in mechanisms)
    for array in out:
        array.flags.writeable = False
    return out


_simulated_noise_cached = lru_cache(maxsize=64)(_draw_noise)
_large_simulated_noise_cached = lru_cache(maxsize=8)(_draw_noise)


def _approximate_noise(mech: Mechanism, rng: np.random.Generator, size: int) -> np.ndarray:
    """Fast draws from (a close approximation of) a mechanism's noise, for error bars only
    (each mechanism's own ``approximate``).

    Never used for a release: intervals describe the public noise distribution, so a
    non-cryptographic generator is fine here and keeps EXPLAIN and queries fast.
    """
    return mech.approximate(rng, size)


DEFAULT_CONFIDENCE = 0.95  # the level of the intervals the release computes and caches
_RATIO_DRAWS = 20_000


def at_confidence(plan: Plan, answer: dict, confidence: float) -> dict:
    """The answer with its noise intervals at ``confidence`` instead of the cached 95%.

    Post-processing of the released values and the plan's public noise distribution only, so
    it costs nothing, and a cached answer serves every level (changing the level never buys
    fresh noise). A single-measure value (COUNT, SUM over a non-centred range) gets the exact
    half-width of its discrete noise at the level; a centred SUM keeps its simulated 95%
    interval, each side scaled by the ratio of the level's quantile to the 95% quantile of its
    error's linearised distribution, and so do AVG, VARIANCE and STDDEV above 95% (their 95%
    confidence set, unchanged, below: it covers any lower level).
    """
    if confidence == DEFAULT_CONFIDENCE or not answer["outputs"]:
        return answer
    intervals = [
        _output_at(output, plan, answer["outputs"][i], answer["intervals"][i], confidence)
        for i, output in enumerate(plan.outputs)
    ]
    return {**answer, "intervals": intervals}


def _output_at(
    output: OutputAggregate,
    plan: Plan,
    values: list[float],
    spans: list[list[float]],
    confidence: float,
) -> list[list[float]]:
    if not values or not output.measures:  # quantiles: no value interval
        return spans
    value = np.asarray(values, dtype=float)
    first = plan.measure(output.measures[0])
    kind = kind_of(output)
    if kind.single_measure(first):
        half = first.mechanism.interval_halfwidth(confidence) * first.granularity / first.scale
        low = value - half
        if kind.floor_zero:
            low = np.maximum(low, 0.0)
        return np.stack([low, value + half], axis=1).tolist()
    if isinstance(kind, Mean | Variance) and confidence < DEFAULT_CONFIDENCE:
        # a 95% confidence set covers any lower level; the noisy measures that would narrow it
        # (coverage.py) are not cached, and scaling it down by the linearised error's quantiles
        # under-covered small groups (AVG at 80%: 0.74, one group 0.57)
        return spans
    span = np.asarray(spans, dtype=float).reshape(-1, 2)
    mechanisms, weights = _error_terms(output, plan, value)
    noises = simulated_noise(54321, mechanisms, _RATIO_DRAWS)
    low_ratio, high_ratio = _quantile_ratios(weights, noises, confidence)
    low = value + (span[:, 0] - value) * low_ratio
    high = value + (span[:, 1] - value) * high_ratio
    if output.lower is not None or output.upper is not None:  # AVG: its column's range
        low, high = (
            np.clip(low, output.lower, output.upper),
            np.clip(high, output.lower, output.upper),
        )
    elif not isinstance(kind, Sum):  # VAR / STDDEV are never negative
        low = np.maximum(low, 0.0)
    return np.stack([low, high], axis=1).tolist()


def _error_terms(
    output: OutputAggregate, plan: Plan, value: np.ndarray
) -> tuple[tuple[Mechanism, ...], np.ndarray]:
    """The noises in a value's (linearised) error and, per group, the weight of each (the
    kind's own linearisation: dpsql.aggregates)."""
    return kind_of(output).error_terms(output, plan, value)


def _quantile_ratios(
    weights: np.ndarray, noises: tuple[np.ndarray, ...], confidence: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per group: the level's lower/upper error quantiles over the 95% ones (1 where 0)."""
    tail, tail95 = (1 - confidence) / 2, (1 - DEFAULT_CONFIDENCE) / 2
    # Two significant digits: the ratio varies smoothly with the weights, and many groups
    # then share one simulation.
    magnitude = 10.0 ** np.floor(np.log10(np.where(weights == 0, 1.0, np.abs(weights))))
    rounded = np.round(weights / magnitude, 1) * magnitude
    unique, inverse = np.unique(rounded, axis=0, return_inverse=True)
    low, high = np.ones(len(unique)), np.ones(len(unique))
    for i, w in enumerate(unique):
        error = sum(wk * noise for wk, noise in zip(w, noises, strict=True))
        q = np.quantile(error, [tail, tail95, 1 - tail95, 1 - tail])
        if q[1] != 0:
            low[i] = q[0] / q[1]
        if q[2] != 0:
            high[i] = q[3] / q[2]
    inverse = inverse.reshape(-1)
    return low[inverse], high[inverse]
