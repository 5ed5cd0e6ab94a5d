"""The budget rule: a pure filter for delta = 0, one zCDP filter (or the pure one) for delta > 0."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import special

import dpsql
from dpsql.privacy.accounting import (
    Budget,
    Cost,
    epsilon_to_rho,
    rho_to_epsilon,
    zcdp_cap,
    zcdp_epsilon,
)
from dpsql.privacy.ledger import MemoryLedger


@pytest.mark.parametrize("epsilon,delta", [(0.1, 1e-6), (1.0, 1e-5), (10.0, 1e-9)])
def test_epsilon_to_rho_inverts_the_conversion(epsilon: float, delta: float) -> None:
    rho = epsilon_to_rho(epsilon, delta)
    assert rho_to_epsilon(rho, delta) == pytest.approx(epsilon, rel=1e-12)
    assert rho_to_epsilon(rho * 1.001, delta) > epsilon


def _gaussian_delta(rho: float, epsilon: float) -> float:
    """The exact δ(ε) of the Gaussian mechanism whose zCDP is exactly ρ (Balle & Wang 2018):
    sensitivity 1, σ = 1/√(2ρ). ρ-zCDP of a Gaussian is tight, so no valid conversion can
    claim a smaller ε than this profile at the same δ."""
    sigma = 1 / math.sqrt(2 * rho)
    a, b = 1 / (2 * sigma), epsilon * sigma
    return float(special.ndtr(a - b) - math.exp(epsilon) * special.ndtr(-a - b))


@pytest.mark.parametrize("rho", [1e-4, 0.05, 0.5, 3.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-7, 1e-10])
def test_tight_conversion_is_valid_and_tighter(rho: float, delta: float) -> None:
    eps = zcdp_epsilon(rho, delta)
    assert eps <= rho_to_epsilon(rho, delta)
    # Valid: the Gaussian with exactly this ρ is (eps, δ)-DP, and not far from tight.
    assert _gaussian_delta(rho, eps) <= delta
    assert _gaussian_delta(rho, eps * 0.8) > delta
    # The cap inverts it: the cap's conversion fits, a slightly larger ρ does not.
    cap = zcdp_cap(eps, delta)
    assert zcdp_epsilon(cap, delta) <= eps * (1 + 1e-9)
    assert cap == pytest.approx(rho, rel=1e-6)


def test_pure_filter_for_delta_zero() -> None:
    budget = Budget(1.0, 0.0)
    assert not budget.zcdp and budget.rho == 0
    assert budget.covers(Cost(1.0)) and not budget.covers(Cost(1.0 + 1e-9))
    assert not budget.covers(Cost(0.5, 1e-9))  # no delta at all
    assert not budget.covers(Cost(rho=1e-9))
    assert "delta = 0 admits no Gaussian" in budget.refusal_reason(Cost(rho=1e-9))
    assert budget.guarantee(Cost(0.25)) == (0.25, 0.0)


def test_delta_budget_admits_a_charge_when_either_filter_does() -> None:
    budget = Budget(1.0, 1e-6)
    assert budget.conversion_delta == pytest.approx(1e-7)
    assert budget.exact_pure_delta == Fraction(9, 10**7)
    # One large pure release: the pure filter allows it, the zCDP one would not.
    assert budget.covers(Cost(1.0)) and budget.rho < 0.5
    # A Gaussian release ends the pure route: then everything counts in zCDP.
    assert budget.covers(Cost(rho=budget.rho))
    assert not budget.covers(Cost(0.01, rho=budget.rho))
    assert "zCDP budget is spent" in budget.refusal_reason(Cost(0.01, rho=budget.rho))
    # Thresholding delta draws from its share, fixed in advance.
    assert budget.covers(Cost(0.1, 9e-7)) and not budget.covers(Cost(0.1, 1e-6))
    assert "non-public group keys" in budget.refusal_reason(Cost(0.1, 1e-6))


def test_zrho_is_eps_squared_over_two_and_sums_per_measure() -> None:
    assert Cost(0.2).exact_zrho == Fraction(1, 50)
    assert Cost(0.2, rho=0.01).exact_zrho == Fraction(1, 50) + Fraction(1, 100)
    # A query built from its 4 per-measure costs of ε/4 pays 4·(ε/4)²/2, not ε²/2.
    query = sum((Cost(0.25) for _ in range(4)), Cost())
    assert query == Cost(1.0) and query.exact_zrho == Fraction(1, 8)
    assert Cost(1.0).exact_zrho == Fraction(1, 2)
    assert (-query).exact_zrho == -Fraction(1, 8)
    assert not Cost(float("nan")).is_finite


def test_thousand_small_queries_cost_under_two_epsilon() -> None:
    """The measurement of docs/ledger.md: 1,000 queries of ε = 0.01, budget δ = 1e-6."""
    budget = Budget(10.0, 1e-6)
    total = Cost()
    for _ in range(1000):
        total = total + Cost(0.01)
        assert budget.covers(total)
    assert total.exact_epsilon == 10 and total.exact_zrho == Fraction(1, 20)
    eps, delta = budget.guarantee(total)
    assert eps < 1.7 and delta == pytest.approx(1e-7)  # basic composition: 10
    # Far more fit: the zCDP cap (~1.354) holds ~27,000 queries of 0.01.
    assert budget.queries_left(Cost(), Cost(0.01)) == math.floor(
        Fraction(budget.rho) * (1 + Fraction(1, 2**40)) / Fraction(1, 20000)
    )
    assert budget.queries_left(total, Cost(0.01)) > 25_000


def test_queries_left_takes_the_better_filter_exactly() -> None:
    budget = Budget(1.0, 1e-6)
    assert budget.queries_left(Cost(), Cost(0.5)) == 2  # pure route
    assert budget.queries_left(Cost(0.3), Cost(0.1)) == 7  # exact: 0.3 + 7·0.1 = 1
    assert budget.queries_left(Cost(rho=budget.rho / 2), Cost(0.5)) == 0
    assert Budget(1.0, 0.0).queries_left(Cost(0.5), Cost(0.1)) == 5
    assert Budget(1.0, 0.0).queries_left(Cost(), Cost(delta=1e-9)) == 0


def test_remaining_and_unspent() -> None:
    budget = Budget(10.0, 1e-6)
    assert budget.remaining(Cost()) == (10.0, pytest.approx(9e-7))
    left, _ = budget.remaining(Cost(10.0))  # the pure route is used up, zCDP is not
    assert left == pytest.approx(math.sqrt(2 * (budget.rho - 50)) if budget.rho > 50 else 0)
    eps, _ = budget.remaining(Cost(rho=0.1))
    assert eps == pytest.approx(math.sqrt(2 * (budget.rho - 0.1)))
    assert budget.unspent(Cost(1.0)) == (pytest.approx(9.0), pytest.approx(1e-6))


def _empirical_loss(epsilon: float, k: int, seed: int) -> np.ndarray:
    """Privacy losses of k randomized responses (the worst ε-DP pair, loss ±ε each)."""
    rng = np.random.default_rng(seed)
    p = math.exp(epsilon) / (1 + math.exp(epsilon))
    signs = np.where(rng.random((20_000, k)) < p, 1.0, -1.0)
    return epsilon * signs.sum(axis=1)


def test_composed_randomized_response_meets_the_zcdp_guarantee() -> None:
    """An audit of the conversion: k ε-DP steps, loss L; δ(ε*) = E[(1 − e^(ε*−L))+] <= D."""
    budget = Budget(3.0, 1e-3)
    k, eps = 200, 0.05  # zrho 0.25 <= cap ~0.283; Σε = 10 > 3
    total = sum((Cost(eps) for _ in range(k)), Cost())
    assert budget.covers(total) and total.epsilon > budget.epsilon  # pure would refuse
    claimed, _ = budget.guarantee(total)
    loss = _empirical_loss(eps, k, seed=7)
    hockey = float(np.mean(np.maximum(0.0, 1 - np.exp(claimed - loss))))
    assert hockey <= budget.conversion_delta  # 20,000 draws: the estimate is ~0 here


def _policy(tmp_path, **privacy) -> dict:
    (tmp_path / "t.csv").write_text("x\n1\n2\n3\n", encoding="utf-8")
    return {
        "privacy": {"budget_epsilon": 1.0, "budget_delta": 1e-5, **privacy},
        "tables": {"t": {"source": str(tmp_path / "t.csv"), "columns": {"x": {"type": "int"}}}},
    }


def test_gaussian_query_on_a_delta_budget_shares_the_zcdp_filter(tmp_path) -> None:
    ledger = MemoryLedger()
    with dpsql.connect(policy=_policy(tmp_path, epsilon=0.1), ledger=ledger) as conn:
        cur = conn.cursor()
        cur.execute("SELECT COUNT(*) FROM t")  # pure ε = 0.1
        cur.execute("SET mechanism = 'gaussian'")
        cur.execute("SET delta = 1e-7")
        cur.execute("SELECT COUNT(*) FROM t")
        spent = ledger.spent("default", "default")
        assert spent.epsilon == pytest.approx(0.1) and spent.rho > 0
        assert spent.exact_zrho == Fraction(1, 200) + spent.exact_rho
        budget = conn.service.policy.budget
        assert budget.epsilon_of(spent) < 1.0


def test_gaussian_query_on_a_delta_zero_budget_is_refused(tmp_path) -> None:
    ledger = MemoryLedger()
    policy = _policy(tmp_path, budget_delta=0.0)
    with dpsql.connect(policy=policy, ledger=ledger) as conn:
        cur = conn.cursor()
        cur.execute("SET mechanism = 'gaussian'")
        cur.execute("SET delta = 1e-7")
        with pytest.raises(dpsql.BudgetExhaustedError, match="delta = 0") as info:
            cur.execute("SELECT COUNT(*) FROM t")
        assert info.value.sqlstate == "53400"
        assert ledger.spent("default", "default").is_zero


def test_policy_rejects_a_bad_share(tmp_path) -> None:
    with pytest.raises(dpsql.PolicyError, match="gaussian_share"):
        dpsql.connect(policy=_policy(tmp_path, gaussian_share=1.5))


def test_show_budget_reports_the_guarantee_and_queries_left(tmp_path) -> None:
    policy = _policy(tmp_path, epsilon=0.01, budget_epsilon=10.0, budget_delta=1e-6)
    with dpsql.connect(policy=policy, ledger=MemoryLedger(), cache=False) as conn:
        cur = conn.cursor()
        for i in range(20):
            cur.execute(f"SELECT COUNT(*) FROM t WHERE x > {i}")
        cur.execute("SHOW budget WIDE")
        (row,) = cur.fetchall()
        values = dict(zip([d[0] for d in cur.description], row, strict=True))
    budget = Budget(10.0, 1e-6)
    spent = sum((Cost(0.01) for _ in range(20)), Cost())
    assert values["charged_epsilon"] == pytest.approx(0.2)
    assert values["spent_rho"] == pytest.approx(20 * 0.01**2 / 2)
    assert values["spent_epsilon"] == pytest.approx(0.2)  # pure route is better here
    assert values["unspent_epsilon"] == pytest.approx(9.8)
    assert values["queries_left"] == budget.queries_left(spent, Cost(0.01)) > 27_000
