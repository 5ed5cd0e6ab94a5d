"""Privacy of the regression mechanisms: sensitivities, clipping, cost, and an empirical audit.

The audit runs one DP-SGD step (full batch, and Poisson-subsampled) on neighbouring datasets D
and D′ = D + one unit whose gradient is large, and bounds ε from below with Clopper–Pearson
intervals (:mod:`dpsql.privacy.audit`). The calibrated mechanism must pass; the same training
loop with the clipping removed must fail, which shows that the audit can see the difference.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dpsql.models import dpsgd
from dpsql.models import sufficient_stats as ss
from dpsql.privacy.audit import BufferedNoise, audit, threshold_events
from dpsql.privacy.samplers import SeededNoise, ZeroNoise


def unclipped_sum(loss, X, y, w, clip):
    """The deliberately broken variant: per-example gradients summed without clipping."""
    return dpsgd.per_example_gradients(loss, X, y, w, None).sum(axis=0)


# --- clipping and gradient sensitivity ---------------------------------------------------


@pytest.mark.parametrize("loss", dpsgd.LOSSES)
def test_each_clipped_gradient_has_norm_at_most_c(loss):
    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(500), rng.uniform(-1, 1, (500, 5))])
    y = rng.uniform(-1, 1, 500) if loss == "squared" else rng.integers(0, 2, 500)
    w = rng.normal(0, 5, 6)  # far from the optimum: large residuals
    g = dpsgd.per_example_gradients(loss, X, y, w, 0.3)
    assert np.linalg.norm(g, axis=1).max() <= 0.3 * (1 + 1e-12)
    assert np.linalg.norm(dpsgd.per_example_gradients(loss, X, y, w, None), axis=1).max() > 1
    # The vectorised sum is the sum of the clipped per-example gradients.
    assert np.allclose(dpsgd.clipped_gradient_sum(loss, X, y, w, 0.3), g.sum(axis=0))


def _one_step(gradient_sum, rows_per_unit=3, clip=0.5):
    """|Δ(summed gradient)| between D and D′ (one unit of R outlier rows added), noise off."""
    rng = np.random.default_rng(1)
    base = np.column_stack([np.ones(40), rng.uniform(-1, 1, (40, 3))])
    outlier = np.tile([1.0, 1.0, -1.0, 1.0], (rows_per_unit, 1))
    y_base, y_out = rng.uniform(-1, 1, 40), np.full(rows_per_unit, -1.0)
    config = dpsgd.DPSGDConfig(1.0, 1e-6, steps=1, sample_rate=1.0, clip=clip,
                               learning_rate=1.0, l2=0.0, rows_per_unit=rows_per_unit)  # fmt: skip
    plan = dpsgd.plan_dpsgd(config)
    w0 = np.array([0.0, 5.0, 5.0, 5.0])  # train from here: residuals of the outlier are huge

    def run(X, y, units):
        rows = dpsgd.unit_rows(units, len(X), rows_per_unit)
        got = {}

        def spy(loss, Xb, yb, w, c):
            got["sum"] = gradient_sum(loss, Xb, yb, w + w0, c)
            return got["sum"]

        dpsgd.train_dpsgd(plan, "squared", X, y, rows, ZeroNoise(), gradient_sum=spy)
        return got["sum"]

    d = run(base, y_base, np.arange(40))
    d2 = run(
        np.vstack([base, outlier]), np.r_[y_base, y_out], np.r_[np.arange(40), [99] * rows_per_unit]
    )
    return float(np.linalg.norm(d2 - d)), rows_per_unit * clip


def test_one_unit_moves_the_clipped_sum_by_at_most_r_times_c():
    change, bound = _one_step(dpsgd.clipped_gradient_sum)
    assert 0 < change <= bound * (1 + 1e-12)


def test_without_clipping_the_bound_fails():
    """The same check on the broken variant: the test above would catch skipped clipping."""
    change, bound = _one_step(unclipped_sum)
    assert change > 5 * bound


def test_training_loop_clips_by_default():
    """train_dpsgd's default gradient is the clipped one (a refactor that drops it fails)."""
    import inspect

    default = inspect.signature(dpsgd.train_dpsgd).parameters["gradient_sum"].default
    assert default is dpsgd.clipped_gradient_sum


# --- sufficient statistics sensitivity -----------------------------------------------------


@pytest.mark.parametrize("features", [1, 2, 4])
def test_statistics_sensitivity_is_attained_at_the_corners(features):
    """Every corner row of [−1, 1]^d × [−1, 1] moves the statistics by at most the stated
    L1 / L2 sensitivity, and the all-ones corner attains it (so it is tight)."""
    plan = ss.plan_sufficient_stats(1.0, 1e-6, features, rows_per_unit=1)
    worst1 = worst2 = 0.0
    for corner in itertools.product([-1.0, 0.0, 1.0], repeat=features + 1):
        z = np.array([[1.0, *corner[:-1]]])
        v = ss.exact_statistics(z, np.array([corner[-1]]))
        worst1, worst2 = max(worst1, np.abs(v).sum()), max(worst2, np.linalg.norm(v))
    assert worst1 == pytest.approx(plan.l1) and worst2 == pytest.approx(plan.l2)
    r3 = ss.plan_sufficient_stats(1.0, 1e-6, features, rows_per_unit=3)
    assert r3.l1 == pytest.approx(3 * plan.l1) and r3.l2 == pytest.approx(3 * plan.l2)


