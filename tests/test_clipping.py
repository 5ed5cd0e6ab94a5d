"""Automatic clipping bounds from a noisy log-scale histogram of |x|."""

from __future__ import annotations

import math
from pathlib import Path

import duckdb
import numpy as np
import pytest
from conftest import table_policy

from dpsql.lower.compile import clamp_histogram_query
from dpsql.policy import load_policy
from dpsql.privacy.clipping import ApproxBounds, LogHistogram, bias_report, posterior_counts
from dpsql.privacy.samplers import SeededNoise, ZeroNoise

_CSV = Path(__file__).resolve().parent.parent / "fixtures" / "visits.csv"  # a source: never read


def _income(seed: int = 0, n: int = 1000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.where(rng.random(n) < 0.12, 0.0, np.round(rng.lognormal(10, 1, n), -2))
    return np.minimum(x, 500_000)


@pytest.mark.parametrize("ratio", [2.0, 2**0.25])
def test_histogram_bins_match_the_engine(ratio: float) -> None:
    hist = LogHistogram.for_bounds(-500_000, 500_000, ratio=ratio)
    edges = hist.edges()
    assert edges[0] == 0 and edges[-1] == 500_000 and edges.size == hist.bins + 1
    assert hist.smallest <= 1.0 * ratio and np.all(np.diff(edges) > 0)
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.uniform(-6e5, 6e5, 3000), _income()])
    con = duckdb.connect()
    con.execute("CREATE TABLE t AS SELECT UNNEST(?::DOUBLE[]) AS v", [x.tolist()])
    # the engine's bin: the compiler's lowering of the clamp histogram (its tree rendered)
    policy = table_policy(_CSV, {"v": {"type": "float", "lower": -500_000, "upper": 500_000}})
    table = load_policy(policy).tables["t"]
    spec = clamp_histogram_query(table, "v", hist, 0).clamp
    assert spec is not None
    bin_sql = spec.bin_of.sql(dialect="duckdb")
    engine = np.array([r[0] for r in con.execute(f"SELECT {bin_sql} FROM t").fetchall()])
    assert (engine == hist.bin_of(x)).mean() > 0.999
    assert hist.counts(x).sum() == x.size


def test_range_is_inside_the_declared_bounds() -> None:
    hist = LogHistogram.for_bounds(-1000, 500)
    rng = np.random.default_rng(3)
    counts = hist.counts(rng.normal(0, 20, 500))
    for method in ("threshold", "quantile", "sum", "mse"):
        ab = ApproxBounds(hist, 0.5, method=method, sum_epsilon=0.5)
        for seed in range(20):
            r = ab.release(counts, SeededNoise(seed), -1000, 500)
            assert -1000 <= r.lower <= 0 <= r.upper <= 500
            assert r.lower == max(-1000, -r.bound) and r.upper == min(500, r.bound)
    assert ab.cost.epsilon == 0.5 and ab.mechanism.scale == pytest.approx(2.0)


def test_sum_method_finds_a_near_optimal_bound_without_noise() -> None:
    """With the exact histogram the "sum" choice is within one bin of the best bin edge."""
    x = _income()
    hist = LogHistogram.for_bounds(0, 500_000, ratio=2**0.25)
    ab = ApproxBounds(hist, 0.1, method="sum", sum_epsilon=0.9)
    chosen = ab.release(hist.counts(x), ZeroNoise(), 0, 500_000).bound
    tops = hist.edges()[1:]
    true_error = [np.maximum(x - c, 0).sum() + c / 0.9 for c in tops]
    best = tops[int(np.argmin(true_error))]
    assert abs(math.log(chosen / best)) <= math.log(hist.ratio) + 1e-9


def test_mse_method_minimises_squared_bias_plus_noise_variance_without_noise() -> None:
    """With the exact histogram "mse" is within one bin of the edge minimising the true
    bias² + 2 (C/ε)² (a Laplace SUM's mean squared error)."""
    x = _income()
    hist = LogHistogram.for_bounds(0, 500_000, ratio=2**0.25)
    chosen = ApproxBounds(hist, 0.1, method="mse", sum_epsilon=0.9)
    bound = chosen.release(hist.counts(x), ZeroNoise(), 0, 500_000).bound
    tops = hist.edges()[1:]
    true_error = [np.maximum(x - c, 0).sum() ** 2 + 2 * (c / 0.9) ** 2 for c in tops]
    best = tops[int(np.argmin(true_error))]
    assert abs(math.log(bound / best)) <= math.log(hist.ratio) + 1e-9
    with pytest.raises(ValueError, match="SUM's epsilon"):
        ApproxBounds(hist, 1.0, method="mse")


def test_threshold_method_ignores_empty_bins_with_the_stated_probability() -> None:
    hist = LogHistogram.for_bounds(0, 1e6)
    ab = ApproxBounds(hist, 1.0, method="threshold", false_bin=0.05)
    counts = np.zeros(hist.bins, dtype=np.int64)
    counts[5] = 1000  # every value in one low bin
    top = hist.edges()[6]
    runs = [ab.release(counts, SeededNoise(s), 0, 1e6).bound for s in range(400)]
    assert np.mean(np.array(runs) > top) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 400)
    assert np.median(runs) == top


