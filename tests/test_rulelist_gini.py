"""Gini criterion, local / smooth sensitivity, support threshold and budget split (spec §2-§6)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

from dpsql.rulelist.gini import (
    BETA_1,
    gini_scores,
    impurity_mass,
    local_sensitivity,
    local_sensitivity_add,
    node_gini,
    smooth_sensitivity,
    smooth_sensitivity_bruteforce,
    support_threshold,
)
from dpsql.rulelist.learner import MECHANISMS, LearnerParams, plan_budget


def _g(a: int, b: int, c: int, d: int) -> float:
    """G of a rule catching a negatives + b positives, leaving c + d (spec §2, by hand)."""
    n = a + b + c + d
    if n == 0:
        return 0.0
    g = 0.0
    for neg, pos in ((a, b), (c, d)):
        m = neg + pos
        if m:
            p = pos / m
            g += m / n * (1 - p**2 - (1 - p) ** 2)
    return g


def test_gini_table_by_hand():
    # rule catches (1 neg, 3 pos), leaves (4 neg, 0 pos): G = 4/8·(1-9/16-1/16) = 0.1875
    g, gc = gini_scores(8, 3, np.array([4.0]), np.array([3.0]))
    assert g[0] == pytest.approx(0.1875) and gc[0] == pytest.approx(0.1875)
    # pure split -> 0; empty catch -> G = node Gini
    g, _ = gini_scores(8, 4, np.array([4.0, 0.0]), np.array([4.0, 0.0]))
    assert g[0] == 0.0 and g[1] == pytest.approx(node_gini(8, 4)) == pytest.approx(0.5)
    for a, b, c, d in itertools.product(range(4), repeat=4):
        n = a + b + c + d
        g, _ = gini_scores(n, b + d, np.array([a + b]), np.array([b]))
        assert g[0] == pytest.approx(_g(a, b, c, d), abs=1e-12)


def _tables(n: int):
    for a in range(n + 1):
        for b in range(n + 1 - a):
            for c in range(n + 1 - a - b):
                yield a, b, c, n - a - b - c


def _neighbours(t):
    for i in range(4):
        up = list(t)
        up[i] += 1
        yield "add", tuple(up)
        if t[i] > 0:
            down = list(t)
            down[i] -= 1
            yield "remove", tuple(down)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 20])
def test_local_sensitivity_table_is_exact(n):
    """Brute force over every 2×2 count table of size n and every one-sample change."""
    worst = {"add": 0.0, "remove": 0.0}
    for t in _tables(n):
        for kind, u in _neighbours(t):
            worst[kind] = max(worst[kind], abs(_g(*t) - _g(*u)))
    # add-only: the paper's (Fletcher & Islam) formula, attained
    assert worst["add"] == pytest.approx(float(local_sensitivity_add(n)), rel=1e-12)
    # add/remove: our default bound, attained
    both = max(worst["add"], worst["remove"])
    assert both == pytest.approx(float(local_sensitivity(n, strict=True)), rel=1e-12)
    assert local_sensitivity(n, strict=False) == pytest.approx(local_sensitivity_add(n))


def test_unnormalised_impurity_is_monotone_with_sensitivity_below_two():
    """H = n·G: adding a sample never lowers it and raises it by < 2 (the monotone_em proof).

    Every 2×2 count table with up to 30 samples, every cell incremented (vectorised).
    """
    t = np.array([u for n in range(31) for u in _tables(n)], dtype=np.float64)

    def h(a):
        return impurity_mass(a[:, 0] + a[:, 1], a[:, 1]) + impurity_mass(a[:, 2] + a[:, 3], a[:, 3])

    base = h(t)
    worst = 0.0
    for cell in range(4):
        up = t.copy()
        up[:, cell] += 1
        diff = h(up) - base
        assert diff.min() >= -1e-12
        worst = max(worst, float(diff.max()))
        # the "stop" option (node impurity) moves the same way
        n, n1 = t.sum(axis=1), t[:, 1] + t[:, 3]
        d0 = impurity_mass(n + 1, n1 + (cell % 2)) - impurity_mass(n, n1)
        assert d0.min() >= -1e-12 and d0.max() < 2
    assert (impurity_mass(t.sum(axis=1), t[:, 1] + t[:, 3]) >= base - 1e-12).all()
    assert 1.9 < worst < 2.0


def test_smooth_sensitivity_closed_form_matches_bruteforce():
    """Theorem 4.1 (O(1)) against max_k e^{-kβ} LS(max(Λ, ñ-k)) on 6000 random cases."""
    rng = np.random.default_rng(20240318)
    cases = 0
    for strict in (False, True):
        for _ in range(3000):
            n = int(rng.integers(1, 1500))
            floor = int(rng.integers(1, n + 1)) if rng.random() < 0.5 else int(rng.integers(1, 6))
            floor = min(floor, n)
            # 30% around 3 - 2√2 (interior maxima), the rest log-uniform
            near = rng.random() < 0.3
            beta = float(rng.uniform(0.05, 0.25) if near else 10 ** rng.uniform(-4, 0.5))
            fast = smooth_sensitivity(n, beta, floor, strict=strict)
            slow = smooth_sensitivity_bruteforce(n, beta, floor, strict=strict)
            assert fast == pytest.approx(slow, rel=1e-12), (n, beta, floor, strict)
            cases += 1
    assert cases == 6000
    # the spec's named interior-maximum case and the double root at β = 3 - 2√2
    assert smooth_sensitivity(11, 0.1184, 1, strict=False) == pytest.approx(
        smooth_sensitivity_bruteforce(11, 0.1184, 1, strict=False)
    )
    assert smooth_sensitivity(50, BETA_1, 2) == pytest.approx(
        smooth_sensitivity_bruteforce(50, BETA_1, 2)
    )


def test_smooth_bound_is_beta_smooth_and_dominates_local_sensitivity():
    """The NRS conditions the privacy proof needs: S ≥ LS, S(n) ≤ e^β S(n±1) (on n ≥ Λ)."""
    rng = np.random.default_rng(7)
    for _ in range(500):
        floor = int(rng.integers(1, 300))
        beta = float(10 ** rng.uniform(-3, 0))
        n = int(rng.integers(floor, floor + 500))
        for strict in (False, True):
            s = smooth_sensitivity(n, beta, floor, strict=strict)
            assert s >= float(local_sensitivity(n, strict=strict)) * (1 - 1e-12)
            for m in (n - 1, n + 1):
                s2 = smooth_sensitivity(max(m, floor), beta, floor, strict=strict)
                assert s <= math.exp(beta) * s2 * (1 + 1e-12)


def test_smooth_sensitivity_typical_value():
    # spec §4.3: COMPAS, Λ = 288, ñ = 5770, Cauchy β = ε_node/6 with ε_node = 1/14
    s = smooth_sensitivity(5770, (1 / 14) / 6, 288, strict=False)
    assert s == pytest.approx(2 * 5770 / 5771**2)
    assert s == pytest.approx(3.47e-4, rel=1e-2)


@pytest.mark.parametrize(
    ("conf", "eps", "t"), [(0.98, 0.1, 33), (0.98, 1.0, 4), (0.99, 0.1, 40), (0.99, 1.0, 4)]
)
def test_support_threshold_table(conf, eps, t):
    assert support_threshold(eps, conf) == t


def test_support_threshold_confidence():
    # P(Lap(1/ε) ≤ T) = 1 - ½e^{-εT} ≥ C, and T - 1 is not enough (unless at the boundary)
    for conf in (0.9, 0.95, 0.99, 0.999):
        for eps in (0.01, 0.07, 0.5, 2.0):
            t = support_threshold(eps, conf)
            assert 1 - 0.5 * math.exp(-eps * t) >= conf
            assert 1 - 0.5 * math.exp(-eps * (t - 1.0)) < conf + 1e-12 or t == 1


@pytest.mark.parametrize("mechanism", [m for m in MECHANISMS if m != "none"])
@pytest.mark.parametrize("length", [1, 2, 3, 5, 7])
def test_budget_split_sums_to_epsilon(mechanism, length):
    p = LearnerParams(epsilon=0.7, delta=1e-6, max_length=length, mechanism=mechanism)
    plan = plan_budget(p)
    assert plan.epsilon_node * plan.steps == pytest.approx(0.7)
    assert plan.cost.epsilon == pytest.approx(0.7)
    if mechanism in ("smooth_laplace", "global_gaussian") and length > 1:
        assert plan.delta_node * (length - 1) == pytest.approx(1e-6)
        assert plan.cost.delta == pytest.approx(1e-6)
    else:
        assert plan.cost.delta == 0.0
    if mechanism.startswith("smooth") and length > 1:
        assert plan.steps == 3 * length - 2  # the paper's 3L-1 leaves one share unspent
        paper = plan_budget(replace(p, paper_budget=True))
        assert paper.steps == 3 * length - 1


def test_default_delta_is_one_over_n_squared():
    plan = plan_budget(LearnerParams(max_length=5), n_rows=1000)
    assert plan.cost.delta == pytest.approx(1e-6)
    assert plan.delta_node == pytest.approx(1e-6 / 4)