def test_statistics_noise_is_calibrated():
    plan = ss.plan_sufficient_stats(1.0, 1e-6, 3, noise="laplace")
    assert plan.scale == pytest.approx(plan.l1 / 1.0) and plan.cost.delta == 0
    g = ss.plan_sufficient_stats(1.0, 1e-6, 3)
    # σ meets (ε, δ) through the Gaussian's RDP curve, and a 1% smaller σ would not.
    assert ss.gaussian_sigma_rdp(g.l2, 1.0, 1e-6) == g.scale
    from dpsql.privacy.rdp import DEFAULT_ORDERS, rdp_to_epsilon

    a = np.asarray(DEFAULT_ORDERS)
    for sigma, ok in [(g.scale, True), (0.99 * g.scale, False)]:
        eps = rdp_to_epsilon(DEFAULT_ORDERS, a * g.l2**2 / (2 * sigma**2), 1e-6)[0]
        assert (eps <= 1.0) is ok


def test_dpsgd_cost_is_the_sum_of_its_parts():
    plan = dpsgd.plan_dpsgd(dpsgd.DPSGDConfig(2.0, 1e-6, steps=300, sample_rate=0.02))
    assert plan.count_epsilon + plan.sgd_epsilon == pytest.approx(2.0)
    assert plan.accounted_epsilon <= plan.sgd_epsilon
    assert plan.cost.epsilon == 2.0 and plan.cost.delta == 1e-6
    wide = dpsgd.plan_dpsgd(
        dpsgd.DPSGDConfig(2.0, 1e-6, steps=300, sample_rate=0.02, rows_per_unit=4)
    )
    assert wide.noise_std == pytest.approx(4 * plan.noise_std)


# --- empirical audit -----------------------------------------------------------------------

RUNS = 3000


def _audit_statistic(gradient_sum, sample_rate: float, seed: int):
    """One step of DP-SGD on D (20 rows at x = 0) and D′ (plus one row at x = 1, y = 1).

    The statistic is the feature weight rescaled to the noisy gradient sum: base rows have
    x = 0, so on D it is pure noise N(0, σ²) and on D′ it is shifted by the outlier's gradient
    (when sampled) — C after clipping, ~0.7 without.
    """
    clip = 0.02
    config = dpsgd.DPSGDConfig(1.0, 1e-5, steps=1, sample_rate=sample_rate, clip=clip,
                               learning_rate=1.0, l2=0.0)  # fmt: skip
    plan = dpsgd.plan_dpsgd(config)
    source = BufferedNoise(SeededNoise(seed))
    X_d = np.column_stack([np.ones(20), np.zeros(20)])
    X_d2 = np.vstack([X_d, [1.0, 1.0]])
    y_d, y_d2 = np.zeros(20), np.r_[np.zeros(20), 1.0]
    out = []
    for X, y in ((X_d, y_d), (X_d2, y_d2)):
        rows = dpsgd.unit_rows(None, len(X), 1)
        stats = np.empty(RUNS)
        for i in range(RUNS):
            w, noisy_n = dpsgd.train_dpsgd(
                plan, "logistic", X, y, rows, source, gradient_sum=gradient_sum
            )
            stats[i] = -w[1] * max(sample_rate * noisy_n, 1.0)  # = g₁ + noise
        out.append(stats / plan.noise_std)  # in units of σ
    return plan, out


@pytest.mark.parametrize("sample_rate", [1.0, 0.5])
def test_audit_passes_the_calibrated_mechanism(sample_rate):
    _, (s_d, s_d2) = _audit_statistic(dpsgd.clipped_gradient_sum, sample_rate, seed=11)
    events = threshold_events("stat", s_d, s_d2, np.linspace(-4, 6, 21))
    report = audit(events, RUNS, RUNS, epsilon=1.0, delta=1e-5, confidence=0.99)
    assert not report.violated, str(report)


@pytest.mark.parametrize("sample_rate", [1.0, 0.5])
def test_audit_catches_the_unclipped_variant(sample_rate):
    _, (s_d, s_d2) = _audit_statistic(unclipped_sum, sample_rate, seed=12)
    events = threshold_events("stat", s_d, s_d2, np.linspace(-4, 6, 21))
    report = audit(events, RUNS, RUNS, epsilon=1.0, delta=1e-5, confidence=0.99)
    assert report.violated and report.epsilon_lower > 1.0, str(report)