def test_bias_report_brackets_the_true_clamping_loss() -> None:
    x = _income(5)
    hist = LogHistogram.for_bounds(0, 500_000, ratio=2**0.5)
    counts = hist.counts(x)
    for c in hist.edges()[10:]:
        report = bias_report(counts, hist, c)
        true = float(np.maximum(x - c, 0).sum())
        assert true <= report.sum_bias_upper + 1e-6
        assert report.clipped_share == pytest.approx(float(np.mean(x >= c)), abs=1e-12)
    mid = bias_report(counts, hist, 50_000)
    assert mid.sum_bias == pytest.approx(float(np.maximum(x - 50_000, 0).sum()), rel=0.15)
    assert mid.relative(x.sum()) == pytest.approx(mid.sum_bias / x.sum())


def test_noisy_histogram_audit_on_neighbours_and_a_broken_variant() -> None:
    """One unit adds R = 3 values to the top bin. The event "the top bin's noisy count
    reaches 2" (what makes a bound reach M) has frequencies within e^ε of each other (5
    standard errors); noise calibrated for one value per unit does not."""
    hist = LogHistogram.for_bounds(0, 1024)
    eps, runs = 0.5, 20_000

    def rate(max_values: int, top: int, seed: int) -> float:
        ab = ApproxBounds(hist, eps, max_values=max_values, method="threshold")
        noisy = top + ab.mechanism.sample(SeededNoise(seed), runs)
        return float(np.mean(noisy >= 2))

    def log_ratio(p: float, q: float) -> float:
        se = math.sqrt((1 - p) / (p * runs) + (1 - q) / (q * runs))
        return abs(math.log(p / q)) - 5 * se

    assert log_ratio(rate(3, 3, 1), rate(3, 0, 2)) <= eps
    assert log_ratio(rate(1, 3, 3), rate(1, 0, 4)) > eps


def test_parameters_are_checked() -> None:
    hist = LogHistogram.for_bounds(0, 100)
    with pytest.raises(ValueError):
        ApproxBounds(hist, 0.0)
    with pytest.raises(ValueError):
        ApproxBounds(hist, 1.0, method="sum")  # needs the SUM's epsilon
    with pytest.raises(ValueError):
        ApproxBounds(hist, 1.0, method="median")
    with pytest.raises(ValueError):
        ApproxBounds(hist, 1.0, method="quantile").release(np.ones(3), ZeroNoise(), 0, 100)


def test_posterior_counts_shrink_noise_and_keep_large_counts() -> None:
    """Each bin's posterior mean given its noisy count (discrete Laplace of scale 10, prior
    from its neighbourhood): a large count stays about itself with the noise's variance, a
    negative one in an empty neighbourhood is near 0, and the mean grows with the count."""
    noisy = np.array([-15.0, -3.0, 0.0, 4.0, 13.0, 400.0, 420.0, 410.0])
    mean, var = posterior_counts(noisy, 10.0)
    assert mean[5:] == pytest.approx(noisy[5:], abs=12)
    assert var[6] == pytest.approx(2 * 10.0**2, rel=0.35)
    assert mean[0] < 1.5 and np.all(mean >= 0)
    assert mean[0] == pytest.approx(mean[1]) and np.all(np.diff(mean[1:5]) > 0)
    batch, _ = posterior_counts(np.stack([noisy, noisy]), 10.0)  # several histograms at once
    assert batch == pytest.approx(np.stack([mean, mean]))


def test_posterior_rule_beats_mse_on_a_noisy_tail() -> None:
    """Side by side on 300 released histograms of a skewed column with a top-coded cluster
    (ε_b = 0.1: noise of scale 10 per bin against tail bins of a few values), the exact
    expected error E|bias(C) + Laplace(C/ε)| of the SUM at each rule's chosen C: the
    "posterior" rule (the default for a total) errs less on average than "mse" and picks a
    clamp that costs more than twice the best one less often."""
    x = _income(4)
    x[:10] = 325_000.0  # a top-coded cluster, as PUMS income's
    hist = LogHistogram.for_bounds(0, 500_000, ratio=2**0.25)
    counts, total = hist.counts(x), float(x.sum())

    def error(c: float) -> float:
        bias = total - float(np.minimum(x, c).sum())
        return bias + c * math.exp(-bias / c)

    best = min(error(c) for c in np.linspace(1e4, 5e5, 400))
    rules = {m: ApproxBounds(hist, 0.1, method=m, sum_epsilon=1.0) for m in ("mse", "posterior")}
    errors: dict[str, list[float]] = {m: [] for m in rules}
    for seed in range(300):
        noisy = counts + rules["mse"].mechanism.sample(SeededNoise(seed), counts.size)
        for m, rule in rules.items():
            errors[m].append(error(rule.choose(noisy, 0, 500_000).bound))
    mse, post = np.array(errors["mse"]), np.array(errors["posterior"])
    assert post.mean() < 0.97 * mse.mean()
    assert (post > 2 * best).mean() < (mse > 2 * best).mean()
