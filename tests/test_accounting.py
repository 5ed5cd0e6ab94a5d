"""The budget rule: filters that stay valid under adaptive querying, split in advance."""

from __future__ import annotations

import math

import pytest

import dpsql
from dpsql.privacy.accounting import Budget, Cost, epsilon_to_rho, rho_to_epsilon
from dpsql.privacy.ledger import MemoryLedger


@pytest.mark.parametrize("epsilon,delta", [(0.1, 1e-6), (1.0, 1e-5), (10.0, 1e-9)])
def test_epsilon_to_rho_inverts_the_conversion(epsilon: float, delta: float) -> None:
    rho = epsilon_to_rho(epsilon, delta)
    assert rho_to_epsilon(rho, delta) == pytest.approx(epsilon, rel=1e-12)
    assert rho_to_epsilon(rho * 1.001, delta) > epsilon


def test_pure_budget_is_a_basic_composition_filter() -> None:
    budget = Budget(1.0, 1e-6)
    assert budget.covers(Cost(1.0, 1e-6))
    assert not budget.covers(Cost(1.0 + 1e-6))
    assert not budget.covers(Cost(0.5, 2e-6))
    assert not budget.covers(Cost(rho=1e-9))  # no Gaussian part reserved
    assert "no budget for Gaussian" in budget.refusal_reason(Cost(rho=1e-9))


def test_gaussian_share_splits_epsilon_and_delta_in_advance() -> None:
    budget = Budget(2.0, 2e-6, gaussian_share=0.25)
    assert budget.pure_epsilon == pytest.approx(1.5)
    assert budget.pure_delta == pytest.approx(1e-6)
    assert budget.rho == pytest.approx(epsilon_to_rho(0.5, 1e-6))
    assert budget.covers(Cost(1.5, 1e-6, budget.rho))
    assert not budget.covers(Cost(1.6))
    assert not budget.covers(Cost(rho=budget.rho * 1.01))
    # Everything unspent, converted back, is the whole epsilon.
    assert budget.remaining(Cost())[0] == pytest.approx(2.0)


def test_all_gaussian_budget_refuses_pure_epsilon() -> None:
    budget = Budget(1.0, 1e-5, gaussian_share=1.0)
    assert budget.pure_epsilon == 0
    assert not budget.covers(Cost(epsilon=0.1))
    assert "all of its budget for Gaussian" in budget.refusal_reason(Cost(epsilon=0.1))
    assert budget.epsilon_of(Cost(rho=budget.rho)) == pytest.approx(1.0)


def _policy(tmp_path, **privacy) -> dict:
    (tmp_path / "t.csv").write_text("x\n1\n2\n3\n", encoding="utf-8")
    return {
        "privacy": {"budget_epsilon": 1.0, "budget_delta": 1e-5, **privacy},
        "tables": {"t": {"source": str(tmp_path / "t.csv"), "columns": {"x": {"type": "int"}}}},
    }


def test_gaussian_query_on_a_laplace_policy_is_refused_before_running(tmp_path) -> None:
    ledger = MemoryLedger()
    with dpsql.connect(policy=_policy(tmp_path), ledger=ledger) as conn:
        cur = conn.cursor()
        cur.execute("SET mechanism = 'gaussian'")
        cur.execute("SET delta = 1e-7")
        with pytest.raises(dpsql.BudgetExhaustedError, match="gaussian_share") as info:
            cur.execute("SELECT COUNT(*) FROM t")
        assert info.value.sqlstate == "53400"
        assert ledger.spent("default", "default").is_zero


def test_gaussian_policy_defaults_to_an_all_gaussian_budget(tmp_path) -> None:
    policy = _policy(tmp_path, mechanism="gaussian", delta=1e-7, epsilon=0.5)
    with dpsql.connect(policy=policy, ledger=MemoryLedger()) as conn:
        budget = conn.service.policy.budget
        assert budget.gaussian_share == 1.0
        conn.cursor().execute("SELECT COUNT(*) FROM t")
        spent = conn.service.ledger.spent("default", "default")
        assert spent.epsilon == 0 and spent.rho > 0
        assert budget.epsilon_of(spent) < 1.0 and math.isfinite(budget.epsilon_of(spent))


def test_policy_rejects_a_bad_share(tmp_path) -> None:
    with pytest.raises(dpsql.PolicyError, match="gaussian_share"):
        dpsql.connect(policy=_policy(tmp_path, gaussian_share=1.5))
